"""The records cache for safetensors checkpoints: a bfloat16 checkpoint's 16-bit tiles (and its LM head's greedy
screen) and quantization='int8' / 'int4' records are laid out on the first start and mapped on the second, which
packs nothing and generates the same tokens; a float32 checkpoint on the plain float path writes no cache."""

from __future__ import annotations

import pytest
import torch

import pagemill.layers.quantization.half_tiles as half_tiles
import pagemill.layers.quantization.weight_only as weight_only
from pagemill import LLM, SamplingParams
from pagemill.layers.head_screen import GreedyHeadScreen
from pagemill.layers.quantization.records import RecordsLinearMethod
from pagemill.layers.quantization.records_cache import wait_for_writes
from tests.conftest import SMOL_PROMPTS, requires_kernels
from tests.layers.helpers import engine_model

pytestmark = requires_kernels

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def bf16_llama(tiny_models, tmp_path_factory) -> str:
    """The tiny random Llama saved in bfloat16."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = tmp_path_factory.mktemp("bf16") / "llama-bf16"
    AutoModelForCausalLM.from_pretrained(tiny_models["llama"], dtype=torch.float32).to(torch.bfloat16).save_pretrained(
        path)
    AutoTokenizer.from_pretrained(tiny_models["llama"]).save_pretrained(path)
    return str(path)


def _run(path: str, **kwargs) -> tuple[list[list[int]], list[bool]]:
    """Greedy tokens of a fresh engine, and records_mapped of each records layer; its cache write finished."""
    llm = LLM(path, kv_cache_memory="16MiB", max_model_len=256, **kwargs)
    wait_for_writes()
    layers = [m for m in engine_model(llm).modules() if isinstance(getattr(m, "quant_method", None),
                                                                   RecordsLinearMethod)]
    outs = llm.generate(SMOL_PROMPTS[:4], GREEDY, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs], [m.records_mapped for m in layers]


def _forbid(monkeypatch: pytest.MonkeyPatch, module: object, *names: str) -> None:
    def packing(*args, **kwargs):
        raise AssertionError("records were packed although the cache holds them")

    for name in names:
        monkeypatch.setattr(module, name, packing)


def test_16_bit_tiles_are_mapped_on_the_second_start(bf16_llama, cache_dir, monkeypatch):
    want, mapped = _run(bf16_llama)
    assert mapped and not any(mapped)
    assert len(list(cache_dir.glob("*.safetensors"))) == 2  # the tiles and the head's screen
    _forbid(monkeypatch, half_tiles, "write_tile_rows")
    _forbid(monkeypatch, GreedyHeadScreen, "_pack_from_blocks")
    tokens, mapped = _run(bf16_llama)
    assert tokens == want and mapped and all(mapped)


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_weight_only_records_are_mapped_on_the_second_start(tiny_models, cache_dir, monkeypatch, quantization):
    path = tiny_models["llama"]
    want, mapped = _run(path, quantization=quantization)
    assert mapped and not any(mapped)
    _forbid(monkeypatch, weight_only, "quantize_int8", "int8_tiles")
    monkeypatch.setattr(weight_only.WeightOnlyLinearMethod, "process_weights_after_loading",
                        _mapped_only(weight_only.WeightOnlyLinearMethod.process_weights_after_loading))
    tokens, mapped = _run(path, quantization=quantization)
    assert tokens == want and mapped and all(mapped)


def _mapped_only(process):
    """process_weights_after_loading that fails for a layer with no cached records (int4 packs in C++)."""
    def run(self, layer):
        assert layer.cached_records is not None and layer.weight is None  # no float32 staging weight either
        process(self, layer)
    return run


def test_a_float32_checkpoint_writes_no_cache(tiny_models, cache_dir):
    """float32 weights of a float32 engine stay F.linear's: nothing is laid out, so nothing is cached."""
    _run(tiny_models["llama"])
    assert not cache_dir.exists() or not list(cache_dir.iterdir())
