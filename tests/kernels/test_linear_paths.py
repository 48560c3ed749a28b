"""ReducedPrecisionLinear: the GEMV path (few rows) and the prepacked oneDNN path (more rows) equal F.linear."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pagemill.kernels import ops
from pagemill.layers.linear import GEMV_MAX_ROWS, ReducedPrecisionLinear
from tests.conftest import requires_kernels

pytestmark = requires_kernels


@pytest.mark.parametrize("rows", [1, 3, GEMV_MAX_ROWS[torch.float16], GEMV_MAX_ROWS[torch.float16] + 1, 33])
@pytest.mark.parametrize("bias", [False, True])
def test_fast_paths_match_reference(rows: int, bias: bool) -> None:
    torch.manual_seed(rows)
    lin = nn.Linear(200, 130, bias=bias)
    layer = ReducedPrecisionLinear(lin, torch.float16)
    assert layer._gemv_weight is not None
    x = torch.randn(rows, 200)
    with ops.use_kernels(False):
        ref = layer(x)
    with ops.use_kernels(True):
        out = layer(x)
    assert out.dtype == torch.float16 and out.shape == (rows, 130)
    torch.testing.assert_close(out.float(), ref.float(), rtol=2e-3, atol=2e-3)
    exact = torch.nn.functional.linear(x.half().float(), lin.weight.half().float(),
                                       None if lin.bias is None else lin.bias.half().float())
    torch.testing.assert_close(out.float(), exact, rtol=2e-3, atol=2e-3)
