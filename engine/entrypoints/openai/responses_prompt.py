"""A Responses request's conversation as the chat template takes it: the stored chain's items
and the request's input, `instructions` first, function calls and their outputs as chat's tool
calls and tool messages, the function tools as chat's tools."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from engine.entrypoints.openai.chat_prompt import template_message
from engine.entrypoints.openai.errors import APIError
from engine.entrypoints.openai.protocol import ChatMessage, FunctionCallIn, ToolCallIn
from engine.entrypoints.openai.protocol_responses import (
    ConversationItem,
    FunctionCallItem,
    FunctionCallOutputItem,
    MessageItem,
    ResponsesRequest,
    content_text,
)
from engine.entrypoints.openai.response_store import StoredResponse, item_json
from engine.entrypoints.openai.serving import new_id


def input_items(body: ResponsesRequest) -> tuple[ConversationItem, ...]:
    """The request's input as items (a string input as one user message)."""
    if isinstance(body.input, str):
        return (MessageItem(role="user", content=body.input),)
    return tuple(body.input)



def conversation(previous: StoredResponse | None, input_items: Sequence[ConversationItem]
                  ) -> tuple[list[ConversationItem], tuple[bytes, ...]]:
    """The conversation a turn renders (the stored chain's items, decoded, then its input) and
    the same as the store keeps it (the chain's texts as they are, the input's serialised, an
    input item without an id given one, so that it keeps its id under every response that
    lists it). Work in proportion to the conversation, for a worker thread."""
    items = [*(() if previous is None else previous.items()), *input_items]
    jsons = (*(() if previous is None else previous.item_jsons),
             *(item_json(_with_id(item)) for item in input_items))
    return items, jsons


_ID_PREFIXES = {"message": "msg", "function_call": "fc", "function_call_output": "fco",
                "reasoning": "rs"}


def _with_id(item: ConversationItem) -> ConversationItem:
    if item.id is not None:
        return item
    return item.model_copy(update={"id": new_id(_ID_PREFIXES[item.type], "_")})


def template_messages(instructions: str | None, items: Sequence[ConversationItem]
                      ) -> list[dict[str, Any]]:
    """The conversation as chat-template messages: `instructions` as a system message first,
    `function_call` items as `tool_calls` of the assistant message before them (or of a new
    one), `function_call_output` items as `tool` messages naming their function; reasoning
    items are left out. APIError(400) for an output that answers no call of the
    conversation, and, as OpenAI has it, for a call no output answers (but one the output
    was cut off in: `incomplete`)."""
    messages: list[ChatMessage] = []
    if instructions is not None:
        messages.append(ChatMessage(role="system", content=instructions))
    names_by_call_id: dict[str, str] = {}
    settled: set[str] = set()
    for item in items:
        if isinstance(item, MessageItem):
            messages.append(ChatMessage(role=item.role, content=content_text(item.content)))
        elif isinstance(item, FunctionCallItem):
            names_by_call_id[item.call_id] = item.name
            if item.status == "incomplete":
                settled.add(item.call_id)
            call = ToolCallIn(id=item.call_id, function=FunctionCallIn(
                name=item.name, arguments=item.arguments))
            if messages and messages[-1].role == "assistant":
                messages[-1].tool_calls = [*(messages[-1].tool_calls or ()), call]
            else:
                messages.append(ChatMessage(role="assistant", tool_calls=[call]))
        elif isinstance(item, FunctionCallOutputItem):
            name = names_by_call_id.get(item.call_id)
            if name is None:
                raise APIError(400, f"no function_call with call_id {item.call_id!r} precedes "
                                    "its function_call_output", param="input")
            messages.append(ChatMessage(role="tool", content=content_text(item.output),
                                        tool_call_id=item.call_id, name=name))
            settled.add(item.call_id)
    unanswered = [call_id for call_id in names_by_call_id if call_id not in settled]
    if unanswered:
        raise APIError(400, f"No tool output found for function call {unanswered[0]}.",
                       param="input")
    return [template_message(message) for message in messages]


def template_tools(body: ResponsesRequest) -> list[dict[str, Any]] | None:
    """The function tools as chat's tools (None without tools)."""
    return None if not body.tools else [
        {"type": "function", "function": tool.model_dump(
            include={"name", "description", "parameters"}, exclude_none=True)}
        for tool in body.tools]
