"""Config snapshots and the metadata cache: a snapshot reads as the transformers config it was taken from, a second
start reads config and tokenizer from the cache and builds neither."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys

import pytest
import torch
from transformers import AutoConfig, Gemma3Config, GPT2Config, LlamaConfig

from pagemill.config.config_snapshot import ConfigSnapshot, UnsavableConfig, as_transformers_config
from pagemill.loader.metadata_cache import cached_config, cached_tokenizer, metadata_cache_dir
from pagemill.loader.tokenizer import _build_gguf_tokenizer, load_tokenizer


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEMILL_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("PAGEMILL_METADATA_CACHE", raising=False)
    return tmp_path / "cache" / "metadata"


def _attributes(config) -> dict:
    return {k: v for k, v in vars(config).items() if k != "_snapshot"}


def _with_type(config) -> dict:
    """A transformers config's attributes with its model_type (a class attribute until it is loaded)."""
    return {"model_type": type(config).model_type, **vars(config)}


def test_snapshot_reads_as_the_config():
    config = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
                         max_position_embeddings=16384,
                         rope_parameters={"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0,
                                          "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                          "original_max_position_embeddings": 8192}, dtype=torch.bfloat16)
    snap = ConfigSnapshot.of(config)
    assert _attributes(snap) == _with_type(config)
    assert snap.dtype is torch.bfloat16 and snap.id2label == {0: "LABEL_0", 1: "LABEL_1"}
    assert snap.rope_scaling == config.rope_parameters and snap.num_labels == 2 and snap.torch_dtype is torch.bfloat16
    assert snap.get_text_config() is snap
    assert not hasattr(snap, "no_such_attribute")
    with pytest.raises(AttributeError, match="no_such_attribute"):
        snap.no_such_attribute  # noqa: B018
    assert _attributes(pickle.loads(pickle.dumps(snap))) == _with_type(config)
    rebuilt = snap.to_transformers()
    assert type(rebuilt) is LlamaConfig and rebuilt.to_dict() == config.to_dict()
    assert as_transformers_config(config) is config


def test_snapshot_aliases_and_sub_configs():
    gpt2 = ConfigSnapshot.of(GPT2Config(n_embd=96, n_layer=3, n_head=4))
    assert gpt2.hidden_size == 96 and gpt2.num_hidden_layers == 3 and gpt2.num_attention_heads == 4
    gemma = Gemma3Config(text_config={"hidden_size": 64, "num_hidden_layers": 2, "head_dim": 16})
    snap = ConfigSnapshot.of(gemma)
    text = snap.get_text_config()
    assert isinstance(text, ConfigSnapshot) and text is snap.text_config
    assert _attributes(text) == _with_type(gemma.get_text_config())
    assert _attributes(snap.vision_config) == _with_type(gemma.vision_config)
    assert snap.to_dict() == gemma.to_dict()


def test_unsavable_values_keep_the_transformers_config(cache_dir, tmp_path):
    config = LlamaConfig(hidden_size=64, num_attention_heads=4)
    config.odd = {1.5: "a float key"}
    with pytest.raises(UnsavableConfig, match="dict"):
        ConfigSnapshot.encode(config)
    source = tmp_path / "model.gguf"
    source.write_bytes(b"x")
    assert cached_config(str(source), lambda: config) is config
    assert not cache_dir.exists()


def test_cached_config_is_built_once_per_file_version(cache_dir, tmp_path):
    source = tmp_path / "model.gguf"
    source.write_bytes(b"weights")
    built = []

    def build():
        built.append(1)
        return LlamaConfig(hidden_size=64, num_attention_heads=4, vocab_size=100 + len(built))

    first = cached_config(str(source), build)
    again = cached_config(str(source), build)
    assert len(built) == 1 and isinstance(again, ConfigSnapshot) and _attributes(again) == _attributes(first)
    assert [p.name.endswith(".config.json") for p in cache_dir.iterdir()] == [True]
    os.utime(source, ns=(1, 1))  # an edited file: a new cache entry
    assert cached_config(str(source), build).vocab_size == 102 and len(built) == 2
    (next(p for p in cache_dir.iterdir() if p.stat().st_mtime_ns == max(q.stat().st_mtime_ns
                                                                        for q in cache_dir.iterdir()))
     ).write_text("{damaged")
    assert cached_config(str(source), build).vocab_size == 103  # a damaged file is rebuilt


def test_the_directory_keeps_under_its_limit(cache_dir, tmp_path, monkeypatch):
    """Beyond PAGEMILL_METADATA_CACHE_MAX_GB a write removes the least recently used entries; a hit counts as use."""
    sources = []
    for i in range(3):
        sources.append(tmp_path / f"model{i}.gguf")
        sources[-1].write_bytes(b"weights")
        cached_config(str(sources[-1]), lambda: LlamaConfig(hidden_size=64, num_attention_heads=4))
    entries = sorted(cache_dir.iterdir(), key=lambda p: p.stat().st_mtime_ns)
    for age, path in enumerate(reversed(entries)):  # model0's entry the oldest
        os.utime(path, (path.stat().st_mtime - 100 * (age + 1),) * 2)
    cached_config(str(sources[0]), lambda: pytest.fail("a cached config was rebuilt"))  # now the most recent
    size = entries[0].stat().st_size
    monkeypatch.setenv("PAGEMILL_METADATA_CACHE_MAX_GB", str(2.5 * size / 2**30))
    sources.append(tmp_path / "model3.gguf")
    sources[-1].write_bytes(b"weights")
    cached_config(str(sources[-1]), lambda: LlamaConfig(hidden_size=64, num_attention_heads=4))
    assert sorted(cache_dir.iterdir()) == sorted([entries[0], max(cache_dir.iterdir(), key=os.path.getmtime)])
    assert not entries[1].exists() and not entries[2].exists()


def test_cache_off(cache_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEMILL_METADATA_CACHE", "0")
    source = tmp_path / "model.gguf"
    source.write_bytes(b"weights")
    assert isinstance(cached_config(str(source), lambda: LlamaConfig()), ConfigSnapshot)
    assert not cache_dir.exists()


def test_cached_tokenizer_is_the_built_one(cache_dir, smol_path):
    config = AutoConfig.from_pretrained(os.path.dirname(smol_path), gguf_file=os.path.basename(smol_path))
    built = _build_gguf_tokenizer(smol_path, config)
    first = load_tokenizer(smol_path, smol_path)
    cached = cached_tokenizer(smol_path, lambda: pytest.fail("built again"))
    for tok in (first, cached):
        assert type(tok) is type(built)
        assert tok.backend_tokenizer.to_str() == built.backend_tokenizer.to_str()
        assert {k: repr(v) for k, v in vars(tok).items() if k != "_tokenizer"} == \
            {k: repr(v) for k, v in vars(built).items() if k != "_tokenizer"}
        chat = [{"role": "user", "content": "What is the capital of France?"}]
        assert tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == \
            built.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert sorted(p.suffix for p in metadata_cache_dir().iterdir()) == [".json", ".pkl"]


_SECOND_START = r"""
import json, sys
from pagemill import LLM, SamplingParams
llm = LLM(max_model_len=256, kv_cache_memory="64MiB")
text = llm.generate(["The capital of France is"], SamplingParams(max_tokens=6, temperature=0))[0].outputs[0].text
built = [m for m in ("transformers.models.llama.configuration_llama", "transformers.integrations.gguf.reader",
                     "transformers.activations") if m in sys.modules]
print("RESULT " + json.dumps({"text": text, "built": built}))
"""


def test_second_start_builds_neither_config_nor_tokenizer(tmp_path):
    """A fresh process that finds the cache imports no transformers config class and no GGUF tokenizer reader, and
    generates what the first start did."""
    env = dict(os.environ, PAGEMILL_CACHE_DIR=str(tmp_path), PAGEMILL_RECORDS_CACHE="0")
    results = []
    for _ in range(2):
        out = subprocess.run([sys.executable, "-c", _SECOND_START], env=env, capture_output=True, text=True,
                             timeout=300)
        assert out.returncode == 0, out.stderr[-3000:]
        results.append(json.loads(out.stdout.split("RESULT ", 1)[1]))
    first, second = results
    assert "transformers.models.llama.configuration_llama" in first["built"]  # the first start did build them
    assert second["built"] == [] and second["text"] == first["text"]


@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "phi3", "gpt2",
                                        "starcoder2", "falcon", "olmo2", "qwen3_moe"])
