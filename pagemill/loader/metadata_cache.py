"""Model configs (of a GGUF file or a HF directory's config.json) and tokenizers saved on disk, so that a second
start builds neither (the RoPE tables of scaled RoPE types sit beside them: layers/rotary.py).

Building them costs most of a small model's start: the config needs transformers' configuration classes (~1.2 s of
imports), a GGUF's tokenizer transformers' own pass over the file's metadata (~0.3 s for SmolLM2) and its model
registry (~0.3 s), a directory's `AutoTokenizer` the config class again (~1.1 s). Files live in $PAGEMILL_CACHE_DIR/metadata (~/.cache/pagemill/metadata), named by the source
file's identity (real path, size, modification time), the library versions and the code that builds them, so an
edited file or an upgrade never reads a stale one; PAGEMILL_METADATA_CACHE=0 turns the cache off. A write trims the
least recently used files beyond PAGEMILL_METADATA_CACHE_MAX_GB (default 0.5).

The config is saved as a JSON `ConfigSnapshot`, and every start returns the snapshot (the first decodes what it
saved), so a first and a second start behave alike. The tokenizer is saved with pickle, which restores its exact
state; only files this module wrote in the user's own cache directory are read.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import os
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pagemill.config.config_snapshot import FORMAT, ConfigSnapshot, UnsavableConfig
from pagemill.utils.cache_dirs import (METADATA_CACHE_MAX_GIB, cache_limit_bytes, mark_used, metadata_cache_dir,
                                       metadata_cache_enabled, write_atomically)

logger = logging.getLogger(__name__)

_TOKENIZER_SOURCES = ("tokenizer.py", "metadata_cache.py")  # what decides the tokenizer built (beside this file)
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".msgpack", ".h5", ".index.json")


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "none"


def _cache_path(source_file: str, kind: str, extra: str) -> Path | None:
    """The cache file of `kind` ("config.json" / "tokenizer.pkl") derived from `source_file`; None when off."""
    if not metadata_cache_enabled():
        return None
    real = os.path.realpath(source_file)
    st = os.stat(real)
    identity = "dir" if os.path.isdir(real) else f"{st.st_size}|{st.st_mtime_ns}"  # a directory's files: in extra
    key = f"{real}|{identity}|{_version('transformers')}|{extra}"
    return metadata_cache_dir() / f"{Path(real).stem[:48]}-{hashlib.sha256(key.encode()).hexdigest()[:16]}.{kind}"


def cached_config(source_file: str, build: Callable[[], Any]) -> Any:
    """The config built from `source_file`, as a ConfigSnapshot read from the cache; on a miss `build()` makes the
    transformers config and its snapshot is saved. Configs a snapshot cannot hold are returned as built."""
    path = _cache_path(source_file, "config.json", f"snapshot{FORMAT}")
    if path is not None and path.is_file():
        try:
            snapshot = ConfigSnapshot.decode(json.loads(path.read_text()))
            mark_used(path)
            return snapshot
        except Exception as e:  # noqa: BLE001 - a damaged cache file is rebuilt, never fatal
            logger.warning("Ignoring the unreadable config cache %s (%s)", path, e)
    config = build()
    try:
        data = ConfigSnapshot.encode(config)
    except UnsavableConfig as e:
        logger.debug("Keeping the transformers config of %s: %s", source_file, e)
        return config
    if path is not None:
        _write_atomically(path, json.dumps(data).encode())
    return ConfigSnapshot.decode(data)


def cached_tokenizer(source: str, build: Callable[[], Any]) -> Any:
    """The tokenizer of `source` (a GGUF file, or a HF tokenizer directory), unpickled from the cache; on a miss
    `build()` makes it and it is saved."""
    here = Path(__file__).resolve().parent
    code = hashlib.sha256(b"".join((here / name).read_bytes() for name in _TOKENIZER_SOURCES)).hexdigest()[:16]
    path = _cache_path(source, "tokenizer.pkl", f"{_version('tokenizers')}|{code}|{_tokenizer_files_id(source)}")
    if path is not None and path.is_file():
        try:
            with open(path, "rb") as f:
                tokenizer = pickle.load(f)
            mark_used(path)
            return tokenizer
        except Exception as e:  # noqa: BLE001 - a damaged cache file is rebuilt, never fatal
            logger.warning("Ignoring the unreadable tokenizer cache %s (%s)", path, e)
    tokenizer = build()
    if path is not None:
        try:
            data = pickle.dumps(tokenizer, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as e:  # noqa: BLE001 - a tokenizer pickle cannot hold is rebuilt on every start
            logger.debug("Not caching the tokenizer of %s: %s", source, e)
        else:
            _write_atomically(path, data)
    return tokenizer


def _tokenizer_files_id(source: str) -> str:
    """What else decides the tokenizer: a directory's files but its weights (name, size, mtime), or the
    tokenizer_config.json beside a GGUF file (it picks the class when present)."""
    if os.path.isdir(source):
        names = sorted(n for n in os.listdir(source) if not n.endswith(_WEIGHT_SUFFIXES))
    else:
        source, names = os.path.dirname(os.path.realpath(source)), ["tokenizer_config.json"]
    ids = []
    for name in names:
        full = os.path.join(source, name)
        if os.path.isfile(full):
            st = os.stat(full)
            ids.append(f"{name}:{st.st_size}:{st.st_mtime_ns}")
    return ",".join(ids) or "-"


def _write_atomically(path: Path, data: bytes) -> None:
    """write_atomically under this directory's size limit."""
    write_atomically(path, data, cache_limit_bytes("PAGEMILL_METADATA_CACHE_MAX_GB", METADATA_CACHE_MAX_GIB))
