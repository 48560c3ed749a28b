"""GEMV records laid out once per weight file and kept on disk, so that a second start maps them instead of packing.

The cache is one safetensors file per (weight files, tensor / pipeline-parallel rank, layout) in
$PAGEMILL_RECORDS_CACHE_DIR (default $PAGEMILL_CACHE_DIR/records, ~/.cache/pagemill/records). Its name hashes the
weight files' identity (real paths, sizes, modification times) and the source of the code that lays records out, so
an edited file or a changed layout never reads stale records. GGUF records, a quantized checkpoint's records, a
16-bit checkpoint's tiles and quantization='int8' / 'int4' records are all kept here. A hit maps the file read-only:
the records cost page cache, shared between processes, and no packing time. A miss packs as before and writes the
file once the model is loaded, on a thread of its own while the engine serves (to a temporary name, renamed into
place: concurrent starts never see half a file; the process finishes the write before it exits).
PAGEMILL_RECORDS_CACHE=0 turns it off. The directory is kept under PAGEMILL_RECORDS_CACHE_MAX_GB (default 20): a
write deletes the least recently used files beyond it, and a write that would leave the disk nearly full is skipped.
"""

from __future__ import annotations

import glob
import hashlib
import json
import logging
import os
import tempfile
import threading
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from pagemill.utils.cache_dirs import cache_enabled, cache_limit_bytes, cache_root, mark_used, room_to_write, trim_cache

logger = logging.getLogger(__name__)

Records = torch.Tensor | list[torch.Tensor]
# What decides the bytes (paths relative to this package; packing.cpp lays out the LM head's screen).
_LAYOUT_SOURCES = ("gguf_records.py", "gguf.py", "int8_grid.py", "records_cache.py", "checkpoint_formats.py",
                   "prequantized.py", "half_tiles.py", "weight_only.py", "../head_screen.py",
                   "../../csrc/cpu/packing.cpp")
_META_KEY = "pagemill.records"
_DEFAULT_MAX_GIB = 20.0


# Cache files being written on a background thread (RecordsCache.save), by path.
_writers: dict[Path, threading.Thread] = {}
_writers_lock = threading.Lock()


def wait_for_writes(path: Path | None = None) -> None:
    """Block until the background writes of the cache file `path` (default: every one) are done."""
    with _writers_lock:
        if path is None:
            writers = list(_writers.values())
            _writers.clear()
        else:
            writer = _writers.pop(path, None)
            writers = [writer] if writer is not None else []
    for writer in writers:
        writer.join()


def _remove_orphaned_writes(directory: Path) -> None:
    """Delete the temporary files of writers whose process is gone (killed mid-write)."""
    for tmp in directory.glob("*.tmp"):
        pid = tmp.name.split(".", 1)[0]
        if not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass  # alive (another user's process): not ours to delete


def records_cache_dir() -> Path:
    """$PAGEMILL_RECORDS_CACHE_DIR, else $PAGEMILL_CACHE_DIR/records (default ~/.cache/pagemill/records)."""
    if os.environ.get("PAGEMILL_RECORDS_CACHE_DIR"):
        return Path(os.environ["PAGEMILL_RECORDS_CACHE_DIR"])
    return Path(cache_root()) / "records"


def records_cache_enabled() -> bool:
    """False when PAGEMILL_RECORDS_CACHE is 0 / false / off."""
    return cache_enabled("PAGEMILL_RECORDS_CACHE")


def _layout_digest() -> str:
    """A hash of the modules that lay records out: any edit to them is a new layout."""
    here = Path(__file__).resolve().parent
    digest = hashlib.sha256()
    for name in _LAYOUT_SOURCES:
        digest.update(name.encode() + (here / name).read_bytes())
    return digest.hexdigest()


