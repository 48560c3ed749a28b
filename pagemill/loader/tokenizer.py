"""Load the tokenizer (and chat template) of a HF directory or a GGUF file.

Building a GGUF's tokenizer means transformers reading the file's vocabulary and merges from its metadata (2.3 s
for Llama 3's 128k tokens, 1 s for SmolLM2's 49k): the built tokenizer is saved once with `save_pretrained` under
$PAGEMILL_CACHE_DIR/tokenizers (keyed by the file's identity and the transformers / tokenizers versions) and later
starts load that (0.1-0.4 s). PAGEMILL_TOKENIZER_CACHE=0 turns the cache off.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)


def load_tokenizer(tokenizer_path: str, gguf_file: str | None = None, hf_config: Any = None) -> Any:
    """A transformers fast tokenizer; for GGUF it is built from the file's metadata.

    `tokenizer_path`: a HF tokenizer directory, or a .gguf file (the model's, `gguf_file`, or another one).
    """
    from transformers import AutoTokenizer

    if tokenizer_path.endswith(".gguf") and os.path.isfile(tokenizer_path) and (
            gguf_file is None or os.path.abspath(tokenizer_path) != os.path.abspath(gguf_file)):
        gguf_file, hf_config = tokenizer_path, None  # another GGUF's tokenizer: its own config picks the class
    if gguf_file is not None and os.path.abspath(tokenizer_path) == os.path.abspath(gguf_file):
        return _cached(gguf_file, lambda: _build_gguf_tokenizer(gguf_file, hf_config))
    return AutoTokenizer.from_pretrained(tokenizer_path)


def _build_gguf_tokenizer(gguf_file: str, hf_config: Any) -> Any:
    """The tokenizer transformers builds from a GGUF file's metadata."""
    from transformers import AutoTokenizer

    directory, name = os.path.dirname(gguf_file), os.path.basename(gguf_file)
    cls = _gguf_tokenizer_class(directory, gguf_file, hf_config)
    if cls is not None:
        return cls.from_pretrained(directory, gguf_file=name, _from_auto=True)
    return AutoTokenizer.from_pretrained(directory, gguf_file=name)


def tokenizer_cache_path(gguf_file: str) -> Path | None:
    """Where the tokenizer built from `gguf_file` is saved, or None when the cache is off."""
    if os.environ.get("PAGEMILL_TOKENIZER_CACHE", "1").strip().lower() in ("0", "false", "off", "no"):
        return None
    import tokenizers
    import transformers

    real = os.path.realpath(gguf_file)
    st = os.stat(real)
    key = f"{real}|{st.st_size}|{st.st_mtime_ns}|{transformers.__version__}|{tokenizers.__version__}"
    root = os.environ.get("PAGEMILL_CACHE_DIR", os.path.join(os.path.expanduser("~"), ".cache", "pagemill"))
    return Path(root) / "tokenizers" / f"{Path(real).stem[:48]}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"


def _cached(gguf_file: str, build: Callable[[], Any]) -> Any:
    """The saved tokenizer of `gguf_file` if there is one, else `build()` (saved for the next start)."""
    from transformers import AutoTokenizer

    path = tokenizer_cache_path(gguf_file)
    if path is not None and (path / "tokenizer_config.json").is_file():
        try:
            return AutoTokenizer.from_pretrained(str(path))
        except Exception as e:  # noqa: BLE001 - a damaged cache entry is rebuilt, never fatal
            logger.warning("Ignoring the unreadable tokenizer cache %s (%s); rebuilding", path, e)
            shutil.rmtree(path, ignore_errors=True)
    tokenizer = build()
    if path is not None:
        _save(tokenizer, path)
    return tokenizer


def _save(tokenizer: Any, path: Path) -> None:
    """save_pretrained into a temporary directory renamed into place (a concurrent start keeps its own copy)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = tempfile.mkdtemp(dir=path.parent, prefix=".tmp-")
        tokenizer.save_pretrained(tmp)
        try:
            os.replace(tmp, path)
        except OSError:  # another process saved it first
            shutil.rmtree(tmp, ignore_errors=True)
    except OSError as e:
        logger.warning("Could not save the tokenizer cache %s (%s)", path, e)


def _gguf_tokenizer_class(directory: str, gguf_file: str, hf_config: Any) -> type | None:
    """The class `AutoTokenizer.from_pretrained(directory, gguf_file=...)` picks, without its slow config read.

    AutoTokenizer first builds the model config from the GGUF with `gguf.GGUFReader` (~5 s for SmolLM2) only to
    choose the tokenizer class: with no tokenizer_config.json next to the file, that is the class registered for
    the config's type (TokenizersBackend when none is). The tokenizer itself is then built from the GGUF metadata
    by that class either way. None (use AutoTokenizer) in the cases it decides otherwise.
    """
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    if os.path.exists(os.path.join(directory, "tokenizer_config.json")):
        return None
    if hf_config is None:
        from pagemill.loader.model_files import gguf_hf_config

        hf_config = gguf_hf_config(gguf_file)
    if getattr(hf_config, "tokenizer_class", None):
        return None
    cls = TOKENIZER_MAPPING.get(type(hf_config), TokenizersBackend) or TokenizersBackend
    if cls.__name__ in ("MistralCommonBackend", "PythonBackend"):
        return None
    return cls
