"""The Responses API's stored responses as clients reach them: `GET /v1/responses/{id}`, its
input items, cancel and `DELETE`, each within the requesting tenant's responses."""

from __future__ import annotations

import functools
from typing import Any, Literal

from starlette.responses import Response

from engine.entrypoints.openai.errors import APIError
from engine.entrypoints.openai.protocol_responses import (
    ConversationItem,
    InputTextPart,
    MessageItem,
    OutputTextPart,
)
from engine.entrypoints.openai.response_body import (
    LARGE_BODY_BYTES,
    JSONPiecesResponse,
    byte_pieces,
)
from engine.entrypoints.openai.response_store import ResponseStore, StoredResponse
from engine.entrypoints.openai.work_pool import TenantWorkPool


class StoredResponses:
    """Answers clients about the responses in `store` (which the Responses handler fills);
    decoding runs on `pool`, the server's."""

    def __init__(self, store: ResponseStore, pool: TenantWorkPool) -> None:
        self.store = store
        self.pool = pool

    async def retrieve(self, response_id: str, tenant: str | None) -> Response:
        """The stored response object, its JSON as it was first sent (a large one in views
        of its pieces, at the tenant's pace of the work pool); 404 if the tenant has none of
        this id."""
        stored = self.store.get(tenant, response_id)
        if stored is None:
            raise unknown_response(response_id)
        if len(stored.body_json) <= LARGE_BODY_BYTES:
            return Response(stored.body_json, media_type="application/json")
        return JSONPiecesResponse(byte_pieces(stored.body_json),
                                  pace=functools.partial(self.pool.pace_large_body, tenant))

    async def input_items(self, response_id: str, tenant: str | None, *, limit: int = 20,
                          order: Literal["asc", "desc"] = "desc", after: str | None = None
                          ) -> dict[str, Any]:
        """OpenAI's list of a stored response's input items (the conversation it continued,
        then its own input), `order` by position (`desc`: newest first), at most `limit`
        (1-100, checked by the route) after the item `after`; an item sent without an id gets
        one from its response and position. 404 if the tenant has no such response, 400 if
        `after` names none of its items. The items are decoded on a worker thread."""
        stored = self.store.get(tenant, response_id)
        if stored is None:
            raise unknown_response(response_id)
        return await self.pool.run(tenant, _input_item_page, stored, limit, order, after)

    def cancel(self, response_id: str, tenant: str | None) -> dict[str, Any]:
        """OpenAI cancels only responses run in the background, which this server does not
        run: 400 for a stored response, 404 if the tenant has none of this id."""
        if self.store.get(tenant, response_id) is None:
            raise unknown_response(response_id)
        raise APIError(400, "only responses created with background: true can be cancelled, "
                            "and this server runs none in the background (this one finished "
                            "before it was stored)", param="response_id")

    def delete(self, response_id: str, tenant: str | None) -> dict[str, Any]:
        """Forgets a stored response (later turns can no longer continue it); 404 if the
        tenant has none of this id."""
        if not self.store.delete(tenant, response_id):
            raise unknown_response(response_id)
        return {"id": response_id, "object": "response", "deleted": True}


def _input_item_page(stored: StoredResponse, limit: int, order: Literal["asc", "desc"],
                     after: str | None) -> dict[str, Any]:
    """A page of `input_items` (see `StoredResponses.input_items`)."""
    response_id = stored.response_id
    items = [_listed_item(item) for item in stored.items(0, stored.num_input_items)]
    if order == "desc":
        items.reverse()
    if after is not None:
        ids = [item["id"] for item in items]
        if after not in ids:
            raise APIError(400, f"after names no input item of {response_id!r}", param="after")
        items = items[ids.index(after) + 1:]
    page = items[:limit]
    return {"object": "list", "data": page,
            "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit}


def _listed_item(item: ConversationItem) -> dict[str, Any]:
    """An input item as OpenAI lists it (with the id it was stored with), a message's text as
    content parts."""
    listed = item.model_dump(exclude_none=True)
    if isinstance(item, MessageItem) and isinstance(item.content, str):
        part = (OutputTextPart(type="output_text", text=item.content) if item.role == "assistant"
                else InputTextPart(type="input_text", text=item.content))
        listed["content"] = [part.model_dump()]
    return listed


def unknown_response(response_id: str) -> APIError:
    return APIError(404, f"No response found with id {response_id!r}.", param="response_id",
                    code="response_not_found")
