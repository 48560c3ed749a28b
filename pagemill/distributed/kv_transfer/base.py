"""The KV connector interface, after vLLM's `KVConnectorBase_V1`.

A connector has two halves built from the same class: the scheduler side (in the scheduler: how many of a
request's tokens are available outside, what to load and save this step) and the worker side (in the model
runner: load KV into the paged cache before the forward, save it after). The scheduler side hands the worker
side a KVConnectorMetadata inside each SchedulerOutput.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from pagemill.config import EngineConfig
    from pagemill.core.sched_output import SchedulerOutput
    from pagemill.request import Request

# save_kv_layer's layer name for the stacked KV tensor of every layer (pagemill saves once per step).
ALL_LAYERS = "*"


class KVConnectorRole(enum.Enum):
    """Which half of a connector an instance is."""

    SCHEDULER = 0
    WORKER = 1


class KVConnectorMetadata:
    """What the scheduler side tells the worker side for one step (connector-specific; must pickle)."""


class KVConnectorBase_V1(ABC):  # noqa: N801 (vLLM's name)
    """Moves KV blocks between this engine's paged cache and somewhere outside it (storage, another engine)."""

    def __init__(self, config: EngineConfig, role: KVConnectorRole) -> None:
        self.config = config
        self.role = role
        self.kv_transfer_config = config.kv_transfer_config
        self._connector_metadata: KVConnectorMetadata | None = None

    # ---- worker side ----
    def bind_connector_metadata(self, metadata: KVConnectorMetadata | None) -> None:
        """Set this step's metadata (before start_load_kv)."""
        self._connector_metadata = metadata

    def clear_connector_metadata(self) -> None:
        """Forget this step's metadata (after wait_for_save)."""
        self._connector_metadata = None

    def _get_connector_metadata(self) -> KVConnectorMetadata | None:
        return self._connector_metadata

    def register_kv_caches(self, kv_cache: torch.Tensor) -> None:
        """The paged KV cache of every layer, [layers, 2, num_blocks, ...] (block ids index dimension 2)."""
        self.kv_cache = kv_cache

    @abstractmethod
    def start_load_kv(self, forward_context: Any = None) -> None:
        """Start loading this step's external KV into the paged cache (before the forward)."""

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Block until `layer_name`'s KV is loaded (no-op for connectors whose start_load_kv loads everything)."""

    @abstractmethod
    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any = None) -> None:
        """Start saving one layer's KV (ALL_LAYERS: the stacked tensor of every layer) after it was computed."""

    @abstractmethod
    def wait_for_save(self) -> None:
        """Block until this step's saves are done (before the step's output leaves the engine)."""

    def shutdown(self) -> None:
        """Release sockets, threads and files."""

    # ---- scheduler side ----
    @abstractmethod
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        """(tokens beyond `num_computed_tokens` whose KV can be loaded from outside, whether loading is
        asynchronous). Never the request's last token: its logits must be computed."""

    @abstractmethod
    def update_state_after_alloc(self, request: Request, block_ids: list[int], num_external_tokens: int) -> None:
        """The request was admitted: `block_ids` is its block table; the `num_external_tokens` after its local
        prefix hit are to be loaded into it."""

    @abstractmethod
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """This step's loads and saves for the worker side (resets the scheduler side's per-step state)."""

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """The request finished: (whether its blocks must stay allocated until an asynchronous save is done,
        kv_transfer_params for the response)."""
        return False, None