def test_tokenizer_class_by_config_class_name_is_transformers_choice(model_type):
    """A snapshot has no config class: the tokenizer class found by the class's name is the one transformers'
    TOKENIZER_MAPPING gives for the class itself."""
    from transformers import CONFIG_MAPPING
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING

    from pagemill.loader.tokenizer import registered_tokenizer_class

    config_class = CONFIG_MAPPING[model_type]
    assert registered_tokenizer_class(config_class.__name__) is TOKENIZER_MAPPING.get(config_class, None)


def test_directory_tokenizer_is_cached_until_a_file_changes(cache_dir, smol_path, tmp_path):
    """A HF tokenizer directory's tokenizer is built once; editing any of its files (not its weights) rebuilds it."""
    from transformers import AutoTokenizer

    directory = tmp_path / "tok"
    load_tokenizer(smol_path, smol_path).save_pretrained(directory)
    built = AutoTokenizer.from_pretrained(directory)
    first = load_tokenizer(str(directory))
    assert type(first) is type(built) and first.backend_tokenizer.to_str() == built.backend_tokenizer.to_str()
    again = cached_tokenizer(str(directory), lambda: pytest.fail("built again"))
    chat = [{"role": "user", "content": "Hi"}]
    assert again.apply_chat_template(chat, tokenize=False) == built.apply_chat_template(chat, tokenize=False)
    (directory / "model.safetensors").write_bytes(b"weights do not count")
    cached_tokenizer(str(directory), lambda: pytest.fail("built again"))
    template = directory / "chat_template.jinja"
    template.write_text("{% for m in messages %}<<{{ m['content'] }}>>{% endfor %}")
    edited = load_tokenizer(str(directory))
    assert edited.apply_chat_template(chat, tokenize=False) == "<<Hi>>"
