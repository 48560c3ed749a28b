"""Shared checks for the kernel tests."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _every_kernel_variant(kernel_isa):
    """Every kernel test runs on each ISA variant this CPU can execute."""
    yield


def assert_gemv_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    """out matches the float reference within one fp16 rounding (fp16 out) or fp32 noise, relative to max |ref|."""
    err = (out.float() - ref).abs().max().item()
    scale = ref.abs().max().item() + 1e-6
    tol = 1e-3 if out.dtype == torch.float16 else 1e-5
    assert err <= tol * scale, f"max error {err:.3g} vs max |ref| {scale:.3g}"
