"""Reading PEFT adapters: what is accepted, and a clear error naming the field for everything else."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from pagemill.lora.peft_adapter import load_adapter
from pagemill.lora.request import LoRARequest


def req(path: str) -> LoRARequest:
    return LoRARequest("a", 1, path)


def test_reads_pairs_rank_and_scaling(llama_adapters) -> None:
    full, qv = load_adapter(req(llama_adapters[0]), 16), load_adapter(req(llama_adapters[1]), 16)
    assert len(full.modules) == 2 * 7 and full.rank == 8
    m = full.modules["model.layers.0.self_attn.q_proj"]
    assert list(m.a.shape) == [8, 64] and list(m.b.shape) == [64, 8] and m.scaling == 2.0
    assert set(qv.modules) == {f"model.layers.{i}.self_attn.{p}_proj" for i in (0, 1) for p in "qv"}
    assert qv.modules["model.layers.1.self_attn.v_proj"].scaling == pytest.approx(7 / 2)  # rsLoRA: alpha / sqrt(r)


@pytest.mark.parametrize("bad, message", [
    ("missing_dir", "is not a directory"),
    ("no_config", "no adapter_config.json"),
    ("bad_json", "not valid JSON"),
    ("rank", "larger than max_lora_rank"),
    ("dora", "DoRA"),
    ("bias", "trains biases"),
    ("modules_to_save", "saves whole modules"),
    ("no_weights", "no adapter_model.safetensors"),
    ("corrupt_weights", "cannot be read"),
    ("not_lora", "peft_type"),
])
def test_bad_adapters_are_refused_naming_the_field(llama_adapters, tmp_path, bad: str, message: str) -> None:
    path = str(tmp_path / "adapter")
    shutil.copytree(llama_adapters[0], path)
    config_file = os.path.join(path, "adapter_config.json")
    config = json.load(open(config_file))
    weights = os.path.join(path, "adapter_model.safetensors")
    if bad == "missing_dir":
        path = str(tmp_path / "nowhere")
    elif bad == "no_config":
        os.remove(config_file)
    elif bad == "bad_json":
        open(config_file, "w").write("{not json")
    elif bad == "no_weights":
        os.remove(weights)
    elif bad == "corrupt_weights":
        open(weights, "r+b").truncate(100)
    else:
        config.update({"rank": {"r": 32}, "dora": {"use_dora": True}, "bias": {"bias": "all"},
                       "modules_to_save": {"modules_to_save": ["lm_head"]}, "not_lora": {"peft_type": "IA3"}}[bad])
        json.dump(config, open(config_file, "w"))
    with pytest.raises(ValueError, match=message) as e:
        load_adapter(req(path), 16)
    assert "lora_path" in str(e.value)


def test_lora_request_ids_are_positive() -> None:
    with pytest.raises(ValueError, match="lora_int_id"):
        LoRARequest("a", 0, "/x")
