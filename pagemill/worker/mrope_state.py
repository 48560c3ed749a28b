"""Per-request M-RoPE positions for the Qwen2-VL family: a prompt with images keeps its [3, P] position ids and its
delta (vLLM's mrope_position_delta); every other token's three ids are its index + delta (0 without images)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch


class MRopeState:
    """The runner's M-RoPE bookkeeping: `add` when a request arrives, `positions` per step, `free` when it ends."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.prompts: dict[str, np.ndarray] = {}  # req id -> [3, prompt len] (requests with images only)
        self.deltas: dict[str, int] = {}

    def add(self, req_id: str, num_prompt_tokens: int, features: list | None) -> None:
        """A new (or resumed) request: its prompt's positions when it has images."""
        if features:
            pos, delta = self.model.mrope_prompt_positions(num_prompt_tokens, features)
            self.prompts[req_id], self.deltas[req_id] = pos, delta
        else:
            self.prompts.pop(req_id, None)
            self.deltas.pop(req_id, None)

    def free(self, req_id: str) -> None:
        """A finished request."""
        self.prompts.pop(req_id, None)
        self.deltas.pop(req_id, None)

    def positions(self, req_ids: list[str], positions: np.ndarray, computed: np.ndarray, counts: np.ndarray,
                  starts: np.ndarray) -> torch.Tensor:
        """[3, T] position ids of a step's tokens (token indices `positions`, request i's from `starts[i]`)."""
        deltas = np.fromiter((self.deltas.get(r, 0) for r in req_ids), dtype=np.int64, count=len(req_ids))
        out = np.repeat((positions + np.repeat(deltas, counts))[None], 3, axis=0)
        for i, rid in enumerate(req_ids):  # prefill chunks of prompts with images: their precomputed ids
            pos = self.prompts.get(rid)
            if pos is None or computed[i] >= pos.shape[1]:
                continue
            k = min(int(counts[i]), pos.shape[1] - int(computed[i]))
            out[:, starts[i]:starts[i] + k] = pos[:, computed[i]:computed[i] + k]
        return torch.from_numpy(out)
