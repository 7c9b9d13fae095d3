"""Stored responses of the Responses API: what `previous_response_id` continues and
`GET /v1/responses/{id}` returns. Kept in memory as JSON bytes, so that the bytes counted are
the bytes held; each tenant has its own quota of the store, and its least recently used
responses go first when it is full. Lost when the server stops.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import TypeAdapter

from engine.entrypoints.openai.protocol_responses import ConversationItem

_ITEMS: TypeAdapter[tuple[ConversationItem, ...]] = TypeAdapter(tuple[ConversationItem, ...])
# What one stored response holds besides its two JSON texts (the record, its key, two bytes
# objects' headers and the LRU's links), counted so that a flood of tiny responses is bounded
# too.
ENTRY_OVERHEAD_BYTES = 512


@dataclass(frozen=True)
class StoredResponse:
    """A finished response kept for later turns and for GET.

    `items_json` is the conversation up to and including this response, as a JSON array of
    items: the items of the response it continued, then its own input items, then its output
    as items (`instructions` are not kept: OpenAI does not carry them over); the first
    `num_input_items` are its input (what `input_items` lists). `job_id` is the chain's job as
    the client names it (not namespaced by tenant). `body_json` is the response object as it
    was returned.
    """

    response_id: str
    job_id: str | None
    items_json: bytes
    body_json: bytes
    num_input_items: int = 0

    @classmethod
    def of(cls, response_id: str, job_id: str | None, items: Sequence[ConversationItem],
           body: Mapping[str, Any], num_input_items: int) -> StoredResponse:
        """The record of a response, its conversation and body serialised."""
        return cls(response_id=response_id, job_id=job_id,
                   items_json=_ITEMS.dump_json(tuple(items)),
                   body_json=json.dumps(body, separators=(",", ":")).encode(),
                   num_input_items=num_input_items)

    @property
    def num_bytes(self) -> int:
        """What the store charges for it: its JSON texts and `ENTRY_OVERHEAD_BYTES`."""
        return len(self.items_json) + len(self.body_json) + ENTRY_OVERHEAD_BYTES

    def items(self) -> tuple[ConversationItem, ...]:
        """The conversation, decoded again."""
        return _ITEMS.validate_json(self.items_json)

    def body(self) -> dict[str, Any]:
        """The response object, decoded again."""
        body: dict[str, Any] = json.loads(self.body_json)
        return body


@dataclass
class _TenantShelf:
    """One tenant's stored responses, least recently used first."""

    entries: OrderedDict[str, StoredResponse] = field(default_factory=OrderedDict)
    num_bytes: int = 0


class ResponseStore:
    """Stored responses, each tenant (None on a server without API keys) within its own
    quota: at most `max_responses // num_tenants` responses of at most
    `max_bytes // num_tenants` bytes (by `StoredResponse.num_bytes`), its least recently stored
    or read evicted first. A tenant's writes never evict another tenant's responses, and
    another tenant's id is unknown to it. Owned by the Responses handler and called from the
    server's event loop only, so it takes no lock.
    """

    def __init__(self, *, max_responses: int, max_bytes: int, num_tenants: int = 1) -> None:
        if num_tenants < 1:
            raise ValueError("the response store needs at least one tenant")
        if max_responses < num_tenants or max_bytes < num_tenants * ENTRY_OVERHEAD_BYTES:
            raise ValueError("the response store needs room for at least one response per "
                             f"tenant ({num_tenants} tenants)")
        self.max_responses_per_tenant = max_responses // num_tenants
        self.max_bytes_per_tenant = max_bytes // num_tenants
        self._shelves: dict[str | None, _TenantShelf] = {}

    def __len__(self) -> int:
        return sum(len(shelf.entries) for shelf in self._shelves.values())

    @property
    def num_bytes(self) -> int:
        return sum(shelf.num_bytes for shelf in self._shelves.values())

    def put(self, tenant: str | None, response: StoredResponse) -> bool:
        """Stores `response`, evicting the tenant's least recently used responses until its
        quota holds; False (nothing changes) if it alone is over the tenant's bytes."""
        if response.num_bytes > self.max_bytes_per_tenant:
            return False
        self.delete(tenant, response.response_id)
        shelf = self._shelves.setdefault(tenant, _TenantShelf())
        while shelf.entries and (
                len(shelf.entries) >= self.max_responses_per_tenant
                or shelf.num_bytes + response.num_bytes > self.max_bytes_per_tenant):
            _, evicted = shelf.entries.popitem(last=False)
            shelf.num_bytes -= evicted.num_bytes
        shelf.entries[response.response_id] = response
        shelf.num_bytes += response.num_bytes
        return True

    def get(self, tenant: str | None, response_id: str) -> StoredResponse | None:
        """The tenant's stored response `response_id` (now the most recently used), or None."""
        shelf = self._shelves.get(tenant)
        response = None if shelf is None else shelf.entries.get(response_id)
        if response is not None:
            shelf.entries.move_to_end(response_id)
        return response

    def delete(self, tenant: str | None, response_id: str) -> bool:
        """Forgets the tenant's response `response_id`; False if it held none."""
        shelf = self._shelves.get(tenant)
        response = None if shelf is None else shelf.entries.pop(response_id, None)
        if response is None:
            return False
        shelf.num_bytes -= response.num_bytes
        return True
