"""The LM head for greedy rows: int8 logits screened, then every token that could be a row's maximum recomputed
exactly in float32 (csrc/cpu/variant/head_screen.cpp has the bound). The argmax is float32's, bit for bit in which token
wins; the other logits are approximate, so only rows that need nothing but the argmax may use it."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch
from torch import nn

from pagemill.layers.quantization.records_cache import RecordsCache
from pagemill.utils.memory import file_mapped, release_mapped_pages

if TYPE_CHECKING:
    from pagemill.kernels.ops import TorchLayerOps

# Fewer greedy rows than this take the exact head when it streams quantized records (a Q8_0 table: at 1-3 rows both
# read the same int8 bytes from memory and the screen only adds its recheck), unless one row through the screen was
# measured faster at start-up (K-quant heads whose decoding is compute-bound, e.g. Q6_K on AVX2: 27 ms exact vs
# ~11 ms screened for Llama-3.2-1B's head on a Zen 3). A float head (4 bytes per weight, or 2) takes the screen from
# one row: its int8 codes are a quarter of the bytes.
HEAD_SCREEN_MIN_ROWS = 4
_CALIBRATION_RUNS = 3  # timed one-row calls of each head path (the best counts)
_SCREEN_WINS = 0.85  # the screen must take at most this fraction of the exact head's time to be used at one row
SCREEN_TILE = 64  # channels per tile of the screen's codes (pack_head_screen)
_PACK_CHUNK_ROWS = 64 * SCREEN_TILE  # rows of a quantized head decoded at a time while its screen is packed
_CACHE_KEY = "lm_head.screen"


class GreedyHeadScreen:
    """int8 screen of an LM head [vocab, hidden] (VNNI / AVX2 int8 dot products) whose exact rows come from its float32
    table, or from the GGUF blocks of a quantized head (`table_ggml_type`, decoded per candidate row)."""

    def __init__(self, table: torch.Tensor, ops: TorchLayerOps, min_rows: int = HEAD_SCREEN_MIN_ROWS,
                 table_ggml_type: int = 0, in_features: int | None = None, cache: RecordsCache | None = None) -> None:
        self.table, self.ops, self.table_ggml_type = table, ops, table_ggml_type
        self.in_features = table.shape[1] if table_ggml_type == 0 else in_features
        self.min_rows = min_rows  # fewer greedy rows take the exact head
        cached = cache.lookup(_CACHE_KEY) if cache is not None else None
        self.mapped = cached is not None  # the codes view the cache file's map (read-only)
        if cached is not None:  # a quantized head's screen, packed by an earlier start
            self.q, self.scales, self.offsets, self.bounds = cached[1]
        elif table_ggml_type == 0:
            self.q, self.scales, self.offsets, self.bounds = ops.pack_head_screen(table)
        else:
            self._pack_from_blocks()
            if cache is not None:
                cache.add(_CACHE_KEY, "head_screen", [self.q, self.scales, self.offsets, self.bounds])
                cache.save()
        self.recomputed = 0  # logits recomputed exactly so far (a statistic: a few per row)
        self.rows = 0

    def _pack_from_blocks(self) -> None:
        """The screen of a quantized head, packed a chunk of rows at a time from their decoded float32 values (no
        float table of the whole head is ever held)."""
        n, k = self.table.shape[0], self.in_features
        tiles = -(-n // SCREEN_TILE)
        self.q = torch.empty(tiles, k // 4, SCREEN_TILE, 4, dtype=torch.int8)
        self.scales = torch.empty(tiles, k // 32, SCREEN_TILE)
        self.offsets = torch.empty(tiles, k // 32, SCREEN_TILE, dtype=torch.int32)
        self.bounds = torch.empty(tiles, 2, SCREEN_TILE)
        rows = torch.empty(min(n, _PACK_CHUNK_ROWS), k)
        in_file = self.table.is_contiguous() and file_mapped(self.table)
        for r0 in range(0, n, _PACK_CHUNK_ROWS):
            r1 = min(n, r0 + _PACK_CHUNK_ROWS)
            chunk = rows[:r1 - r0]
            self.ops.gguf_rows(chunk, self.table, self.table_ggml_type, torch.arange(r0, r1))
            if in_file:  # read once here; the rechecks read a few rows again
                release_mapped_pages(self.table[r0:r1])
            t0 = r0 // SCREEN_TILE
            for whole, part in zip((self.q, self.scales, self.offsets, self.bounds), self.ops.pack_head_screen(chunk)):
                whole[t0:t0 + part.shape[0]] = part

    @classmethod
    def for_head(cls, head: nn.Module, ops: TorchLayerOps) -> "GreedyHeadScreen | None":
        """A screen of the head's float32 table (its own weight or the tied embedding's) or of its GGUF blocks (a
        quantized head), or None when it has neither (e.g. a float16 head, or int8 / int4 records of its own)."""
        if (getattr(head, "tp_size", 1) != 1 or not ops.has_kernel("head_screen")
                or getattr(head, "bias", None) is not None):
            return None
        table = getattr(head, "weight", None)
        if isinstance(table, torch.Tensor):
            if table.dtype != torch.float32 or table.dim() != 2 or not table.is_contiguous() or table.shape[1] % 32:
                return None
            return cls(table, ops, 1)  # a float table: quantized heads keep no float weight
        rows = getattr(head, "gguf_rows", None)
        if rows is None or head.in_features % 32 or not ops.has_kernel("gguf_rows"):
            return None
        blocks, ggml_type = rows
        cache = getattr(getattr(head, "quant_method", None), "cache", None)  # the GGUF file's records cache
        screen = cls(blocks, ops, HEAD_SCREEN_MIN_ROWS, ggml_type, head.in_features,
                     cache.sibling("head_screen") if cache is not None else None)
        # The path one greedy row takes; the other one's mapped pages, touched by the timing, leave the resident set
        # until a batch (or a sampled row) reads them again.
        if screen.one_row_is_faster(head):
            screen.min_rows = 1
            head.quant_method.release_resident_records(head)
        elif screen.mapped:
            for t in (screen.q, screen.scales, screen.offsets, screen.bounds):
                release_mapped_pages(t)
        return screen

    def one_row_is_faster(self, head: nn.Module) -> bool:
        """Whether one row through the screen beats the head's exact records, timed on a random hidden state (the
        argmax is exact either way: this only picks the faster path)."""
        x = torch.randn(1, self.in_features, generator=torch.Generator().manual_seed(0))
        paths = {"exact": lambda: head.quant_method.apply(head, x), "screen": lambda: self.logits(x)}
        best = {}
        for name, run in paths.items():
            run()  # warm: first-touch of mapped pages, thread wake-up
            times = []
            for _ in range(_CALIBRATION_RUNS):
                start = time.perf_counter()
                run()
                times.append(time.perf_counter() - start)
            best[name] = min(times)
        self.recomputed = self.rows = 0  # (statistics of real rows only)
        return best["screen"] < _SCREEN_WINS * best["exact"]

    @property
    def nbytes(self) -> int:
        """Bytes the screen adds to the head (its int8 codes, scales, offsets and per-channel bounds)."""
        return sum(t.numel() * t.element_size() for t in (self.q, self.scales, self.offsets, self.bounds))

    def logits(self, hidden: torch.Tensor, bitmask: torch.Tensor | None = None,
               mask_rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """[rows, hidden] -> (float32 logits [rows, vocab] whose row maxima are exactly float32's, the rows' argmax
        tokens [rows] (int64; the first maximum, as torch's max)).

        With a structured-output `bitmask` (int32 [R, ceil(vocab / 32)], bit set = allowed) and `mask_rows` (int64
        [rows]: the bitmask row of each row, -1 for none), a masked row's maximum and argmax are over its allowed
        tokens: the argmax of the float32 logits with the disallowed ones at -inf (its other entries stay
        approximate, the disallowed ones unmasked)."""
        x = hidden.to(torch.float32).contiguous()
        out = torch.empty(x.shape[0], self.table.shape[0], dtype=torch.float32)
        tokens = torch.empty(x.shape[0], dtype=torch.int64)
        self.recomputed += self.ops.head_screen(out, x, self.q, self.scales, self.offsets, self.table, self.bounds,
                                                tokens, bitmask, mask_rows, table_ggml_type=self.table_ggml_type)
        self.rows += x.shape[0]
        return out, tokens
