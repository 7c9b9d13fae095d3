"""How large a request body's lists may be, checked on the parsed JSON before any field is
validated (validation holds the event loop: a 700,000-item input took 5.6 s, one message of
420,000 content parts 1.9 s; within these limits it takes at most about 0.1 s).

Standard library only: large bodies are parsed and checked in a child process
(`json_body.BodyParser`), before their model is validated there.
"""

from __future__ import annotations

import json
from typing import Any

# Most messages of a chat, or items of a Responses input; most content parts, tool calls and
# output parts in all its items; most tools.
MAX_CONVERSATION_ITEMS = 10_000
MAX_CONVERSATION_PARTS = 10_000
MAX_TOOLS = 1_024
_ITEM_PART_FIELDS = ("content", "tool_calls", "output")


class BodyLimitError(ValueError):
    """A body over a limit: `param` names the field (for a 400 `limit_exceeded`)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message, param)
        self.message = message
        self.param = param

    def __str__(self) -> str:
        return self.message


def check_counts(data: Any, conversation_field: str | None) -> None:
    """BodyLimitError if the body's `tools`, or its conversation (the list in
    `conversation_field`, if any), are over the limits: the conversation's items, and every
    block list in them and in a top-level `system` list (content parts, tool calls, output
    parts, and the blocks nested in those, such as a `tool_result`'s content), counted
    together. Linear in the body."""
    if not isinstance(data, dict):
        return
    tools = data.get("tools")
    if isinstance(tools, list) and len(tools) > MAX_TOOLS:
        raise BodyLimitError(f"tools has {len(tools)} tools, over the limit of {MAX_TOOLS}",
                             "tools")
    items = data.get(conversation_field) if conversation_field is not None else None
    if not isinstance(items, list):
        return
    if len(items) > MAX_CONVERSATION_ITEMS:
        raise BodyLimitError(f"{conversation_field} has {len(items)} items, over the limit of "
                             f"{MAX_CONVERSATION_ITEMS}", conversation_field)
    system = data.get("system")
    system_blocks = system if isinstance(system, list) else []
    num_parts = len(system_blocks) + _num_nested_parts([*items, *system_blocks])
    if num_parts > MAX_CONVERSATION_PARTS:
        raise BodyLimitError(f"the items of {conversation_field} hold {num_parts} content "
                             f"parts and tool calls, over the limit of "
                             f"{MAX_CONVERSATION_PARTS}", conversation_field)


def _num_nested_parts(values: list[Any]) -> int:
    """The items of every list held, at any depth, in a part field of `values`' objects."""
    num_parts = 0
    stack = [values]
    while stack:
        for value in stack.pop():
            if not isinstance(value, dict):
                continue
            for name in _ITEM_PART_FIELDS:
                nested = value.get(name)
                if isinstance(nested, list):
                    num_parts += len(nested)
                    stack.append(nested)
    return num_parts


def parse_checked(body: bytes, conversation_field: str | None) -> Any:
    """`body` parsed as JSON (as `json.loads` parses bytes) and checked by `check_counts`;
    json.JSONDecodeError or BodyLimitError otherwise. Runs in the parsing child process."""
    data = json.loads(body)
    check_counts(data, conversation_field)
    return data
