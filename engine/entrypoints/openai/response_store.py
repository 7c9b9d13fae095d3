"""Stored responses of the Responses API: what `previous_response_id` continues and
`GET /v1/responses/{id}` returns. Kept in memory as JSON bytes, so that the bytes counted are
the bytes held, and a retrieval sends the response's bytes as they were first sent; each
tenant has its own quota of the store, and its least recently used responses go first when it
is full. Lost when the server stops.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import TypeAdapter

from engine.entrypoints.openai.protocol_responses import ConversationItem

_ITEM: TypeAdapter[ConversationItem] = TypeAdapter(ConversationItem)
# What one stored response holds besides its JSON texts (the record, its key, the body's bytes
# header and the LRU's links), and each item besides its JSON (a bytes header and a tuple
# slot), counted so that a flood of tiny responses or items is bounded too.
ENTRY_OVERHEAD_BYTES = 512
ITEM_OVERHEAD_BYTES = 48


def item_json(item: ConversationItem) -> bytes:
    """An item as the store keeps it."""
    return _ITEM.dump_json(item)


@dataclass(frozen=True)
class StoredResponse:
    """A finished response kept for later turns and for GET.

    `item_jsons` is the conversation up to and including this response, one JSON text an
    item: the items of the response it continued, then its own input items, then its output
    as items (`instructions` are not kept: OpenAI does not carry them over); the first
    `num_input_items` are its input (what `input_items` lists). A later turn of the chain
    reuses these texts as they are. `job_id` is the chain's job as the client names it (not
    namespaced by tenant). `body_json` is the response object's JSON as it was returned, and
    as retrievals return it. `num_bytes` is what the store charges for it: its JSON texts and
    their overheads.
    """

    response_id: str
    job_id: str | None
    item_jsons: tuple[bytes, ...]
    body_json: bytes
    num_input_items: int
    num_bytes: int

    @classmethod
    def of(cls, response_id: str, job_id: str | None, item_jsons: Sequence[bytes],
           body_json: bytes, num_input_items: int) -> StoredResponse:
        """The record of a response: its conversation's item texts and its body's JSON."""
        num_bytes = (sum(map(len, item_jsons)) + ITEM_OVERHEAD_BYTES * len(item_jsons)
                     + len(body_json) + ENTRY_OVERHEAD_BYTES)
        return cls(response_id=response_id, job_id=job_id, item_jsons=tuple(item_jsons),
                   body_json=body_json, num_input_items=num_input_items, num_bytes=num_bytes)

    def items(self, start: int = 0, stop: int | None = None) -> list[ConversationItem]:
        """The conversation's items `start:stop`, decoded again (work in proportion to their
        size: callers on the event loop decode a page, or decode on a worker thread)."""
        return [_ITEM.validate_json(text) for text in self.item_jsons[start:stop]]

    def body(self) -> dict[str, Any]:
        """The response object, decoded again (work in proportion to its size)."""
        body: dict[str, Any] = json.loads(self.body_json)
        return body


def check_store_room(max_responses: int, max_bytes: int, num_tenants: int) -> None:
    """ValueError unless a store of these limits holds at least one response a tenant."""
    if num_tenants < 1:
        raise ValueError("the response store needs at least one tenant")
    if max_responses < num_tenants or max_bytes < num_tenants * ENTRY_OVERHEAD_BYTES:
        raise ValueError(f"the response store must hold at least one response of each of the "
                         f"{num_tenants} tenants (max_stored_responses at least {num_tenants}, "
                         f"max_stored_response_bytes at least "
                         f"{num_tenants * ENTRY_OVERHEAD_BYTES})")


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
        check_store_room(max_responses, max_bytes, num_tenants)
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
