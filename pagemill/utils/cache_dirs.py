"""Where pagemill keeps what it builds once (kernels, laid-out records, configs and tokenizers), and the switches."""

from __future__ import annotations

import os


def cache_root() -> str:
    """$PAGEMILL_CACHE_DIR, else ~/.cache/pagemill."""
    return os.environ.get("PAGEMILL_CACHE_DIR", os.path.join(os.path.expanduser("~"), ".cache", "pagemill"))


def cache_enabled(env: str) -> bool:
    """False when the environment variable `env` is 0 / false / off / no (on by default)."""
    return os.environ.get(env, "1").strip().lower() not in ("0", "false", "off", "no")