class RecordsCache:
    """One weight file's records by layer key: looked up from the mapped cache file, or collected to be written."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.hits = 0  # layers whose records came from the cache
        self.packed: dict[str, tuple[str, Records, dict]] = {}  # layers packed this start (written by save)
        self._index: dict[str, dict] = {}
        self._file = None
        self._stale: str | None = None
        self._model_prefix = path.stem  # the names of this weight file's records and their siblings start with it
        wait_for_writes(path)  # an earlier engine of this process may still be writing it
        if path.is_file():
            try:
                self._file = safe_open(str(path), framework="pt")
                self._index = json.loads(self._file.metadata()[_META_KEY])
                mark_used(path)
            except Exception as e:  # noqa: BLE001 - a damaged cache file is repacked, never fatal
                logger.warning("Ignoring the unreadable records cache %s (%s); repacking", path, e)
                self._file, self._index = None, {}

    @classmethod
    def for_weight_file(cls, weight_path: str, rank: str = "tp0/1") -> RecordsCache | None:
        """The cache of `weight_path` for this rank's share (`rank` names it, e.g. "tp0/2,pp1/2"), or None when
        caching is off or the file is missing."""
        return cls.for_weight_files([weight_path], rank)

    @classmethod
    def for_weight_files(cls, weight_paths: list[str], rank: str = "tp0/1") -> RecordsCache | None:
        """The cache of a checkpoint's weight files (every file's size and time in its version) for this rank's
        share and layout, or None when caching is off or a file is missing."""
        if not records_cache_enabled() or not weight_paths or not all(os.path.isfile(p) for p in weight_paths):
            return None
        reals = [os.path.realpath(p) for p in weight_paths]
        first = Path(reals[0])
        # a checkpoint directory's files are named model*.safetensors: the directory names its records
        label = first.stem if len(reals) == 1 and not first.stem.startswith("model") else first.parent.name
        owner = f"{label[:48]}-{hashlib.sha256('|'.join([*reals, rank]).encode()).hexdigest()[:8]}"
        stats = "|".join(f"{os.stat(r).st_size}|{os.stat(r).st_mtime_ns}" for r in reals)
        version = hashlib.sha256(f"{stats}|{_layout_digest()}".encode()).hexdigest()[:12]
        cache = cls(records_cache_dir() / f"{owner}-{version}.safetensors")
        cache._stale = f"{glob.escape(owner)}-*"  # earlier versions of these files' records (replaced by save)
        return cache

    @property
    def mapped(self) -> bool:
        """Whether a cache file was found (its records are read from the map)."""
        return self._file is not None

    def sibling(self, part: str) -> RecordsCache:
        """The cache of something else derived from the same weights and rank (e.g. the LM head's screen), in a
        file of its own beside this one."""
        sibling = RecordsCache(self.path.with_name(f"{self.path.stem}.{part}{self.path.suffix}"))
        sibling._model_prefix = self._model_prefix
        return sibling

    def lookup(self, key: str) -> tuple[str, Records] | None:
        """(record kind, records) of layer `key`, mapped read-only from the cache file; None if not cached."""
        entry = self._index.get(key)
        if entry is None:
            return None
        parts = [self._file.get_tensor(f"{key}#{i}") for i in range(entry["parts"])]
        self.hits += 1
        return entry["kind"], (parts if entry["list"] else parts[0])

    def extra(self, key: str) -> dict:
        """The JSON values stored with `key`'s records ({} if none or not cached)."""
        return self._index.get(key, {}).get("extra", {})

    def add(self, key: str, kind: str, records: Records, **extra: Any) -> None:
        """Remember records packed this start (written by save), with JSON values to keep beside them."""
        self.packed[key] = (kind, records, extra)

    def save(self) -> None:
        """Write the records packed this start, if this start found no cache file: atomically, on a thread of its
        own, so the engine serves while the file is written (the process finishes the write before it exits;
        wait_for_writes joins it). Errors are logged: a read-only cache directory only costs the next start its
        packing time."""
        if self.mapped or not self.packed:
            return
        tensors, index = {}, {}
        for key, (kind, records, extra) in self.packed.items():
            parts = records if isinstance(records, list) else [records]
            index[key] = {"kind": kind, "parts": len(parts), "list": isinstance(records, list), "extra": extra}
            tensors.update({f"{key}#{i}": p.contiguous() for i, p in enumerate(parts)})
        self.packed = {}
        wait_for_writes(self.path)  # (one writer per file)
        writer = threading.Thread(target=self._write_in_background, args=(tensors, index),
                                  name="records-cache-writer")
        with _writers_lock:
            _writers[self.path] = writer
        writer.start()

    def _write_in_background(self, tensors: dict[str, torch.Tensor], index: dict[str, dict]) -> None:
        """_write at the lowest CPU priority: the engine's threads (its start-up, then its steps) go first, and the
        copy into the page cache takes the cycles they leave."""
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)  # this thread only (Linux)
        except (AttributeError, OSError):
            pass  # elsewhere the writer keeps the process's priority
        self._write(tensors, index)

    def _write(self, tensors: dict[str, torch.Tensor], index: dict[str, dict]) -> None:
        """Write the cache file (to a temporary name renamed into place), then drop stale versions and trim."""
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        if not room_to_write(self.path.parent, nbytes):
            logger.warning("Not writing the records cache %s (%.2f GB): the disk would be nearly full", self.path,
                           nbytes / 1e9)
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            _remove_orphaned_writes(self.path.parent)
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=f"{os.getpid()}.", suffix=".tmp")
            os.close(fd)
            try:
                save_file(tensors, tmp, metadata={_META_KEY: json.dumps(index)})
                os.replace(tmp, self.path)
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
        except Exception as e:  # noqa: BLE001 - disk full (SafetensorError), read-only: never fatal
            logger.warning("Could not write the records cache %s (%s); the next start packs again", self.path, e)
            return
        logger.info("Records cache written: %s (%.2f GB)", self.path, self.path.stat().st_size / 1e9)
        self._remove_stale()
        this_model = self.path.parent.glob(f"{glob.escape(self._model_prefix)}*")  # this file and its siblings
        trim_cache(self.path.parent, cache_limit_bytes("PAGEMILL_RECORDS_CACHE_MAX_GB", _DEFAULT_MAX_GIB), this_model)

    def _remove_stale(self) -> None:
        """Delete the caches of earlier versions of the same weight file and rank (and their siblings)."""
        if self._stale is None:
            return
        current = self.path.name.removesuffix(self.path.suffix)
        for path in self.path.parent.glob(self._stale):
            if not path.name.startswith(current) and not path.name.endswith(".tmp"):
                path.unlink(missing_ok=True)
