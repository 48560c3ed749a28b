"""Fixtures shared by the loader tests."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A records cache directory of the test's own (the cache turned on)."""
    root = tmp_path / "records"
    monkeypatch.setenv("PAGEMILL_RECORDS_CACHE_DIR", str(root))
    monkeypatch.delenv("PAGEMILL_RECORDS_CACHE", raising=False)
    return root
