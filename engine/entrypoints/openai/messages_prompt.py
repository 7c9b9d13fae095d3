"""A Messages request as the chat template takes it (`template_conversation`), the checks
that need its whole conversation (`check_messages_fields`), where its last cache breakpoint
falls in the prompt (`prompt_cache_breakpoint`), and its prompt's token count
(`count_prompt_unless_refused`). Used by the Messages route, and by the child process that
parses a large or tool-heavy `count_tokens` body (`json_body.BodyParser`): rendering 1,024
tools holds the GIL for 40-70 ms, which in the server's process delays every other
request's next step on the event loop.

The conversation: the system prompt first; a message's text blocks joined by newlines (and
consecutive user texts as one turn); an assistant's `tool_use` blocks as its `tool_calls`;
each `tool_result` block as a `tool` message (in the order of the user message's blocks);
thinking blocks left out.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from engine.entrypoints.openai.chat_prompt import ChatPrompt
from engine.entrypoints.openai.errors import APIError, check_unique_names
from engine.entrypoints.openai.protocol_messages import (
    CacheControl,
    Message,
    MessagesFields,
    TextBlock,
    ToolChoiceAny,
    ToolChoiceTool,
    ToolResultBlock,
    ToolUseBlock,
)
from engine.frontend.chat_template import render_chat
from engine.frontend.processor import COUNT_ANY_LENGTH, InputProcessor
from engine.sampling_params import CacheBreakpoint

# The longest a client's cache breakpoint may ask the engine to keep a prompt's KV, in
# seconds: Anthropic's longest TTL ("1h"). A breakpoint asking for more is clamped to it.
MAX_CACHE_TTL_S = 3600.0
# Anthropic's limit on the blocks with `cache_control` in one request.
MAX_CACHE_BREAKPOINTS = 4


@dataclass(frozen=True)
class Conversation:
    """A Messages request as the chat template takes it: its messages and tools, whether the
    last message is an assistant's text to continue (`continues_final`), and the last cache
    breakpoint: its `cache_control`, and the conversation cut where it falls
    (`breakpoint_messages`: the messages up to the block that carries it, that block's
    message ending with it; `breakpoint_at_end`: it covers the whole prompt). Nothing is
    marked in the text, so no client text can move or hide a breakpoint."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    continues_final: bool
    cache_control: CacheControl | None = None
    breakpoint_messages: list[dict[str, Any]] | None = None
    breakpoint_at_end: bool = False

    def render_options(self) -> dict[str, Any]:
        """How the template renders it: a generation prompt, or the last message continued."""
        if self.continues_final:
            return {"add_generation_prompt": False,
                    "chat_template_kwargs": {"continue_final_message": True}}
        return {"add_generation_prompt": True, "chat_template_kwargs": None}


def check_messages_fields(body: MessagesFields) -> None:
    """APIError(400) for what the models cannot say, as Anthropic refuses it: tools named
    twice, a `tool_choice` without tools or naming none of them, too many cache
    breakpoints or a 1h one after a 5m one, a first message not the user's, a `tool_use` or
    `tool_result` in the wrong role's message or without tools, `tool_use` ids used twice, a
    message without content (but a last assistant's), an empty or blank text block, a
    `tool_result` after other content, a `tool_use` not answered by a `tool_result` in the
    next message, a last message that calls a tool or ends in whitespace."""
    names = [tool.name for tool in body.tools or ()]
    check_unique_names(names, "tools")
    choice = body.tool_choice
    if isinstance(choice, ToolChoiceAny | ToolChoiceTool) and not names:
        raise APIError(400, f"tool_choice {choice.type!r} needs tools", param="tool_choice")
    if isinstance(choice, ToolChoiceTool) and choice.name not in names:
        raise APIError(400, f"tool_choice names {choice.name!r}, which is not among the tools",
                       param="tool_choice.name")
    _check_cache_controls(body)
    if isinstance(body.system, list):
        _check_texts("system", body.system)
    if body.messages[0].role != "user":
        raise APIError(400, "messages.0: the first message must be the user's",
                       param="messages.0.role")
    tool_use_ids: set[str] = set()
    for index, message in enumerate(body.messages):
        _check_message(index, message, is_last=index == len(body.messages) - 1,
                       has_tools=bool(names), tool_use_ids=tool_use_ids)
        if index + 1 < len(body.messages):
            _check_answered(index, message, body.messages[index + 1])
    _check_last(len(body.messages) - 1, body.messages[-1])


