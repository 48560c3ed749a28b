"""What the scheduler asks of a KV connector's scheduler side (distributed/kv_transfer implements it): which prompt
tokens' KV can be loaded from outside instead of computed, and what to load and save each step."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from pagemill.core.sched_output import SchedulerOutput
    from pagemill.request import Request


class SchedulerConnector(Protocol):
    """The scheduler side of a KV connector (vLLM's KVConnectorBase_V1 in the SCHEDULER role)."""

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        """(tokens beyond `num_computed_tokens` whose KV can be loaded from outside, whether loading is async)."""
        ...

    def update_state_after_alloc(self, request: Request, block_ids: list[int], num_external_tokens: int) -> None:
        """The request was admitted into `block_ids`; its `num_external_tokens` are to be loaded."""
        ...

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> Any:
        """This step's loads and saves, handed to the worker side inside the SchedulerOutput."""
        ...

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """The request finished: (whether its blocks wait for an asynchronous save, kv_transfer_params)."""
        ...
