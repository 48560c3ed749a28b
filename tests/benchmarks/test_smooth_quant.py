"""SmoothQuant as the W8A8 accuracy benchmark applies it (pagemill.benchmarks.quant_accuracy.smooth_quant_): the float
model computes the same logits, and the activations the linears read have flatter channel maxima."""

from __future__ import annotations

import pytest
import torch

from pagemill.benchmarks.quant_accuracy import _smoothing_pairs, smooth_quant_


def _norm_output_spread(model, ids: torch.Tensor) -> float:
    """max / median over channels of max |x| at the first attention input (the first norm's output)."""
    seen = {}
    norm = _smoothing_pairs(model)[0][0]
    handle = norm.register_forward_hook(lambda _m, _i, out: seen.update(x=out.detach().abs().flatten(0, -2).amax(0)))
    with torch.no_grad():
        model(ids)
    handle.remove()
    return (seen["x"].max() / seen["x"].median()).item()


@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
def test_smoothing_keeps_the_function_and_flattens_outlier_channels(tiny_models, family):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_models[family], dtype=torch.float32)
    with torch.no_grad():  # an outlier channel in the first attention input, as LLM hidden states have
        norm = _smoothing_pairs(model)[0][0]
        if family.startswith("gemma"):
            norm.weight[3] = 49.0  # Gemma's RMSNorm scales by (1 + weight)
        else:
            norm.weight[3] *= 50.0
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (1, 24), generator=gen)
    with torch.no_grad():
        before = model(ids).logits
    spread_before = _norm_output_spread(model, ids)
    calibration = [torch.randint(0, model.config.vocab_size, (32,), generator=gen).tolist() for _ in range(4)]
    assert smooth_quant_(model, calibration, alpha=0.5) == 2 * model.config.num_hidden_layers
    with torch.no_grad():
        after = model(ids).logits
    torch.testing.assert_close(after, before, rtol=1e-4, atol=1e-4)
    assert _norm_output_spread(model, ids) < spread_before / 3
