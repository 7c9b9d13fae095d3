"""Tool call ids that name the engine request that issued them.

Every tool call the server returns (a chat `tool_calls` entry, a Responses `function_call`
item) gets the id `call_{index}-{engine request id}`. An agent sends the call back on its next
turn (in the assistant message, and in the tool result that answers it), so the server can
tell which finished turn a new request continues even when several conversations share every
token up to it (parallel rollouts of one prompt), and job inference binds the request to that
turn's job (`engine.request.Request.continues_request_id`). Ids made by other servers or by
clients name nothing here. A forged id can only point at a turn whose whole prompt the request
must still continue (the scheduler checks, with the tenant's salted block hashes), so it joins
no job that the request's prompt could not join anyway.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

_ISSUED = re.compile(r"call_(\d+)-(.+)", re.DOTALL)


def issued_call_id(request_id: str, index: int) -> str:
    """The id of the `index`-th tool call (from 0) of engine request `request_id`'s output."""
    return f"call_{index}-{request_id}"


def issuing_request_id(call_id: object) -> str | None:
    """The engine request that issued `call_id` (None: an id this server did not make)."""
    if not isinstance(call_id, str):
        return None
    match = _ISSUED.fullmatch(call_id)
    return None if match is None else match.group(2)


def continued_request_id(messages: Sequence[Mapping[str, Any]]) -> str | None:
    """The engine request whose turn a conversation (chat-template messages, oldest first)
    continues: the issuer of the tool calls of its latest assistant turn, read from that
    turn's last call or from the tool results after it. None when the latest assistant turn
    called no tool, or its calls were not issued here."""
    for message in reversed(messages):
        role = message.get("role")
        if role == "tool":
            return issuing_request_id(message.get("tool_call_id"))
        if role == "assistant":
            calls = message.get("tool_calls") or ()
            return issuing_request_id(calls[-1].get("id")) if calls else None
    return None
