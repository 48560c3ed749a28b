"""Choose the attention backend: the compiled CPU kernel when it builds, else the torch reference."""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

BACKENDS = ("auto", "cpu", "torch")


def get_attn_backend(name: str = "auto", batch_invariant: bool = False, kv_cache_layout: str = "paged"):
    """An attention backend instance for `name` (auto = cpu kernel if available); `batch_invariant`: the cpu kernel
    for every request (an error without it); kv_cache_layout="virtual": SDPA over virtual-contiguous KV."""
    from pagemill.attention.backends.torch_paged import TorchPagedAttention

    if name not in BACKENDS:
        raise ValueError(f"attention_backend must be one of {', '.join(BACKENDS)}, got {name!r}.")
    if kv_cache_layout == "virtual":
        from pagemill.attention.backends.virtual_contiguous import VirtualContiguousAttention

        return VirtualContiguousAttention()
    if batch_invariant:
        from pagemill.attention.backends.cpu_invariant import BatchInvariantCpuAttention

        if name == "torch":
            raise ValueError("batch_invariant=True needs attention_backend auto or cpu, not torch.")
        try:
            return BatchInvariantCpuAttention()
        except RuntimeError:
            raise ValueError("batch_invariant=True needs pagemill's compiled CPU kernels, which are not built here "
                             "(`pagemill env` says why; build them with `make kernels`).") from None
    if name == "torch":
        return TorchPagedAttention()
    try:
        from pagemill.attention.backends.cpu_paged import CpuPagedAttention

        return CpuPagedAttention()
    except RuntimeError:
        if name == "cpu":
            raise
        logger.warning("Falling back to the torch attention backend.")
        return TorchPagedAttention()
