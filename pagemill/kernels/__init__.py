"""pagemill's compiled CPU kernels (built at install time; torch reference paths remain)."""

from pagemill.kernels.build import load_kernels

__all__ = ["load_kernels"]
