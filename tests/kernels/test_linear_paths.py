"""The prepacked linear method: the fp16 GEMV path (few rows) and the oneDNN path (more rows) equal F.linear."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pagemill.layers.linear import ColumnParallelLinear
from pagemill.layers.quantization.dense import F16_GEMV_MAX_ROWS, PrepackedLinearMethod, UnquantizedLinearMethod
from tests.conftest import requires_kernels
from tests.layers.helpers import layer_context

pytestmark = requires_kernels


def _loaded(layer: ColumnParallelLinear, lin: nn.Linear) -> ColumnParallelLinear:
    layer.load_weight("weight", lin.weight.detach())
    if lin.bias is not None:
        layer.load_weight("bias", lin.bias.detach())
    layer.process_weights_after_loading()
    return layer


@pytest.mark.parametrize("rows", [1, 3, F16_GEMV_MAX_ROWS, F16_GEMV_MAX_ROWS + 1, 33])
@pytest.mark.parametrize("bias", [False, True])
def test_fast_paths_match_reference(rows: int, bias: bool) -> None:
    torch.manual_seed(rows)
    lin = nn.Linear(200, 130, bias=bias)
    fast = _loaded(ColumnParallelLinear(200, 130, bias, layer_context(linear_dtype="float16"), "x"), lin)
    ref = _loaded(ColumnParallelLinear(200, 130, bias, layer_context(False, linear_dtype="float16"), "x"), lin)
    assert isinstance(fast.quant_method, PrepackedLinearMethod) and fast.gemv_weight is not None
    assert type(ref.quant_method) is UnquantizedLinearMethod  # the reference engine: F.linear in float16
    x = torch.randn(rows, 200)
    out, expected = fast(x), ref(x)
    assert out.dtype == torch.float16 and out.shape == (rows, 130)
    torch.testing.assert_close(out.float(), expected.float(), rtol=2e-3, atol=2e-3)
    exact = torch.nn.functional.linear(x.half().float(), lin.weight.half().float(),
                                       None if lin.bias is None else lin.bias.half().float())
    torch.testing.assert_close(out.float(), exact, rtol=2e-3, atol=2e-3)
