"""The pooler: one vector per request from a step's flattened hidden states (CLS / MEAN / LAST), then the head's
post-processing (embeddings: Matryoshka truncation and L2 normalisation; classifiers: logits and activation).

A request whose prompt spans several steps (a decoder's chunked prefill) is pooled across them: its running sum
(MEAN) or first token (CLS) waits here until its last chunk, so chunking never changes the result beyond float
rounding.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from pagemill.config.pooling import PoolerConfig
from pagemill.pooling_params import PoolingParams


@dataclass
class PoolChunk:
    """One request's tokens in this step: where they are in the flattened batch and where in its prompt."""

    req_id: str
    start: int  # first row of the step's hidden states
    count: int  # rows (tokens) of this request in the step
    first: bool  # the chunk starts the prompt
    last: bool  # the chunk ends the prompt: the request is pooled now
    params: PoolingParams


def pool_segments(hidden: torch.Tensor, starts: np.ndarray, counts: np.ndarray, pooling_type: str) -> torch.Tensor:
    """[B, D]: per segment of `hidden` [T, D] its first row (CLS), last row (LAST) or the sum of its rows (MEAN;
    the caller divides)."""
    if pooling_type == "CLS":
        return hidden[torch.from_numpy(starts)]
    if pooling_type == "LAST":
        return hidden[torch.from_numpy(starts + counts - 1)]
    seg = torch.from_numpy(np.repeat(np.arange(len(counts)), counts))
    return torch.zeros(len(counts), hidden.shape[1], dtype=torch.float32).index_add_(0, seg, hidden.float())


class Pooler:
    """Pools the requests of each step; keeps the partial pools of requests whose prompt is not complete."""

    def __init__(self, config: PoolerConfig, classify: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        if config.head == "classify" and classify is None:
            raise ValueError("a classifying pooler needs the model's classifier head.")
        self.config = config
        self.pooling_type = config.pooling_type
        self.classify = classify
        self._partial: dict[str, tuple[torch.Tensor, int]] = {}  # request -> (pooled so far, tokens in it)

    def drop(self, req_id: str) -> None:
        """Forget a request's partial pool (finished, aborted or preempted: it restarts from its first token)."""
        self._partial.pop(req_id, None)

    def __call__(self, hidden: torch.Tensor, chunks: Sequence[PoolChunk]) -> dict[str, bytes]:
        """The vectors (float32 bytes) of the requests whose prompt ends in this step."""
        starts = np.fromiter((c.start for c in chunks), dtype=np.int64, count=len(chunks))
        counts = np.fromiter((c.count for c in chunks), dtype=np.int64, count=len(chunks))
        pooled = pool_segments(hidden, starts, counts, self.pooling_type).float()
        done, totals = [], []
        for i, c in enumerate(chunks):
            n = c.count
            if not (c.first and c.last):
                pooled[i], n = self._merge(c, pooled[i])
            if c.last:
                done.append(i)
                totals.append(n)
        if not done:
            return {}
        idx = torch.tensor(done)
        vectors = pooled[idx]
        if self.pooling_type == "MEAN":
            vectors = vectors / torch.tensor(totals, dtype=torch.float32).unsqueeze(1)
        finished = [chunks[i] for i in done]
        if self.config.head == "classify":
            return self._classify(vectors, finished)
        return self._embed(vectors, finished)

    def _merge(self, c: PoolChunk, chunk_pool: torch.Tensor) -> tuple[torch.Tensor, int]:
        """Fold this chunk into the request's partial pool; (pool so far, tokens so far)."""
        prev = None if c.first else self._partial.get(c.req_id)
        if prev is None:
            pool, n = chunk_pool, c.count
        elif self.pooling_type == "MEAN":
            pool, n = prev[0] + chunk_pool, prev[1] + c.count
        elif self.pooling_type == "CLS":
            pool, n = prev[0], prev[1] + c.count
        else:  # LAST
            pool, n = chunk_pool, prev[1] + c.count
        if c.last:
            self._partial.pop(c.req_id, None)
        else:
            self._partial[c.req_id] = (pool.clone(), n)
        return pool, n

    def _embed(self, vectors: torch.Tensor, chunks: list[PoolChunk]) -> dict[str, bytes]:
        """Matryoshka truncation, then L2 normalisation (per request, the model's default unless it says)."""
        default = bool(self.config.normalize)
        out = {}
        rows = vectors.numpy()
        norms = F.normalize(vectors, dim=-1).numpy()
        for i, c in enumerate(chunks):
            normalize = default if c.params.normalize is None else c.params.normalize
            d = c.params.dimensions
            if d is None:
                out[c.req_id] = (norms[i] if normalize else rows[i]).tobytes()
            else:
                v = vectors[i, :d]
                out[c.req_id] = (F.normalize(v, dim=-1) if normalize else v).numpy().tobytes()
        return out

    def _classify(self, vectors: torch.Tensor, chunks: list[PoolChunk]) -> dict[str, bytes]:
        """The classifier's logits, through sigmoid (one label) or softmax unless a request turns that off."""
        logits = self.classify(vectors).float()
        probs = torch.sigmoid(logits) if logits.shape[1] == 1 else torch.softmax(logits, dim=-1)
        logits, probs = logits.numpy(), probs.numpy()
        return {c.req_id: (logits[i] if c.params.activation is False else probs[i]).tobytes()
                for i, c in enumerate(chunks)}
