"""Distributed helpers with vLLM's names."""

from __future__ import annotations

import gc


def cleanup_dist_env_and_memory(shutdown_ray: bool = False) -> None:
    """Tear down the torch.distributed process group (if one is up) and free memory, so that another engine can
    start in this process (vLLM's helper; `shutdown_ray` also stops a Ray session started here)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    if shutdown_ray:
        try:
            import ray
        except ImportError:
            pass
        else:
            if ray.is_initialized():
                ray.shutdown()
    gc.collect()
