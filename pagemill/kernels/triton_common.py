"""Triton helpers shared by pagemill's Triton kernels (attention, layer ops)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def cast_rne(x, dtype: tl.constexpr):
    """float32 x cast to `dtype`, rounding to nearest, ties to even: a bfloat16 target is rounded by its bits first
    (then the cast is exact, compiled or interpreted: the interpreter's own bfloat16 cast truncates)."""
    if dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        x = bits.to(tl.float32, bitcast=True)
    return x.to(dtype)
