"""The GPU runner's persistent step inputs: device tensors allocated once, filled each step from host staging
buffers (pinned, copied with non_blocking=True, when the device is CUDA; on the CPU the staging buffer *is* the
device buffer). Attention metadata and CUDA graphs read views of these, so a captured graph sees each step's inputs.

`pad_decode` lays out a decode batch padded to a CUDA-graph bucket: padding tokens read and write only the null
block 0 at position 0 (never a request's KV).
"""

from __future__ import annotations

import bisect

import numpy as np
import torch


def decode_buckets(max_num_seqs: int) -> list[int]:
    """Batch sizes CUDA graphs are captured for (vLLM's): 1, 2, 4, then multiples of 8, up to max_num_seqs (which
    is always one)."""
    sizes = [b for b in (1, 2, 4) if b < max_num_seqs] + list(range(8, max_num_seqs, 8))
    return sorted(set(sizes) | {max_num_seqs})


def bucket_for(num_reqs: int, buckets: list[int]) -> int | None:
    """The smallest bucket holding `num_reqs` decodes (None: more than the largest, or none)."""
    if num_reqs <= 0:
        return None
    i = bisect.bisect_left(buckets, num_reqs)
    return buckets[i] if i < len(buckets) else None


class StepBuffers:
    """Persistent input tensors on `device` (+ host staging twins): token ids, positions, slots per KV group, each
    token's request index and position (int32, for the Triton kernel), block tables per group."""

    def __init__(self, device: torch.device, max_tokens: int, max_reqs: int, max_blocks: int,
                 num_groups: int) -> None:
        self.device = device
        self.on_host = device.type == "cpu"
        pin = device.type == "cuda"
        self.max_tokens, self.max_reqs, self.max_blocks = max_tokens, max_reqs, max_blocks
        self.host: dict[str, torch.Tensor] = {}
        self.dev: dict[str, torch.Tensor] = {}
        for name, shape, dtype in (("input_ids", (max_tokens,), torch.int64),
                                   ("positions", (max_tokens,), torch.int64),
                                   ("slot_mapping", (num_groups, max_tokens), torch.int64),
                                   ("token_req", (max_tokens,), torch.int32),
                                   ("token_pos", (max_tokens,), torch.int32),
                                   ("block_table", (num_groups, max_reqs, max_blocks), torch.int32),
                                   # async scheduling: where the previous step's tokens go, and which of them
                                   ("token_feed", (2, max_reqs), torch.int64)):
            host = torch.zeros(shape, dtype=dtype, pin_memory=pin)
            self.host[name] = host
            self.dev[name] = host if self.on_host else torch.zeros(shape, dtype=dtype, device=device)
        self.np = {name: t.numpy() for name, t in self.host.items()}
        # CUDA: recorded after a step's copies; the next step's staging waits for it before writing the pinned
        # buffers (with async scheduling a step is staged while the previous one's copies may still be queued)
        self.copied: torch.cuda.Event | None = None

    def stage(self, input_ids: np.ndarray, positions: np.ndarray, slot_mapping: np.ndarray, token_req: np.ndarray,
              tables: np.ndarray, pad_to: int | None = None) -> tuple[int, int]:
        """Write one step's inputs (`tables`: [groups, B, blocks]) into the buffers, padded to `pad_to` tokens
        (= requests: a decode bucket) with null-block padding; returns (tokens, requests) as laid out."""
        n, b = len(input_ids), tables.shape[1]
        if n > self.max_tokens or b > self.max_reqs:
            raise ValueError(f"a step of {n} tokens / {b} requests exceeds the runner's buffers "
                             f"({self.max_tokens} / {self.max_reqs})")
        t = pad_to or n
        if self.copied is not None:
            self.copied.synchronize()
        h = self.np
        h["input_ids"][:n] = input_ids
        h["positions"][:n] = positions
        h["slot_mapping"][:, :n] = slot_mapping
        h["token_req"][:n] = token_req
        h["token_pos"][:n] = positions
        mb = min(tables.shape[2], self.max_blocks)
        h["block_table"][:, :b, :mb] = tables[:, :, :mb]
        if t > n:  # padding: token j is request j (a bucket is a decode batch), position 0, slot 0 of block 0
            h["input_ids"][n:t] = 0
            h["positions"][n:t] = 0
            h["slot_mapping"][:, n:t] = 0
            h["token_req"][n:t] = np.arange(n, t)
            h["token_pos"][n:t] = 0
            h["block_table"][:, b:t, :1] = 0
        if not self.on_host:
            for name in ("input_ids", "positions", "token_req", "token_pos"):
                self.dev[name][:t].copy_(self.host[name][:t], non_blocking=True)
            self.dev["slot_mapping"][:, :t].copy_(self.host["slot_mapping"][:, :t], non_blocking=True)
            rows = max(t, b)
            self.dev["block_table"][:, :rows, :mb].copy_(self.host["block_table"][:, :rows, :mb], non_blocking=True)
            self.copied = torch.cuda.Event()
            self.copied.record()
        return t, max(t if pad_to else b, b)

    def stage_token_feed(self, at: np.ndarray, index: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """(at, index) on the device through the pinned buffer, after `stage` in the same step: a copy from pageable
        memory would make the host wait for the device's queued work, which is what async scheduling overlaps."""
        n = len(at)
        h = self.np["token_feed"]
        h[0, :n] = at
        h[1, :n] = index
        if not self.on_host:
            self.dev["token_feed"][:, :n].copy_(self.host["token_feed"][:, :n], non_blocking=True)
            self.copied = torch.cuda.Event()  # the next step's staging waits for this copy too
            self.copied.record()
        feed = self.dev["token_feed"]
        return feed[0, :n], feed[1, :n]

    def views(self, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(input ids [tokens], positions [tokens]) on the device."""
        return self.dev["input_ids"][:tokens], self.dev["positions"][:tokens]

    def attn_tensors(self, group: int, tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(slot mapping [tokens], block table [max_reqs, max_blocks], token's request [tokens], token's position
        [tokens]) of KV cache group `group` on the device."""
        d = self.dev
        return d["slot_mapping"][group, :tokens], d["block_table"][group], d["token_req"][:tokens], \
            d["token_pos"][:tokens]
