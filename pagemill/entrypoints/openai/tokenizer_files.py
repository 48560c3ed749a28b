"""The engine's tokenizer as the files a Hugging Face client loads (`tokenizer.json`, `tokenizer_config.json`, ...),
and vLLM's `/tokenizer_info` body built from it."""

from __future__ import annotations

import hashlib
import os
import tempfile
import threading
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class RepoFile:
    """One exported file: its bytes and its git blob id (the Hub's ETag of a file kept in git)."""

    content: bytes
    etag: str


def git_blob_id(content: bytes) -> str:
    """The git blob sha1 of `content` (what the Hub sends as the ETag of a non-LFS file)."""
    return hashlib.sha1(b"blob %d\0" % len(content) + content).hexdigest()


class TokenizerFiles:
    """`tokenizer.save_pretrained` into a temporary directory, once, on first use; the files kept in memory.

    `chat_template`: the server's --chat-template, written as `chat_template.jinja` so that a client renders
    conversations as the server does. The commit hash is a digest of every file, so it changes with their content.
    """

    def __init__(self, tokenizer: Any, chat_template: str | None = None) -> None:
        self._tokenizer, self._chat_template = tokenizer, chat_template
        self._files: dict[str, RepoFile] | None = None
        self._lock = threading.Lock()

    def files(self) -> dict[str, RepoFile]:
        """{file name: RepoFile} (exports on the first call; thread-safe)."""
        with self._lock:
            if self._files is None:
                self._files = self._export()
            return self._files

    def commit_hash(self) -> str:
        """A 40-hex-digit revision id that names this exact set of files."""
        digest = hashlib.sha1()
        for name, f in sorted(self.files().items()):
            digest.update(f"{name}\0{f.etag}\n".encode())
        return digest.hexdigest()

    def _export(self) -> dict[str, RepoFile]:
        with tempfile.TemporaryDirectory(prefix="pagemill-tokenizer-") as d:
            self._tokenizer.save_pretrained(d)
            if self._chat_template is not None:
                with open(os.path.join(d, "chat_template.jinja"), "w", encoding="utf-8") as f:
                    f.write(self._chat_template)
            files = {}
            for name in sorted(os.listdir(d)):
                path = os.path.join(d, name)
                if os.path.isfile(path):
                    with open(path, "rb") as f:
                        content = f.read()
                    files[name] = RepoFile(content, git_blob_id(content))
            return files


def tokenizer_info(tokenizer: Any, chat_template: str | None) -> dict[str, Any]:
    """vLLM's `/tokenizer_info` body: the tokenizer's init kwargs (file paths dropped), its class name, and the
    server's chat template when one was given."""
    config = dict(getattr(tokenizer, "init_kwargs", None) or {})
    config.pop("vocab_file", None)
    config.pop("merges_file", None)
    config = _json_ready(config)
    config["tokenizer_class"] = type(tokenizer).__name__
    if chat_template:
        config["chat_template"] = chat_template
    return config


def _json_ready(obj: Any) -> Any:
    """AddedToken -> its text, recursively through dicts (keys as strings) and lists, as vLLM does."""
    if hasattr(obj, "content"):
        return obj.content
    if isinstance(obj, dict):
        return {str(k): _json_ready(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_json_ready(v) for v in obj]
    return obj
