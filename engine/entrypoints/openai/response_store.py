"""Stored responses of the Responses API: what `previous_response_id` continues and
`GET /v1/responses/{id}` returns. Kept in memory, per tenant, bounded in count and in bytes;
the least recently used go first. Lost when the server stops.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from engine.entrypoints.openai.protocol_responses import ConversationItem


@dataclass(frozen=True)
class StoredResponse:
    """A finished response kept for later turns and for GET.

    `items` is the conversation up to and including this response: the items of the response
    it continued, then its own input items, then its output as items (`instructions` are not
    kept: OpenAI does not carry them over); the first `num_input_items` are its input (what
    `input_items` lists). `job_id` is the chain's job as the client names
    it (not namespaced by tenant). `body` is the response object as it was returned.
    `num_bytes` is the JSON size of `body` plus that of every item of `items`; items shared
    with the responses earlier in the chain are counted in each, so the store's byte total
    bounds the memory it holds.
    """

    response_id: str
    job_id: str | None
    items: tuple[ConversationItem, ...]
    items_num_bytes: int
    body: Mapping[str, Any]
    num_bytes: int
    num_input_items: int = 0


class ResponseStore:
    """At most `max_responses` stored responses of at most `max_bytes` in all (by
    `StoredResponse.num_bytes`), least recently stored or read evicted first.

    Each tenant (None on a server without API keys) sees only its own responses: another
    tenant's id is unknown to it. Owned by the Responses handler and called from the server's
    event loop only, so it takes no lock.
    """

    def __init__(self, *, max_responses: int, max_bytes: int) -> None:
        if max_responses < 1 or max_bytes < 1:
            raise ValueError("the response store needs room for at least one response")
        self.max_responses = max_responses
        self.max_bytes = max_bytes
        self._entries: OrderedDict[tuple[str | None, str], StoredResponse] = OrderedDict()
        self._num_bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def num_bytes(self) -> int:
        return self._num_bytes

    def put(self, tenant: str | None, response: StoredResponse) -> bool:
        """Stores `response`, evicting the least recently used until the limits hold; False
        (nothing changes) if it alone is over `max_bytes`."""
        if response.num_bytes > self.max_bytes:
            return False
        self.delete(tenant, response.response_id)
        while self._entries and (len(self._entries) >= self.max_responses
                                 or self._num_bytes + response.num_bytes > self.max_bytes):
            _, evicted = self._entries.popitem(last=False)
            self._num_bytes -= evicted.num_bytes
        self._entries[(tenant, response.response_id)] = response
        self._num_bytes += response.num_bytes
        return True

    def get(self, tenant: str | None, response_id: str) -> StoredResponse | None:
        """The tenant's stored response `response_id` (now the most recently used), or None."""
        key = (tenant, response_id)
        response = self._entries.get(key)
        if response is not None:
            self._entries.move_to_end(key)
        return response

    def delete(self, tenant: str | None, response_id: str) -> bool:
        """Forgets the tenant's response `response_id`; False if it held none."""
        response = self._entries.pop((tenant, response_id), None)
        if response is None:
            return False
        self._num_bytes -= response.num_bytes
        return True
