"""int8 codes of a float weight per group of inputs: symmetric or asymmetric grids, optionally fitted for the least
squared error (llama.cpp's make_qx_quants / make_qkx2_quants search, vectorized over every group), and gemv_int8's
tiles of them.

- symmetric: w = d * q, q in [-127, 127]; d = max|w| / 127 (the plain fit, Q8_0's).
- asymmetric: w = d * q + m, q in [-128, 127]; d = (max - min) / 255 and m = min + 128 d (the plain fit): 255 steps
  across the group's range rather than 254 across twice its largest magnitude.
- search: each group tries `SEARCH_STEPS` inverse scales around the plain fit's, rounds, solves the least-squares
  d (and m) for those codes, and keeps the candidate with the lowest squared error.
"""

from __future__ import annotations

import torch

from pagemill.layers.quantization.gguf_records import GEMV_TILE, Int8Codes

QMAX_SYMMETRIC = 127
LEVELS_ASYMMETRIC = 255  # code steps across a group's range (q + 128 in 0..255)
SEARCH_STEPS = torch.linspace(-1.0, 1.0, 5).tolist()  # candidate offsets of the levels spanned, around the plain fit
PARENT_GROUP = 32  # the asymmetric search's coarser candidate grid (GGUF's block: Q4_1, Q8_0, ...)
_CHUNK_GROUPS = 1 << 16  # groups fitted at once (bounds the candidates' temporaries)


