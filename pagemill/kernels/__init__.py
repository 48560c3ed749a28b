"""pagemill's compiled CPU kernels (built at install time; torch reference paths remain)."""

from pagemill.kernels.build import kernel_info, load_kernels

__all__ = ["kernel_info", "load_kernels"]
