"""LoRAModelManager: wraps a model's linears for LoRA, keeps adapters on the host (LRU of max_cpu_loras) and in
the stacked slots (LRU of max_loras), and builds each step's token -> slot mapping."""

from __future__ import annotations

import logging
from collections import OrderedDict

import numpy as np
import torch
from torch import nn

from pagemill.config import LoRAConfig
from pagemill.kernels.ops import TorchLayerOps
from pagemill.layers.linear import LinearBase
from pagemill.lora.layers import LinearWithLoRA, LoRAMapping
from pagemill.lora.peft_adapter import LoRAAdapter, LoRAModuleWeights, load_adapter
from pagemill.lora.request import LoRARequest

logger = logging.getLogger(__name__)

# An adapter laid out for the model: per wrapped layer, (slot part, shards covered, weights) of each module.
PreparedAdapter = dict[str, list[tuple[int, list[int], LoRAModuleWeights]]]


def wrap_linears(model: nn.Module, num_slots: int, rank: int,
                 ops: TorchLayerOps | None = None) -> dict[str, LinearWithLoRA]:
    """Replace every linear of the decoder layers with a LinearWithLoRA around it (its deltas computed by `ops`);
    returns them by module path."""
    layers = model.get_submodule("model.layers")
    wrapped = {}
    for name, module in list(layers.named_modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, LinearBase):
                wrapper = LinearWithLoRA(child, num_slots, rank, ops)
                setattr(module, child_name, wrapper)
                path = f"model.layers.{name}.{child_name}" if name else f"model.layers.{child_name}"
                wrapped[path] = wrapper
    if not wrapped:
        raise ValueError(f"enable_lora: {type(model).__name__} has no linear layers LoRA can adapt.")
    return wrapped