def _check_cache_controls(body: MessagesFields) -> None:
    found = _cache_controls(body)
    if len(found) > MAX_CACHE_BREAKPOINTS:
        raise APIError(400, f"{len(found)} blocks have cache_control, over the limit of "
                            f"{MAX_CACHE_BREAKPOINTS}", param="cache_control")
    ttls = [control.ttl for _, control in found]
    if "5m" in ttls and "1h" in ttls[ttls.index("5m"):]:
        raise APIError(400, "a cache_control with ttl '1h' must come before every one with "
                            "ttl '5m' (in the order tools, system, messages)",
                       param="cache_control")


def _check_message(index: int, message: Message, *, is_last: bool, has_tools: bool,
                   tool_use_ids: set[str]) -> None:
    """The checks of one message (`tool_use_ids`: those of the messages before it, to
    which it adds its own)."""
    where = f"messages.{index}"
    if not message.content and not (is_last and message.role == "assistant"):
        raise APIError(400, f"{where}: all messages must have non-empty content except for "
                            "the optional final assistant message", param=f"{where}.content")
    blocks = message.blocks
    wrong, name = ((ToolResultBlock, "tool_result") if message.role == "assistant"
                   else (ToolUseBlock, "tool_use"))
    if any(isinstance(block, wrong) for block in blocks):
        raise APIError(400, f"{where}: a {message.role} message cannot hold {name} blocks",
                       param=f"{where}.content")
    if any(isinstance(block, ToolUseBlock | ToolResultBlock) for block in blocks) and \
            not has_tools:
        raise APIError(400, "Requests which include `tool_use` or `tool_result` blocks must "
                            "define tools.", param=f"{where}.content")
    if message.content:
        _check_texts(f"{where}.content", blocks)
    is_result = [isinstance(block, ToolResultBlock) for block in blocks]
    if any(is_result) and not all(is_result[:is_result.count(True)]):
        raise APIError(400, f"{where}: tool_result blocks must come first in a message's "
                            "content, before any other block", param=f"{where}.content")
    for block_index, block in enumerate(blocks):
        if isinstance(block, ToolUseBlock):
            if block.id in tool_use_ids:
                raise APIError(400, f"{where}.content.{block_index}: `tool_use` ids must be "
                                    "unique", param=f"{where}.content.{block_index}.id")
            tool_use_ids.add(block.id)


def _check_texts(where: str, blocks: Sequence[Any]) -> None:
    """APIError(400) for an empty text block among `blocks` (at `where`), or a blank one
    when none of them has other text (as Anthropic refuses them)."""
    texts = [(index, block.text) for index, block in enumerate(blocks)
             if isinstance(block, TextBlock)]
    all_blank = not any(text.strip() for _, text in texts)
    for block_index, text in texts:
        if not text or (all_blank and not text.strip()):
            why = "must be non-empty" if not text else "must contain non-whitespace text"
            raise APIError(400, f"{where}.{block_index}: text content blocks {why}",
                           param=f"{where}.{block_index}.text")


def _check_last(index: int, last: Message) -> None:
    if last.role != "assistant":
        return
    if any(isinstance(block, ToolUseBlock) for block in last.blocks):
        raise APIError(400, "the last message may be an assistant's only to be continued "
                            "(text); a tool_use must be answered by a tool_result",
                       param=f"messages.{index}.content")
    texts = [block for block in last.blocks if isinstance(block, TextBlock)]
    if texts and texts[-1].text != texts[-1].text.rstrip():
        raise APIError(400, "final assistant content cannot end with trailing whitespace",
                       param=f"messages.{index}.content")


def _is_user_text(message: dict[str, Any]) -> bool:
    return message["role"] == "user" and isinstance(message.get("content"), str)


def _check_answered(index: int, message: Message, following: Message) -> None:
    """APIError(400) unless every `tool_use` of `message` has its `tool_result` in
    `following`, the next message."""
    called = [block.id for block in message.blocks if isinstance(block, ToolUseBlock)]
    if not called:
        return
    answered = {block.tool_use_id for block in following.blocks
                if isinstance(block, ToolResultBlock)}
    missing = [call_id for call_id in called if call_id not in answered]
    if missing:
        raise APIError(400, f"messages.{index + 1}: tool_use ids were found without "
                            f"tool_result blocks right after them: {', '.join(missing)}",
                       param=f"messages.{index + 1}.content")


