"""The responses a server keeps (`store: true`), in memory and bounded: GET /v1/responses/{id} reads them and
`previous_response_id` continues their conversation."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from pagemill.entrypoints.openai.protocol_responses import ResponsesResponse

# How many responses a server keeps by default; the least recently used one is dropped first.
DEFAULT_MAX_STORED_RESPONSES = 1024


@dataclass
class StoredResponse:
    """A finished response and the conversation it ended (its instructions left out, as OpenAI does: they are not
    carried over to a response that continues it)."""

    response: ResponsesResponse
    conversation: list[dict[str, str]]


class ResponsesStore:
    """An LRU map of response id -> StoredResponse, at most `max_entries` long (lost when the server stops)."""

    def __init__(self, max_entries: int = DEFAULT_MAX_STORED_RESPONSES) -> None:
        if max_entries < 1:
            raise ValueError(f"max_entries must be at least 1, got {max_entries}.")
        self.max_entries = max_entries
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, response: ResponsesResponse, conversation: list[dict[str, str]]) -> None:
        """Keep a finished response (dropping the least recently used one when full)."""
        self._entries[response.id] = StoredResponse(response, conversation)
        self._entries.move_to_end(response.id)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        """The stored response, or None (never stored, or dropped)."""
        entry = self._entries.get(response_id)
        if entry is not None:
            self._entries.move_to_end(response_id)
        return entry
