"""The cache directories' size limits: least recently used files go first, what a start needs stays."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from pagemill.utils.cache_dirs import GIB, cache_limit_bytes, mark_used, room_to_write, trim_cache


def _file(root: Path, name: str, size: int, age_s: int) -> Path:
    path = root / name
    path.write_bytes(b"x" * size)
    t = path.stat().st_mtime - age_s
    os.utime(path, (t, t))
    return path


def test_trim_removes_the_least_recently_used_first(tmp_path):
    old = _file(tmp_path, "old", 400, 300)
    middle = _file(tmp_path, "middle", 400, 200)
    new = _file(tmp_path, "new", 400, 100)
    assert trim_cache(tmp_path, 900) == 400
    assert not old.exists() and middle.exists() and new.exists()
    mark_used(middle)  # now the most recent: `new` is the oldest left
    assert trim_cache(tmp_path, 400) == 400
    assert middle.exists() and not new.exists()


def test_trim_spares_kept_and_partly_written_files(tmp_path):
    kept = _file(tmp_path, "kept", 1000, 500)
    writing = _file(tmp_path, ".tmp-abc.json", 1000, 400)
    other = _file(tmp_path, "other", 1000, 300)
    assert trim_cache(tmp_path, 0, keep=[kept]) == 1000
    assert kept.exists() and writing.exists() and not other.exists()
    assert trim_cache(tmp_path / "missing", 0) == 0


def test_limits_read_from_the_environment(monkeypatch):
    assert cache_limit_bytes("PAGEMILL_TEST_MAX_GB", 2) == 2 * GIB
    monkeypatch.setenv("PAGEMILL_TEST_MAX_GB", "0.5")
    assert cache_limit_bytes("PAGEMILL_TEST_MAX_GB", 2) == GIB // 2
    monkeypatch.setenv("PAGEMILL_TEST_MAX_GB", "lots")
    with pytest.raises(ValueError, match="PAGEMILL_TEST_MAX_GB"):
        cache_limit_bytes("PAGEMILL_TEST_MAX_GB", 2)


def test_no_room_for_what_would_fill_the_disk(tmp_path):
    free = os.statvfs(tmp_path).f_bavail * os.statvfs(tmp_path).f_frsize
    assert not room_to_write(tmp_path / "not" / "made" / "yet", free)
    assert room_to_write(tmp_path, 0) == (free >= max(2 * GIB, os.statvfs(tmp_path).f_blocks
                                                      * os.statvfs(tmp_path).f_frsize // 20))
