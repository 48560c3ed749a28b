"""float16 / bfloat16 checkpoint weights kept in their 16 bits under the float32 default.

A float32 engine reads each 16-bit weight widened to float32, and widening is exact. So instead of a float32 copy
(twice the file) a linear holds the checkpoint's own values rearranged into GEMV tiles [ceil(N / 64), K, 64] of the
same dtype, and the kernels (gemv_f16 / gemv_bf16) widen them in registers: the products and sums are float32, as in
F.linear, at half the bytes per token. safetensors and GGUF F16 / BF16 tensors both come here (the dense config's
`tensor_dtypes` names them); an LM head also keeps its row-major 16-bit table (the file's, mapped) for the greedy head
screen's exact rechecks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from pagemill.layers.quantization.records import HALF_TILE_KINDS, RecordsLinearMethod
from pagemill.utils.memory import file_mapped, release_mapped_pages

if TYPE_CHECKING:
    from pagemill.kernels.ops import TorchLayerOps

TILE = 64  # output channels per tile (gemv.cpp's NT)
HALF_KINDS = {dtype: kind for kind, dtype in HALF_TILE_KINDS.items()}  # torch dtype -> tile kind
GGUF_FLOAT_DTYPES = {0: torch.float32, 1: torch.float16, 30: torch.bfloat16}  # ggml F32 / F16 / BF16
# gguf_rows' ggml type for a 16-bit row-major table
ROW_TYPES = {dtype: t for t, dtype in GGUF_FLOAT_DTYPES.items() if dtype in HALF_KINDS}


def half_values(loaded: Any, dtype: torch.dtype) -> torch.Tensor:
    """A checkpoint tensor as `dtype` values: a tensor of that dtype as is (a view of the file), a lazy GGUF F16 /
    BF16 weight as its stored values; another float tensor (a GGUF weight decoded for tensor-parallel slicing) is
    narrowed when that is exact, else refused."""
    if isinstance(loaded, torch.Tensor):
        if loaded.dtype == dtype:
            return loaded
        narrowed = loaded.to(dtype)
        if not loaded.is_floating_point() or not torch.equal(narrowed.to(loaded.dtype), loaded):
            raise ValueError(f"a {loaded.dtype} checkpoint tensor whose values are not all {dtype} values, where the "
                             f"checkpoint's {dtype} weight was expected")
        return narrowed
    if hasattr(loaded, "stored_values"):
        return half_values(loaded.stored_values(), dtype)
    raise ValueError(f"expected a {dtype} checkpoint tensor, got {type(loaded).__name__}")


def write_tile_rows(tiles: torch.Tensor, rows: torch.Tensor, start: int) -> None:
    """tiles [T, K, 64] rows [start, start + n) = rows [n, K] (row r is tiles[r // 64, :, r % 64])."""
    n, k = rows.shape
    if start < 0 or start + n > tiles.shape[0] * TILE:
        raise ValueError(f"rows [{start}, {start + n}) reach beyond the tiles' {tiles.shape[0] * TILE}")
    i = 0
    while i < n:
        t, c = divmod(start + i, TILE)
        if c == 0 and n - i >= TILE:  # whole tiles in one copy
            full = (n - i) // TILE
            tiles[t:t + full].copy_(rows[i:i + full * TILE].reshape(full, TILE, k).transpose(1, 2))
            i += full * TILE
        else:
            m = min(TILE - c, n - i)
            tiles[t, :, c:c + m].copy_(rows[i:i + m].t())
            i += m


def pack_half_tiles(w: torch.Tensor) -> torch.Tensor:
    """A [N, K] float16 / bfloat16 weight as gemv_f16 / gemv_bf16 tiles [ceil(N / 64), K, 64] of its dtype."""
    tiles = torch.zeros(-(-w.shape[0] // TILE), w.shape[1], TILE, dtype=w.dtype)
    write_tile_rows(tiles, w, 0)
    return tiles


class HalfTilesLinearMethod(RecordsLinearMethod):
    """A linear whose checkpoint weight is float16 or bfloat16, held as 16-bit GEMV tiles (its only copy) and
    multiplied in float32: F.linear's values on the widened weight, at every row count."""

    def __init__(self, weight_dtype: torch.dtype, ops: TorchLayerOps) -> None:
        super().__init__(HALF_KINDS[weight_dtype], str(weight_dtype).removeprefix("torch."), torch.float32, ops)
        self.weight_dtype = weight_dtype

    def create_weights(self, layer: nn.Module, in_features: int, out_features: int) -> None:
        """The tiles an earlier start packed (mapped from the records cache), else room for them, filled as the
        checkpoint's parts arrive (pages are committed as they are written)."""
        layer.in_features, layer.out_features = in_features, out_features
        shape = (-(-out_features // TILE), in_features, TILE)
        cached = self.cached_records()
        layer.half_mapped = isinstance(cached, torch.Tensor) and cached.shape == shape and cached.dtype == (
            self.weight_dtype)
        if layer.half_mapped:
            layer.half_tiles = cached
        else:
            layer.half_tiles = torch.empty(shape, dtype=self.weight_dtype)
            layer.half_tiles[-1, :, out_features % TILE or TILE:] = 0  # the padding channels (parts fill the rest)
        layer.half_parts = []  # (the part's row-major values, whether they view the file): an LM head's rows

    def load_weight(self, layer: nn.Module, loaded: Any, row_offset: int, shard_index: int) -> None:
        """Write the part's rows into the tiles (nothing to write when they are mapped from the cache)."""
        rows = half_values(loaded, self.weight_dtype)
        if rows.dim() != 2 or rows.shape[1] != layer.in_features:
            raise ValueError(f"checkpoint tensor has shape {tuple(rows.shape)}, expected [rows, {layer.in_features}]")
        if row_offset < 0 or row_offset + rows.shape[0] > layer.out_features:
            raise ValueError(f"rows [{row_offset}, {row_offset + rows.shape[0]}) reach beyond the layer's "
                             f"{layer.out_features}")
        in_file = rows.is_contiguous() and file_mapped(rows)
        if not layer.half_mapped:
            write_tile_rows(layer.half_tiles, rows, row_offset)
            if in_file:  # read once: the file's pages leave the resident set (the map lives on in any view of it)
                release_mapped_pages(rows)
        layer.half_parts.append((rows, in_file))

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Install the tiles as the layer's one segment. A one-part layer whose rows view the checkpoint file keeps
        that view (`gguf_rows`: an LM head's screen rechecks its candidates there)."""
        self.install_records(layer, layer.half_tiles, layer.half_mapped)
        parts, layer.half_parts = layer.half_parts, []
        del layer.half_tiles, layer.half_mapped
        layer.gguf_rows = None
        if len(parts) == 1 and parts[0][1] and layer.in_features % 32 == 0:
            rows = parts[0][0]
            layer.gguf_rows = (rows.view(torch.uint8).view(rows.shape[0], -1, 64), ROW_TYPES[self.weight_dtype])
