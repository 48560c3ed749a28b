"""RoPE tables of the scaled types (Llama 3's "llama3", YaRN, longrope) come from transformers' own init functions,
which need the model's configuration class: the first start of a config saves the table in the metadata cache, and a
later start reads back the same bits without building the config class."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, Phi3Config, Qwen2Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

import pagemill.layers.rotary as rotary
from pagemill.config.config_snapshot import ConfigSnapshot
from pagemill.utils.cache_dirs import metadata_cache_dir

CONFIGS = {
    "llama3": lambda: LlamaConfig(hidden_size=256, num_attention_heads=4, max_position_embeddings=8192,
                                  rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
                                                   "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                   "original_max_position_embeddings": 8192}),
    "yarn": lambda: Qwen2Config(hidden_size=256, num_attention_heads=4, max_position_embeddings=32768,
                                rope_parameters={"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 4.0,
                                                 "original_max_position_embeddings": 8192}),
    "longrope": lambda: Phi3Config(hidden_size=256, num_attention_heads=4, max_position_embeddings=131072,
                                   original_max_position_embeddings=4096,
                                   rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                                    "short_factor": [1.0 + i / 64 for i in range(32)],
                                                    "long_factor": [2.0 + i / 16 for i in range(32)],
                                                    "original_max_position_embeddings": 4096}),
}


@pytest.fixture
def cache_root(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEMILL_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("PAGEMILL_METADATA_CACHE", raising=False)
    return tmp_path


@pytest.mark.parametrize("kind", sorted(CONFIGS))
def test_a_later_start_reads_the_same_table_without_the_config_class(kind, cache_root, monkeypatch):
    config = CONFIGS[kind]()
    rope_type = config.rope_parameters["rope_type"]
    want, want_scaling = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"))
    snapshot = ConfigSnapshot.of(config)
    first, first_scaling = rotary._inv_freq(snapshot, None)
    assert len(list(metadata_cache_dir().glob("rope-*.json"))) == 1

    def no_config_class(config):
        raise AssertionError("the configuration class was built although the table is cached")

    monkeypatch.setattr(rotary, "as_transformers_config", no_config_class)
    second, second_scaling = rotary._inv_freq(snapshot, None)
    for got, scaling in ((first, first_scaling), (second, second_scaling)):
        assert torch.equal(got.view(torch.int32), want.float().view(torch.int32))  # the same bits
        assert scaling == float(want_scaling)
    if kind == "yarn":
        assert second_scaling != 1.0  # YaRN's attention factor survives the round trip


def test_another_config_gets_its_own_table(cache_root):
    a, b = CONFIGS["llama3"](), CONFIGS["llama3"]()
    b.rope_parameters["factor"] = 8.0
    ta, _ = rotary._inv_freq(ConfigSnapshot.of(a), None)
    tb, _ = rotary._inv_freq(ConfigSnapshot.of(b), None)
    assert not torch.equal(ta, tb)
    assert len(list(metadata_cache_dir().glob("rope-*.json"))) == 2


def test_cache_off_builds_every_time(cache_root, monkeypatch):
    monkeypatch.setenv("PAGEMILL_METADATA_CACHE", "0")
    rotary._inv_freq(ConfigSnapshot.of(CONFIGS["llama3"]()), None)
    assert not metadata_cache_dir().exists() or not list(metadata_cache_dir().glob("rope-*.json"))