def _cache_controls(body: MessagesFields) -> list[tuple[tuple[int, int], CacheControl]]:
    """The breakpoints in Anthropic's order, each with where it falls: (-1, 0) for the tools
    and the system prompt (before the first message), (message, block) for a message's (the
    top-level one's is the last message's last block)."""
    found: list[tuple[tuple[int, int], CacheControl]] = []
    for tool in body.tools or ():
        if tool.cache_control is not None:
            found.append(((-1, 0), tool.cache_control))
    if isinstance(body.system, list):
        found.extend(((-1, 0), block.cache_control) for block in body.system
                     if block.cache_control is not None)
    for message_index, message in enumerate(body.messages):
        for block_index, block in enumerate(message.blocks):
            if block.cache_control is not None:
                found.append(((message_index, block_index), block.cache_control))
    if body.cache_control is not None:  # the top level's: on the last block
        last = len(body.messages) - 1
        found.append(((last, max(0, len(body.messages[last].blocks) - 1)), body.cache_control))
    return found


def last_cache_control(body: MessagesFields) -> CacheControl | None:
    found = _cache_controls(body)
    return found[-1][1] if found else None


def template_conversation(body: MessagesFields) -> Conversation:
    """The request as chat-template messages and tools (see the module's docstring), with
    the last cache breakpoint marked; APIError(400) for a `tool_result` that answers no
    `tool_use` before it."""
    found = _cache_controls(body)
    place, control = found[-1] if found else (None, None)
    builder = _MessageBuilder(cut_place=place)
    system = body.system
    if system:
        text = system if isinstance(system, str) else "\n".join(b.text for b in system)
        builder.messages.append({"role": "system", "content": text})
    builder.cut_next = place == (-1, 0)
    for index, message in enumerate(body.messages):
        builder.add(index, message.role, message.blocks)
    messages = builder.messages
    continues_final = body.messages[-1].role == "assistant" and bool(messages[-1]["content"])
    if body.messages[-1].role == "assistant" and not continues_final:
        messages = messages[:-1]  # empty: a plain generation prompt
    tools = None if not body.tools else [
        {"type": "function", "function": {
            "name": tool.name, **({} if tool.description is None
                                  else {"description": tool.description}),
            "parameters": tool.input_schema}}
        for tool in body.tools]
    return Conversation(
        messages=messages, tools=tools, continues_final=continues_final,
        cache_control=control,
        breakpoint_messages=builder.cut if control is not None else None,
        breakpoint_at_end=control is not None and builder.cut_next)


class _MessageBuilder:
    """Builds the template messages one Anthropic message at a time, and the conversation
    cut at the block at `cut_place` (`cut`): after a text or a tool result, or (`cut_next`)
    at the start of the content of the message that follows a `tool_use` or thinking
    block's message, or the tools and system prompt."""

    def __init__(self, cut_place: tuple[int, int] | None) -> None:
        self.cut_place = cut_place
        self.cut_next = False
        self.cut: list[dict[str, Any]] | None = None
        self.messages: list[dict[str, Any]] = []
        self._names_by_call_id: dict[str, str] = {}

    def _append(self, message: dict[str, Any]) -> None:
        if self.cut_next:
            self.cut = [*self.messages, {**message, "content": ""}]
            self.cut_next = False
        last = self.messages[-1] if self.messages else None
        if _is_user_text(message) and last is not None and _is_user_text(last):
            # Consecutive user turns are one turn, as Anthropic combines them (a new dict:
            # the cut conversation may hold the last one).
            self.messages[-1] = {**last, "content": f"{last['content']}\n{message['content']}"}
            return
        self.messages.append(message)

    def add(self, index: int, role: str, blocks: Sequence[Any]) -> None:
        texts: list[str] = []
        calls: list[dict[str, Any]] = []
        cut_after = False
        for block_index, block in enumerate(blocks):
            cut_here = self.cut_place == (index, block_index)
            if isinstance(block, TextBlock):
                texts.append(block.text)
                if cut_here:
                    self.cut = [*self.messages, {"role": role, "content": "\n".join(texts)}]
            elif isinstance(block, ToolUseBlock):
                self._names_by_call_id[block.id] = block.name
                calls.append({"id": block.id, "type": "function",
                              "function": {"name": block.name, "arguments": block.input}})
                cut_after = cut_after or cut_here
            elif isinstance(block, ToolResultBlock):
                if texts:  # text before a result stays before it
                    self._append({"role": role, "content": "\n".join(texts)})
                    texts = []
                self._append(self._tool_message(index, block))
                if cut_here:
                    self.cut = list(self.messages)
            else:  # a thinking block, left out
                cut_after = cut_after or cut_here
        if texts or calls or role == "assistant":
            message: dict[str, Any] = {"role": role, "content": "\n".join(texts)}
            if calls:
                message["tool_calls"] = calls
            self._append(message)
        self.cut_next = self.cut_next or cut_after

    def _tool_message(self, index: int, block: ToolResultBlock) -> dict[str, Any]:
        name = self._names_by_call_id.get(block.tool_use_id)
        if name is None:
            raise APIError(400, f"messages.{index}: tool_result {block.tool_use_id!r} answers "
                                "no tool_use before it", param=f"messages.{index}.content")
        text = f"Error: {block.text}" if block.is_error else block.text
        return {"role": "tool", "tool_call_id": block.tool_use_id, "name": name,
                "content": text}


