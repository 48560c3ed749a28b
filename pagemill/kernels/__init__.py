"""pagemill's compiled CPU kernels (built at install time; torch reference paths remain)."""

from typing import Any

__all__ = ["kernel_info", "load_kernels"]


def __getattr__(name: str) -> Any:
    # Lazy, so `python -m pagemill.kernels.build` runs the module once (not imported first by this package).
    if name in __all__:
        from pagemill.kernels import build

        return getattr(build, name)
    raise AttributeError(f"module 'pagemill.kernels' has no attribute {name!r}")
