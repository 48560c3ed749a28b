"""The encoder-output cache: each image's placeholder embeddings, computed once per (request, image) and kept until
the request finishes, so a chunked prefill that splits a placeholder run, or a preempted request that recomputes
its prompt, never runs the vision encoder on an image twice (vLLM v1's EncoderCacheManager, per request)."""

from __future__ import annotations

import numpy as np
import torch

from pagemill.messages import MultiModalFeature


class EncoderCache:
    """Images of the requests the runner holds, and the encoder outputs computed for them so far."""

    def __init__(self) -> None:
        self.features: dict[str, list[MultiModalFeature]] = {}
        self.outputs: dict[tuple[str, int], torch.Tensor] = {}
        self.num_encoded = 0  # images run through the encoder (tests check that none runs twice)

    def add_request(self, req_id: str, features: list[MultiModalFeature] | None) -> None:
        """A request (new, or resumed after preemption: its cached outputs stay) and its images."""
        if features:
            self.features[req_id] = features

    def free(self, req_id: str) -> None:
        """A finished request: its images and outputs go."""
        features = self.features.pop(req_id, None)
        for j in range(len(features or ())):
            self.outputs.pop((req_id, j), None)

    def __bool__(self) -> bool:
        return bool(self.features)

    def _encode(self, model: torch.nn.Module, wanted: list[tuple[str, int]]) -> None:
        """Run the encoder over the images in `wanted` (one batch per pixel shape)."""
        by_shape: dict[tuple, list[tuple[str, int]]] = {}
        for key in wanted:
            f = self.features[key[0]][key[1]]
            by_shape.setdefault((tuple(f.shape), f.dtype, tuple(f.grid_thw or ())), []).append(key)
        for (shape, dtype, grid), keys in by_shape.items():
            pixels = np.stack([np.frombuffer(self.features[r][j].data, dtype=dtype).reshape(shape) for r, j in keys])
            if grid:  # patch-flattened pixels of a given (t, h, w) grid each (the Qwen2-VL family)
                outputs = model.embed_multimodal(torch.from_numpy(pixels), torch.tensor([grid] * len(keys)))
            else:
                outputs = model.embed_multimodal(torch.from_numpy(pixels))
            for key, out in zip(keys, outputs):
                length = self.features[key[0]][key[1]].length
                if out.shape[0] != length:
                    raise RuntimeError(f"the encoder gave {out.shape[0]} embeddings for an image with {length} "
                                       "placeholder tokens.")
                self.outputs[key] = out
            self.num_encoded += len(keys)

    def gather(self, model: torch.nn.Module, req_ids: list[str], computed: np.ndarray, counts: np.ndarray,
               starts: np.ndarray) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(flattened token indices, their embeddings) of the placeholder tokens among the step's tokens: request i
        computes positions [computed[i], computed[i] + counts[i]) at token indices from starts[i]. None if there
        are none. Images not encoded yet are encoded first."""
        pieces: list[tuple[tuple[str, int], int, int, int]] = []  # (image, first row, last row, first token index)
        for i, rid in enumerate(req_ids):
            features = self.features.get(rid)
            if not features:
                continue
            first, end = int(computed[i]), int(computed[i] + counts[i])
            for j, f in enumerate(features):
                s, e = max(first, f.offset), min(end, f.offset + f.length)
                if s < e:
                    pieces.append(((rid, j), s - f.offset, e - f.offset, int(starts[i]) + s - first))
        if not pieces:
            return None
        missing = list(dict.fromkeys(key for key, *_ in pieces if key not in self.outputs))
        if missing:
            self._encode(model, missing)
        index = torch.cat([torch.arange(t, t + b - a) for _, a, b, t in pieces])
        rows = torch.cat([self.outputs[key][a:b] for key, a, b, _ in pieces])
        return index, rows

    def key_limits(self, req_ids: list[str], computed: np.ndarray, counts: np.ndarray,
                   starts: np.ndarray) -> np.ndarray | None:
        """Per step token, the keys [0, limit) it attends to when image tokens see their whole image: position + 1,
        or the end of its image's placeholder run for a placeholder token. None if the step computes none."""
        limits = None
        for i, rid in enumerate(req_ids):
            first, end = int(computed[i]), int(computed[i] + counts[i])
            for f in self.features.get(rid, ()):
                s, e = max(first, f.offset), min(end, f.offset + f.length)
                if s < e:
                    if limits is None:
                        limits = np.concatenate([np.arange(c + 1, c + n + 1) for c, n in zip(computed, counts)])
                    t = int(starts[i]) - first
                    limits[t + s:t + e] = f.offset + f.length
        return limits
