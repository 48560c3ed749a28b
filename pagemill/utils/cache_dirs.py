"""Where pagemill keeps what it builds once (kernels, laid-out records, configs and tokenizers), the switches, and
the size limits that keep those directories from filling the disk."""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from collections.abc import Iterable
from pathlib import Path

logger = logging.getLogger(__name__)

GIB = 1 << 30
METADATA_CACHE_MAX_GIB = 0.5  # default of PAGEMILL_METADATA_CACHE_MAX_GB


def cache_root() -> str:
    """$PAGEMILL_CACHE_DIR, else ~/.cache/pagemill."""
    return os.environ.get("PAGEMILL_CACHE_DIR", os.path.join(os.path.expanduser("~"), ".cache", "pagemill"))


def metadata_cache_dir() -> Path:
    """$PAGEMILL_CACHE_DIR/metadata (default ~/.cache/pagemill/metadata): configs, tokenizers, RoPE tables."""
    return Path(cache_root()) / "metadata"


def metadata_cache_enabled() -> bool:
    """False when PAGEMILL_METADATA_CACHE is 0 / false / off."""
    return cache_enabled("PAGEMILL_METADATA_CACHE")


def cache_enabled(env: str) -> bool:
    """False when the environment variable `env` is 0 / false / off / no (on by default)."""
    return os.environ.get(env, "1").strip().lower() not in ("0", "false", "off", "no")


def cache_limit_bytes(env: str, default_gib: float) -> int:
    """The size limit in bytes that `env` gives in GiB (e.g. PAGEMILL_RECORDS_CACHE_MAX_GB=8), else `default_gib`."""
    value = os.environ.get(env, "").strip()
    try:
        gib = float(value) if value else default_gib
    except ValueError:
        raise ValueError(f"{env} must be a number of GiB, got {value!r}") from None
    return int(max(gib, 0.0) * GIB)


def mark_used(path: Path) -> None:
    """Stamp a cache file as just used (its modification time orders the least recently used first for trimming)."""
    try:
        os.utime(path)
    except OSError:
        pass  # a read-only cache is still read; it is only trimmed in a worse order


def room_to_write(directory: Path, nbytes: int) -> bool:
    """Whether writing `nbytes` under `directory` leaves the disk at least max(2 GiB, 5%) free: a cache that would
    fill the disk is not written (the next start builds again)."""
    probe = directory
    while not probe.exists() and probe.parent != probe:
        probe = probe.parent
    usage = shutil.disk_usage(probe)
    return usage.free - nbytes >= max(2 * GIB, usage.total // 20)


def trim_cache(directory: Path, max_bytes: int, keep: Iterable[Path] = ()) -> int:
    """Delete the least recently used files of `directory` (not `keep`, not temporary files being written) until the
    rest take at most `max_bytes`; returns the bytes freed."""
    kept = {Path(p).resolve() for p in keep}
    entries = []
    for path in directory.glob("*") if directory.is_dir() else ():
        if path.name.startswith(".tmp") or path.suffix == ".tmp" or not path.is_file():
            continue
        try:
            st = path.stat()
        except OSError:
            continue  # removed by a concurrent trim
        entries.append((st.st_mtime, st.st_size, path))
    total = sum(size for _, size, _ in entries)
    freed = 0
    for _, size, path in sorted(entries):
        if total - freed <= max_bytes:
            break
        if path.resolve() in kept:
            continue
        path.unlink(missing_ok=True)
        freed += size
    if freed:
        logger.info("Trimmed %.2f GB of least recently used files from %s", freed / 1e9, directory)
    return freed


def write_atomically(path: Path, data: bytes, max_bytes: int) -> None:
    """Write `data` to a temporary name and rename it into place (concurrent starts never see half a file), then trim
    the directory to `max_bytes`; errors are logged: a read-only cache directory or a full disk only costs the next
    start the build."""
    try:
        if not room_to_write(path.parent, len(data)):
            logger.warning("Not writing the cache file %s: the disk would be nearly full", path)
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=path.suffix)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    except OSError as e:
        logger.warning("Could not write the cache file %s (%s)", path, e)
        return
    trim_cache(path.parent, max_bytes, keep=[path])