class LoRAModelManager:
    """The adapters of one model: loaded on the host, placed in slots, mapped to each step's tokens."""

    def __init__(self, model: nn.Module, config: LoRAConfig, ops: TorchLayerOps | None = None) -> None:
        self.config = config
        self.num_slots = config.max_loras
        self.layers = wrap_linears(model, self.num_slots, config.max_lora_rank, ops)
        self._runs = np.zeros((64, 3), dtype=np.int32)  # the step's runs (grown when a step has more)
        self._runs_tensor = torch.from_numpy(self._runs)
        self.packed = getattr(model, "packed_modules_mapping", {})
        self.host: OrderedDict[int, tuple[LoRARequest, PreparedAdapter]] = OrderedDict()  # LRU: oldest first
        self.slot_ids: list[int | None] = [None] * self.num_slots  # adapter id in each slot
        self.slot_lru: OrderedDict[int, None] = OrderedDict((s, None) for s in range(self.num_slots))
        self.pinned: set[int] = set()

    # ---- adapters on the host ----
    def add_adapter(self, request: LoRARequest) -> bool:
        """Load and check an adapter (a no-op when it is loaded already); True if it was loaded now. A different
        adapter under a loaded id is a ValueError."""
        held = self.host.get(request.lora_int_id)
        if held is not None:
            if (held[0].lora_name, held[0].lora_path) != (request.lora_name, request.lora_path):
                raise ValueError(f"lora_request: lora_int_id {request.lora_int_id} is already in use by adapter "
                                 f"{held[0].lora_name!r} ({held[0].lora_path}).")
            self.host.move_to_end(request.lora_int_id)
            return False
        prepared = self._prepare(load_adapter(request, self.config.max_lora_rank))
        self.host[request.lora_int_id] = (request, prepared)
        self._evict_host()
        logger.info("LoRA adapter %r (id %d) loaded from %s", request.lora_name, request.lora_int_id,
                    request.lora_path)
        return True

    def remove_adapter(self, lora_id: int) -> bool:
        """Forget an adapter (host and slot); True if it was loaded."""
        found = self.host.pop(lora_id, None) is not None
        self.pinned.discard(lora_id)
        if lora_id in self.slot_ids:
            slot = self.slot_ids.index(lora_id)
            self.slot_ids[slot] = None
            self.slot_lru.move_to_end(slot, last=False)  # the first to reuse
            found = True
        return found

    def pin_adapter(self, lora_id: int) -> bool:
        """Keep a loaded adapter on the host whatever the LRU says."""
        if lora_id not in self.host:
            raise ValueError(f"lora_int_id {lora_id} is not loaded.")
        self.pinned.add(lora_id)
        return True

    def list_adapters(self) -> list[int]:
        """Ids of the adapters loaded on the host."""
        return list(self.host)

    def _evict_host(self) -> None:
        for lora_id in list(self.host):
            if len(self.host) <= self.config.max_cpu_loras:
                return
            if lora_id not in self.pinned:
                del self.host[lora_id]

    def _prepare(self, adapter: LoRAAdapter) -> PreparedAdapter:
        """Map each adapter module to the wrapped layer and shards it adapts, checking shapes."""
        prepared: PreparedAdapter = {}
        for module, weights in adapter.modules.items():
            parent, _, leaf = module.rpartition(".")
            path, shard = module, None
            if leaf in self.packed:
                fused, shard = self.packed[leaf]
                path = f"{parent}.{fused}"
            layer = self.layers.get(path)
            if layer is None:
                raise ValueError(f"lora_path: the adapter targets {module!r}, which is not a linear layer of this "
                                 "model that LoRA can adapt.")
            ids = layer.base.shard_ids
            shards = list(range(len(ids))) if shard is None else [ids.index(shard)]
            layer.check(module, shards, weights)
            prepared.setdefault(path, []).append((shards[0] if shard is not None else 0, shards, weights))
        return prepared

    # ---- slots, per step ----
    def mapping(self, token_lora_ids: np.ndarray, requests: dict[int, LoRARequest]) -> LoRAMapping | None:
        """The step's mapping for each token's adapter id (0: the base model), placing adapters not in a slot
        (reloading from `requests` any the host dropped); None when no token uses an adapter. Its runs are a view
        of one buffer the next step's mapping overwrites."""
        ids = np.unique(token_lora_ids)
        ids = ids[ids > 0].tolist()
        if not ids:
            return None
        if len(ids) > self.num_slots:
            raise RuntimeError(f"a step uses {len(ids)} adapters, more than max_loras ({self.num_slots})")
        slots = np.array([self._activate(lora_id, requests[lora_id], ids) for lora_id in ids], dtype=np.int32)
        # runs of equal ids: [starts[i], ends[i]) has id token_lora_ids[starts[i]]
        starts = np.concatenate(([0], np.flatnonzero(np.diff(token_lora_ids)) + 1))
        ends = np.append(starts[1:], len(token_lora_ids))
        run_ids = token_lora_ids[starts]
        keep = run_ids > 0
        n = int(keep.sum())
        if n > len(self._runs):
            self._runs = np.zeros((max(n, 2 * len(self._runs)), 3), dtype=np.int32)
            self._runs_tensor = torch.from_numpy(self._runs)
        runs = self._runs[:n]
        runs[:, 0], runs[:, 1] = starts[keep], ends[keep]
        runs[:, 2] = slots[np.searchsorted(ids, run_ids[keep])]  # ids: sorted (np.unique)
        return LoRAMapping(self._runs_tensor[:n])

    def _activate(self, lora_id: int, request: LoRARequest, step_ids: list[int]) -> int:
        """The slot holding adapter `lora_id`, writing it into the least recently used slot no adapter of this step
        holds if it is in none."""
        if lora_id in self.slot_ids:
            slot = self.slot_ids.index(lora_id)
        else:
            if lora_id not in self.host:
                self.add_adapter(request)
            slot = next(s for s in self.slot_lru if self.slot_ids[s] not in step_ids)
            prepared = self.host[lora_id][1]
            for path, layer in self.layers.items():
                layer.set_slot(slot, prepared.get(path, []))
            self.slot_ids[slot] = lora_id
        self.slot_lru.move_to_end(slot)
        if lora_id in self.host:
            self.host.move_to_end(lora_id)
        return slot
