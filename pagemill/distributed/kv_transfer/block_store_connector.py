"""A KV connector over a store of full KV blocks keyed by prefix hashes (the shared-storage and ZMQ connectors).

Keys are chained SHA-256 digests of the blocks' tokens (the first block's seeded with the model's KV layout, the
adapter and the cache salt), the same in every process, so a prefix computed by a producer is found by a consumer.
Only full prompt blocks move: the scheduler side asks the store how many of a request's leading blocks it holds
(they count as computed and get blocks allocated), the worker side copies them into the paged cache before the
forward, and a producer saves each prompt block once after the step that completed it.
"""

from __future__ import annotations

import hashlib
import logging
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pagemill.distributed.kv_transfer.base import ALL_LAYERS, KVConnectorBase_V1, KVConnectorMetadata, KVConnectorRole

if TYPE_CHECKING:
    import numpy as np
    import torch

    from pagemill.config import EngineConfig
    from pagemill.core.sched_output import SchedulerOutput
    from pagemill.request import Request

logger = logging.getLogger(__name__)


class KVBlockStore(ABC):
    """Where full KV blocks live outside the engine, each an opaque byte string under its key."""

    @abstractmethod
    def num_leading_present(self, keys: list[str]) -> int:
        """How many of `keys`, from the first on, the store holds."""

    @abstractmethod
    def load(self, keys: list[str]) -> list[Any]:
        """The blocks' bytes (buffers of block_nbytes each), in order; a missing key raises RuntimeError."""

    @abstractmethod
    def save(self, keys: list[str], blocks: np.ndarray) -> None:
        """Store blocks[i] (uint8 rows) under keys[i]; keys already held are left as they are."""

    def close(self) -> None:
        """Release what the store holds open."""


@dataclass
class BlockTransfer:
    """One request's blocks to move: paged-cache block ids and their store keys, in the same order."""

    req_id: str
    block_ids: list[int]
    keys: list[str]


@dataclass
class BlockStoreConnectorMetadata(KVConnectorMetadata):
    """One step's loads (before the forward) and saves (after it)."""

    loads: list[BlockTransfer] = field(default_factory=list)
    saves: list[BlockTransfer] = field(default_factory=list)


@dataclass
class _Saving:
    """A producer's request whose prompt blocks are not all saved yet."""

    request: Request
    block_ids: list[int]  # its block table (group 0), kept up to date from the scheduler outputs
    num_saved: int = 0  # leading blocks already sent to the store


def kv_layout_seed(config: EngineConfig) -> bytes:
    """What two engines must share for their KV blocks to be interchangeable (the first key's seed)."""
    from pagemill.attention.kv_quant import row_format

    mc, cc = config.model_config, config.cache_config
    fmt = row_format(cc.kv_cache_dtype)  # a quantized row's layout (scales per group): "" for float caches
    return (f"{mc.architecture}:{mc.num_layers}:{mc.num_kv_heads}:{mc.head_dim}:{cc.block_size}:"
            f"{cc.kv_cache_dtype}:{mc.dtype}" + (f":{fmt}" if fmt else "")).encode()


def block_keys(seed: bytes, token_ids: list[int], block_size: int, start: int, end: int,
               prev: list[str]) -> list[str]:
    """Extend `prev` (the keys of blocks [0, start)) with the keys of blocks [start, end) of `token_ids`."""
    import numpy as np

    out = list(prev)
    parent = bytes.fromhex(out[-1]) if out else seed
    tokens = np.asarray(token_ids[start * block_size:end * block_size], dtype=np.int64)
    for i in range(end - start):
        digest = hashlib.sha256(parent + tokens[i * block_size:(i + 1) * block_size].tobytes()).digest()
        out.append(digest.hex())
        parent = digest
    return out


