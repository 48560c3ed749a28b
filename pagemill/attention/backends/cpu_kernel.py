"""Build and load the compiled CPU paged-attention kernel (csrc/paged_attention.cpp)."""

from __future__ import annotations

import hashlib
import logging
import os
from types import ModuleType

logger = logging.getLogger(__name__)

_SOURCE = os.path.join(os.path.dirname(os.path.dirname(__file__)), "csrc", "paged_attention.cpp")
_module: ModuleType | None = None
_failed = False


def _build_dir() -> str:
    import torch

    with open(_SOURCE, "rb") as f:
        digest = hashlib.sha256(f.read() + torch.__version__.encode()).hexdigest()[:12]
    root = os.environ.get("PAGEMILL_CACHE_DIR", os.path.join(os.path.expanduser("~"), ".cache", "pagemill"))
    path = os.path.join(root, f"paged_attention_{digest}")
    os.makedirs(path, exist_ok=True)
    return path


def load_kernel(verbose: bool = False) -> ModuleType | None:
    """The compiled extension (built on first use, then cached on disk); None if it cannot be built."""
    global _module, _failed
    if _module is not None or _failed:
        return _module
    try:
        from torch.utils.cpp_extension import load

        _module = load(name="pagemill_paged_attention", sources=[_SOURCE], build_directory=_build_dir(),
                       extra_cflags=["-O3", "-march=native", "-fopenmp", "-ffast-math"],
                       extra_ldflags=["-fopenmp"], verbose=verbose)
    except Exception as e:  # no compiler, no headers: the torch backend still works
        logger.warning("Could not build the CPU paged-attention kernel (%s); using the torch backend.", e)
        _failed = True
    return _module


if __name__ == "__main__":
    print("built:", load_kernel(verbose=True) is not None)
