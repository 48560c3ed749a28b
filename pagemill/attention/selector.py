"""Build the attention backend the platform chooses (platforms/: which backends a device offers, in what order)."""

from __future__ import annotations

import logging

from pagemill.attention.backend import AttentionBackend
from pagemill.platforms import current_platform
from pagemill.utils.import_utils import resolve_obj_by_qualname

logger = logging.getLogger(__name__)


def get_attn_backend(name: str = "auto", batch_invariant: bool = False,
                     kv_cache_layout: str = "paged") -> AttentionBackend:
    """An attention backend instance for `name` (auto: the platform's first that builds here, e.g. the compiled CPU
    kernel, else the torch reference); `batch_invariant`: the fixed-order kernel for every request (an error
    without it); kv_cache_layout="virtual": SDPA over virtual-contiguous KV."""
    candidates = current_platform.get_attn_backend_cls(name, batch_invariant, kv_cache_layout)
    for i, qualname in enumerate(candidates):
        try:
            return resolve_obj_by_qualname(qualname)()
        except RuntimeError:
            if batch_invariant:
                raise ValueError("batch_invariant=True needs pagemill's compiled CPU kernels, which are not built "
                                 "here (`pagemill env` says why; build them with `make kernels`).") from None
            if i == len(candidates) - 1:
                raise
            logger.warning("Falling back to the %s attention backend.", resolve_obj_by_qualname(candidates[i + 1]).name)
    raise ValueError(f"attention_backend={name!r}: the {current_platform.device_name} platform offers no backend.")