class BlockStoreConnector(KVConnectorBase_V1):
    """The scheduler and worker logic shared by connectors whose outside is a KVBlockStore."""

    def __init__(self, config: EngineConfig, role: KVConnectorRole) -> None:
        super().__init__(config, role)
        tc = self.kv_transfer_config
        self.block_size = config.cache_config.block_size
        self.is_producer, self.is_consumer = tc.is_kv_producer, tc.is_kv_consumer
        self._seed = kv_layout_seed(config)
        self._keys: dict[str, list[str]] = {}  # request -> keys of its leading full blocks computed so far
        self._loads: list[BlockTransfer] = []  # admitted this step
        self._load_start: dict[str, int] = {}  # request -> first block a match was looked up from
        self._saving: dict[str, _Saving] = {}
        self.store: KVBlockStore | None = None  # set by the subclass for the side(s) that use it
        self.num_loaded_blocks = 0  # worker side (counters)
        self.num_saved_blocks = 0

    # ---- scheduler side ----
    def _request_keys(self, request: Request, num_blocks: int) -> list[str]:
        keys = self._keys.get(request.request_id, [])
        if len(keys) < num_blocks:
            seed = self._seed
            extra = (request.lora_request.lora_name if request.lora_request is not None else None, request.cache_salt)
            if extra != (None, None):
                seed += repr(extra).encode()
            if request.mm_features:  # (coarser than the prefix cache: every block keyed by all the prompt's images)
                seed += repr([f.identifier for f in request.mm_features]).encode()
            keys = block_keys(seed, request.all_token_ids, self.block_size, len(keys), num_blocks, keys)
            self._keys[request.request_id] = keys
        return keys

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        """Full blocks after the local hit that the store holds (a consumer's; a prompt-logprobs request computes
        its prompt)."""
        if not self.is_consumer or request.sampling_params.prompt_logprobs is not None:
            return 0, False
        max_blocks = (request.num_tokens - 1) // self.block_size
        first = num_computed_tokens // self.block_size
        if first >= max_blocks:
            return 0, False
        keys = self._request_keys(request, max_blocks)
        self._load_start[request.request_id] = first
        return self.store.num_leading_present(keys[first:max_blocks]) * self.block_size, False

    def update_state_after_alloc(self, request: Request, block_ids: list[int], num_external_tokens: int) -> None:
        """Plan the loads into the blocks after the local hit; track the prompt blocks a producer will save."""
        rid = request.request_id
        first = self._load_start.pop(rid, 0)
        last = first + num_external_tokens // self.block_size
        if num_external_tokens:
            self._loads.append(BlockTransfer(rid, block_ids[first:last], self._keys[rid][first:last]))
        if self.is_producer and request.num_prompt_tokens >= self.block_size:
            saving = self._saving.get(rid)
            num_saved = saving.num_saved if saving else 0
            if num_external_tokens and first == 0:  # (kv_both) the loaded blocks are in the store already
                num_saved = max(num_saved, last)
            self._saving[rid] = _Saving(request, list(block_ids), num_saved)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> BlockStoreConnectorMetadata:
        """The loads planned at admission; for a producer, each prompt block completed by this step."""
        meta = BlockStoreConnectorMetadata(self._loads)
        self._loads = []
        if not self._saving:
            return meta
        new_tables = {r.req_id: r.block_ids[0] for r in scheduler_output.scheduled_new_reqs}
        for c in scheduler_output.scheduled_cached_reqs:
            s = self._saving.get(c.req_id)
            if s is None or c.req_id in new_tables:
                continue
            if c.num_blocks_kept is not None:
                del s.block_ids[c.num_blocks_kept:]
            for group, idx, block_id in c.replaced_block_ids or ():
                if group == 0:
                    s.block_ids[idx] = block_id
            s.block_ids.extend(c.new_block_ids[0])
        for rid in scheduler_output.num_scheduled_tokens:
            s = self._saving.get(rid)
            if s is None:
                continue
            req = s.request
            if rid in new_tables:
                s.block_ids = list(new_tables[rid])
            # (the scheduler counted this step's tokens in already)
            done = min(req.num_computed_tokens, req.num_prompt_tokens) // self.block_size
            if done > s.num_saved:
                keys = self._request_keys(req, done)
                meta.saves.append(BlockTransfer(rid, s.block_ids[s.num_saved:done], keys[s.num_saved:done]))
                s.num_saved = done
            if s.num_saved == req.num_prompt_tokens // self.block_size:
                del self._saving[rid]
        return meta

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Forget the request; saves are synchronous, so its blocks can be freed at once."""
        self._keys.pop(request.request_id, None)
        self._load_start.pop(request.request_id, None)
        self._saving.pop(request.request_id, None)
        return False, None

    # ---- worker side ----
    def register_kv_caches(self, kv_cache: torch.Tensor) -> None:
        """The stacked paged KV cache, [layers, 2, num_blocks, ...]; one block's bytes are [layers, 2, ...]."""
        if kv_cache.dim() < 3:
            raise ValueError(f"{type(self).__name__} needs a paged KV cache [layers, 2, num_blocks, ...].")
        super().register_kv_caches(kv_cache)
        self.block_shape = (kv_cache.shape[0], kv_cache.shape[1], *kv_cache.shape[3:])
        self.block_nbytes = kv_cache[:, :, 0].numel() * kv_cache.element_size()

    def start_load_kv(self, forward_context: Any = None) -> None:
        """Copy every block planned for this step into the paged cache (one indexed copy for all layers)."""
        meta = self._get_connector_metadata()
        if meta is None or not meta.loads:
            return
        import numpy as np
        import torch

        ids = [b for t in meta.loads for b in t.block_ids]
        keys = [k for t in meta.loads for k in t.keys]
        # one load per request: each request's blocks come from one place (a store may be several producers)
        buffers = [buf for t in meta.loads for buf in self.store.load(t.keys)]
        data = np.empty((len(keys), self.block_nbytes), dtype=np.uint8)
        for i, buf in enumerate(buffers):
            view = np.frombuffer(buf, dtype=np.uint8)
            if view.size != self.block_nbytes:
                raise RuntimeError(f"{type(self).__name__}: block {keys[i]} holds {view.size} bytes, this engine's "
                                   f"blocks {self.block_nbytes}: the producer runs another model or KV layout.")
            data[i] = view
        blocks = torch.from_numpy(data).view(self.kv_cache.dtype).view(len(keys), *self.block_shape)
        self.kv_cache[:, :, torch.tensor(ids)] = blocks.movedim(0, 2)
        self.num_loaded_blocks += len(ids)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any = None) -> None:
        """Save this step's completed prompt blocks; pagemill passes ALL_LAYERS and the stacked cache, once."""
        meta = self._get_connector_metadata()
        if meta is None or not meta.saves:
            return
        if layer_name != ALL_LAYERS:
            raise ValueError(f"{type(self).__name__} saves every layer at once (layer_name={ALL_LAYERS!r}).")
        import torch

        ids = [b for t in meta.saves for b in t.block_ids]
        keys = [k for t in meta.saves for k in t.keys]
        blocks = kv_layer[:, :, torch.tensor(ids)].movedim(2, 0).contiguous()
        self.store.save(keys, blocks.view(torch.uint8).view(len(ids), self.block_nbytes).numpy())
        self.num_saved_blocks += len(ids)

    def wait_for_save(self) -> None:
        """Saves are done when save_kv_layer returns."""

    def shutdown(self) -> None:
        """Close the store."""
        if self.store is not None:
            self.store.close()
