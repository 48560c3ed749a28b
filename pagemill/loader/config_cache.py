"""Model configs saved on disk as snapshots, so that a second start builds no transformers config.

Files live in $PAGEMILL_CACHE_DIR/configs (~/.cache/pagemill/configs), named by the source file's identity (real
path, size, modification time), the transformers version and the snapshot format; PAGEMILL_CONFIG_CACHE=0 turns
them off. Every start returns the snapshot (the first start builds the config, saves it, and decodes what it
saved), so a first and a second start behave alike.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pagemill.config.config_snapshot import FORMAT, ConfigSnapshot, UnsavableConfig

logger = logging.getLogger(__name__)


def config_cache_dir() -> Path:
    """$PAGEMILL_CACHE_DIR/configs (default ~/.cache/pagemill/configs)."""
    root = os.environ.get("PAGEMILL_CACHE_DIR", os.path.join(os.path.expanduser("~"), ".cache", "pagemill"))
    return Path(root) / "configs"


def _cache_path(source_file: str) -> Path:
    real = os.path.realpath(source_file)
    st = os.stat(real)
    try:
        transformers_version = importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        transformers_version = "none"
    key = f"{real}|{st.st_size}|{st.st_mtime_ns}|{transformers_version}|{FORMAT}"
    return config_cache_dir() / f"{Path(real).stem[:48]}-{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"


def cached_config(source_file: str, build: Callable[[], Any]) -> Any:
    """The config built from `source_file` (a GGUF or config.json), as a ConfigSnapshot read from the cache; on a
    miss `build()` makes the transformers config and its snapshot is saved. Configs a snapshot cannot hold are
    returned as built."""
    enabled = os.environ.get("PAGEMILL_CONFIG_CACHE", "1").strip().lower() not in ("0", "false", "off", "no")
    path = _cache_path(source_file) if enabled else None
    if path is not None and path.is_file():
        try:
            return ConfigSnapshot.decode(json.loads(path.read_text()))
        except Exception as e:  # noqa: BLE001 - a damaged cache file is rebuilt, never fatal
            logger.warning("Ignoring the unreadable config cache %s (%s)", path, e)
    config = build()
    try:
        data = ConfigSnapshot.encode(config)
    except UnsavableConfig as e:
        logger.debug("Keeping the transformers config of %s: %s", source_file, e)
        return config
    if path is not None:
        _write_atomically(path, json.dumps(data))
    return ConfigSnapshot.decode(data)


def _write_atomically(path: Path, text: str) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".json")
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except OSError as e:  # a read-only cache directory only costs the next start the config build
        logger.warning("Could not write the config cache %s (%s)", path, e)
