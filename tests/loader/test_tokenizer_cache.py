"""The tokenizer cache: a GGUF's tokenizer saved by the first start is what later starts load, identical in what
the engine uses (ids, special tokens, chat template), without reading the GGUF's vocabulary again."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

import pagemill.loader.tokenizer as tokenizer_module
from pagemill.loader.tokenizer import load_tokenizer, tokenizer_cache_path

TEXTS = ["Hello world", "  leading spaces and ü 日本語", "def f(x):\n    return x  # <|im_end|>", "<|im_start|>user"]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]


@pytest.fixture
def cache_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("PAGEMILL_CACHE_DIR", str(tmp_path))  # (tokenizers only: the kernels are already loaded)
    monkeypatch.delenv("PAGEMILL_TOKENIZER_CACHE", raising=False)
    return tmp_path / "tokenizers"


def _same(a, b) -> None:
    assert type(a) is type(b) and len(a) == len(b)
    for text in TEXTS:
        assert a(text).input_ids == b(text).input_ids
        assert a.decode(a(text).input_ids) == b.decode(b(text).input_ids)
    assert (a.bos_token_id, a.eos_token_id, a.pad_token_id) == (b.bos_token_id, b.eos_token_id, b.pad_token_id)
    assert a.all_special_tokens == b.all_special_tokens
    assert (a.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
            == b.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True))


def test_second_load_is_the_saved_tokenizer(smol_path, cache_root, monkeypatch):
    fresh = load_tokenizer(smol_path, smol_path)
    path = tokenizer_cache_path(smol_path)
    assert path is not None and path.parent == cache_root and (path / "tokenizer.json").is_file()

    def no_gguf_read(*args, **kwargs):
        raise AssertionError("the GGUF's vocabulary was read although the tokenizer is cached")

    monkeypatch.setattr(tokenizer_module, "_build_gguf_tokenizer", no_gguf_read)
    _same(fresh, load_tokenizer(smol_path, smol_path))


def test_an_edited_file_and_a_damaged_entry_are_rebuilt(smol_path, cache_root, tmp_path):
    copy = tmp_path / "model.gguf"
    shutil.copyfile(smol_path, copy)
    want = load_tokenizer(str(copy), str(copy))
    first = tokenizer_cache_path(str(copy))
    st = copy.stat()
    os.utime(copy, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert tokenizer_cache_path(str(copy)) != first
    (first / "tokenizer.json").write_text("{not json")
    os.utime(copy, ns=(st.st_atime_ns, st.st_mtime_ns))
    _same(want, load_tokenizer(str(copy), str(copy)))  # the damaged entry: rebuilt from the file


def test_cache_off(smol_path, cache_root, monkeypatch):
    monkeypatch.setenv("PAGEMILL_TOKENIZER_CACHE", "0")
    assert tokenizer_cache_path(smol_path) is None
    load_tokenizer(smol_path, smol_path)
    assert not cache_root.exists()