def _lstsq_scale(x: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Per group (last dim), the d minimizing sum (d q - x)^2; 0 where every code is 0."""
    qq = (q * q).sum(-1, keepdim=True)
    return torch.where(qq > 0, (x * q).sum(-1, keepdim=True) / qq.clamp_min(1e-30), torch.zeros_like(qq))


def _lstsq_scale_min(x: torch.Tensor, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per group (last dim), the (d, m) minimizing sum (d q + m - x)^2; d = 0, m = mean x where the codes are equal."""
    n = x.shape[-1]
    sq, sx = q.sum(-1, keepdim=True), x.sum(-1, keepdim=True)
    sqq, sqx = (q * q).sum(-1, keepdim=True), (q * x).sum(-1, keepdim=True)
    det = n * sqq - sq * sq
    ok = det > 0
    d = torch.where(ok, (n * sqx - sq * sx) / det.clamp_min(1e-30), torch.zeros_like(det))
    m = torch.where(ok, (sqq * sx - sq * sqx) / det.clamp_min(1e-30), sx / n)
    return d, m


def _fit_symmetric(g: torch.Tensor, search: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes q in [-127, 127] and scales d [groups, 1] of groups g [groups, G] (w = d q)."""
    amax = g.abs().amax(-1, keepdim=True)
    safe = torch.where(amax > 0, amax, torch.ones_like(amax))
    best_d = amax / QMAX_SYMMETRIC
    best_q = (g / torch.where(best_d > 0, best_d, torch.ones_like(best_d))).round_().clamp_(-QMAX_SYMMETRIC,
                                                                                          QMAX_SYMMETRIC)
    if not search:
        return best_q, best_d
    best_err = (best_d * best_q - g).square_().sum(-1, keepdim=True)
    for step in SEARCH_STEPS:
        q = (g * ((QMAX_SYMMETRIC + step) / safe)).round_().clamp_(-QMAX_SYMMETRIC, QMAX_SYMMETRIC)
        d = _lstsq_scale(g, q)
        err = (d * q - g).square_().sum(-1, keepdim=True)
        better = err < best_err
        best_q, best_d, best_err = torch.where(better, q, best_q), torch.where(better, d, best_d), torch.minimum(
            err, best_err)
    return best_q, best_d


def _parent_grid(g: torch.Tensor, factor: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The plain asymmetric fit (d, m) of each run of `factor` consecutive groups, repeated for each of its groups."""
    runs = g.reshape(-1, factor * g.shape[1])
    lo, hi = runs.amin(-1, keepdim=True), runs.amax(-1, keepdim=True)
    return ((hi - lo) / LEVELS_ASYMMETRIC).repeat_interleave(factor, 0), lo.repeat_interleave(factor, 0)


def _fit_asymmetric(g: torch.Tensor, search: bool, parent: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Codes l in [0, 255], scales d and offsets m [groups, 1] of groups g [groups, G] (w = d l + m). The search
    also tries the grid of `parent` consecutive groups (a weight already on a coarser grid comes back exactly)."""
    lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
    span = hi - lo
    safe = torch.where(span > 0, span, torch.ones_like(span))
    best_d, best_m = span / LEVELS_ASYMMETRIC, lo
    best_l = ((g - lo) * (LEVELS_ASYMMETRIC / safe)).round_().clamp_(0, LEVELS_ASYMMETRIC)
    if not search:
        return best_l, best_d, best_m
    best_err = (best_d * best_l + best_m - g).square_().sum(-1, keepdim=True)
    for step in SEARCH_STEPS:
        iscale = (LEVELS_ASYMMETRIC + step) / safe
        # Centre the shrunk or stretched grid on the group's range, then let least squares place it exactly.
        origin = lo - (LEVELS_ASYMMETRIC - (LEVELS_ASYMMETRIC + step)) / (2 * iscale)
        l = ((g - origin) * iscale).round_().clamp_(0, LEVELS_ASYMMETRIC)
        d, m = _lstsq_scale_min(g, l)
        err = (d * l + m - g).square_().sum(-1, keepdim=True)
        better = (err < best_err) & (d > 0)
        best_l, best_d, best_m = (torch.where(better, l, best_l), torch.where(better, d, best_d),
                                  torch.where(better, m, best_m))
        best_err = torch.where(better, err, best_err)
    if parent > 1:
        d, m = _parent_grid(g, parent)
        l = ((g - m) / torch.where(d > 0, d, torch.ones_like(d))).round_().clamp_(0, LEVELS_ASYMMETRIC)
        better = ((d * l + m - g).square_().sum(-1, keepdim=True) < best_err) & (d > 0)
        best_l, best_d, best_m = (torch.where(better, l, best_l), torch.where(better, d, best_d),
                                  torch.where(better, m, best_m))
    return best_l, best_d, best_m


def quantize_int8(w: torch.Tensor, group: int, asymmetric: bool, search: bool) -> Int8Codes:
    """int8 codes of a float weight [N, K] (K a multiple of `group`) per group of `group` inputs: q * scale
    (+ min for the asymmetric grid, whose codes are l - 128). An asymmetric search with groups of 16 also tries each
    group of 32's grid (where K allows)."""
    n, k = w.shape
    parent = PARENT_GROUP // group if asymmetric and search and k % PARENT_GROUP == 0 else 1
    flat = w.detach().float().reshape(-1, group)
    q = torch.empty(flat.shape, dtype=torch.int8)
    scale = torch.empty(flat.shape[0], 1)
    mins = torch.empty(flat.shape[0], 1) if asymmetric else None
    for g0 in range(0, flat.shape[0], _CHUNK_GROUPS):
        g = flat[g0:g0 + _CHUNK_GROUPS]
        if asymmetric:
            l, d, m = _fit_asymmetric(g, search, parent)
            q[g0:g0 + len(g)] = (l - 128).to(torch.int8)
            scale[g0:g0 + len(g)], mins[g0:g0 + len(g)] = d, m + 128 * d
        else:
            qs, d = _fit_symmetric(g, search)
            q[g0:g0 + len(g)], scale[g0:g0 + len(g)] = qs.to(torch.int8), d
    return Int8Codes(q.view(n, k), scale.view(n, k // group), None if mins is None else mins.view(n, k // group),
                     group)


def dequantize_int8(c: Int8Codes) -> torch.Tensor:
    """The float32 weight [N, K] the codes stand for: q * scale (+ min), per group."""
    n, k = c.q.shape
    w = c.q.float().view(n, -1, c.group) * c.scale.unsqueeze(-1)
    if c.min is not None:
        w += c.min.unsqueeze(-1)
    return w.view(n, k)


def int8_tiles(c: Int8Codes) -> list[torch.Tensor]:
    """gemv_int8's [q int8 [T, K, 64], scales fp32 [T, K / G, 64]] (+ mins, same shape) of the codes."""
    out = [_tiles(c.q), _tiles(c.scale)]
    if c.min is not None:
        out.append(_tiles(c.min))
    return out


def _tiles(x: torch.Tensor) -> torch.Tensor:
    """[N, C] -> [ceil(N / 64), C, 64] contiguous (channel last; rows past N are zeros)."""
    n, cols = x.shape
    t = -(-n // GEMV_TILE)
    out = x.new_zeros(t * GEMV_TILE, cols)
    out[:n] = x
    return out.view(t, GEMV_TILE, cols).transpose(1, 2).contiguous()