def prompt_cache_breakpoint(tokenizer: Any, conversation: Conversation, token_ids: list[int],
                            *, max_ttl_s: float | None = None) -> CacheBreakpoint | None:
    """The breakpoint of a conversation whose prompt is `token_ids`: as many of the prompt's
    tokens as the rendering of the conversation cut at the breakpoint shares with it (the cut
    rendering ends its last message there, so the two part where the breakpoint falls), for
    the breakpoint's TTL capped at `max_ttl_s` (default `MAX_CACHE_TTL_S`). None: no
    breakpoint, or none of the prompt before it."""
    control = conversation.cache_control
    if control is None:
        return None
    ttl_s = min(control.ttl_s, MAX_CACHE_TTL_S if max_ttl_s is None else max_ttl_s)
    if conversation.breakpoint_at_end:
        return CacheBreakpoint(num_prompt_tokens=len(token_ids), ttl_s=ttl_s)
    if not conversation.breakpoint_messages:
        return None
    try:
        cut = render_chat(tokenizer, conversation.breakpoint_messages, tools=conversation.tools,
                          add_generation_prompt=False)
    except ValueError:
        return None
    num_tokens = _num_common(tokenizer.encode(cut, add_special_tokens=False), token_ids)
    return None if num_tokens == 0 else CacheBreakpoint(num_prompt_tokens=num_tokens,
                                                        ttl_s=ttl_s)


def _num_common(first: Sequence[int], second: Sequence[int]) -> int:
    """How many tokens two sequences share from their start."""
    count = 0
    for a, b in zip(first, second, strict=False):
        if a != b:
            break
        count += 1
    return count


def prompt_token_ids(processor: InputProcessor, conversation: Conversation, *,
                     count_only: bool = False) -> list[int]:
    """The conversation's prompt; with `count_only`, however long (no room is kept for
    output). PromptTooLongError (without `count_only`), or ValueError from the template."""
    return processor.chat_prompt(conversation.messages, tools=conversation.tools,
                                 max_tokens=COUNT_ANY_LENGTH if count_only else None,
                                 **conversation.render_options())


def count_prompt(processor: InputProcessor, body: MessagesFields) -> ChatPrompt:
    """The whole prompt of a `count_tokens` body whose fields passed
    `check_messages_fields`, however long (counting past the context is how a client learns
    how far to trim it); the template's error in `error`. APIError(400) from
    `template_conversation`."""
    conversation = template_conversation(body)
    try:
        return ChatPrompt(prompt_token_ids(processor, conversation, count_only=True), None)
    except ValueError as error:
        return ChatPrompt(None, None, error=str(error))


def count_prompt_unless_refused(processor: InputProcessor, body: MessagesFields
                                ) -> ChatPrompt | None:
    """`count_prompt` in the child that parsed the body; None (left to the route, which
    refuses it) when `check_messages_fields` or `template_conversation` refuses it."""
    try:
        check_messages_fields(body)
        return count_prompt(processor, body)
    except APIError:
        return None
