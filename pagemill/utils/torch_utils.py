"""Tensor helpers shared by the layers and the runners."""

from __future__ import annotations

import torch


def host_to_device(tensor: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """`tensor` (on the host) on `device` without making the host wait: a CUDA copy goes through pinned memory
    (torch's caching host allocator keeps the block until the copy is done); a copy from pageable memory would first
    wait for the work already queued on the device, which is what async scheduling overlaps."""
    device = torch.device(device)
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)
