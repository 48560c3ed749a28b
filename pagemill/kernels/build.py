"""Build and load pagemill's compiled CPU kernels (pagemill/csrc/*.cpp) as one extension module."""

from __future__ import annotations

import glob
import hashlib
import logging
import os
from types import ModuleType

logger = logging.getLogger(__name__)

_CSRC = os.path.join(os.path.dirname(os.path.dirname(__file__)), "csrc")
_module: ModuleType | None = None
_failed = False


def _sources() -> list[str]:
    return sorted(glob.glob(os.path.join(_CSRC, "*.cpp")))


def _build_dir() -> str:
    import torch

    digest = hashlib.sha256(torch.__version__.encode())
    for path in sorted(glob.glob(os.path.join(_CSRC, "*"))):
        with open(path, "rb") as f:
            digest.update(os.path.basename(path).encode() + f.read())
    root = os.environ.get("PAGEMILL_CACHE_DIR", os.path.join(os.path.expanduser("~"), ".cache", "pagemill"))
    path = os.path.join(root, f"kernels_{digest.hexdigest()[:12]}")
    os.makedirs(path, exist_ok=True)
    return path


def load_kernels(verbose: bool = False) -> ModuleType | None:
    """The compiled extension (built on first use, then cached on disk); None if it cannot be built."""
    global _module, _failed
    if _module is not None or _failed:
        return _module
    try:
        from torch.utils.cpp_extension import load

        _module = load(name="pagemill_kernels", sources=_sources(), build_directory=_build_dir(),
                       extra_cflags=["-O3", "-march=native", "-fopenmp", "-ffast-math"],
                       extra_ldflags=["-fopenmp"], extra_include_paths=[_CSRC], verbose=verbose)
    except Exception as e:  # no compiler, no headers: the torch reference paths still work
        logger.warning("Could not build pagemill's CPU kernels (%s); using the torch reference paths.", e)
        _failed = True
    return _module


def kernel_info() -> dict:
    """What `pagemill env` reports about the kernels: active ISA variant, compiled / supported ones, build error."""
    module = load_kernels()
    return {"active": "native" if module is not None else None, "compiled": ["native"] if module else [],
            "supported": [], "forced": os.environ.get("PAGEMILL_CPU_ISA"), "build_error": None if module else "failed",
            "path": getattr(module, "__file__", None)}


if __name__ == "__main__":
    print("built:", load_kernels(verbose=True) is not None)
