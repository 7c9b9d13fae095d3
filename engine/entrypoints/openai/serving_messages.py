"""POST /v1/messages and POST /v1/messages/count_tokens: the Anthropic Messages API on the
chat machinery, as turns of the same engine, jobs and tenants.

A request becomes chat-template messages (`template_conversation`): the system prompt first;
a message's text blocks joined by newlines; an assistant's `tool_use` blocks as its
`tool_calls`; each `tool_result` block as a `tool` message (in the order of the user message's
blocks); thinking blocks left out. The chat template renders them with the tools (in the Hermes
format where it leaves tools out: `engine/frontend/chat_template.py`); a conversation that ends
with an assistant message is continued from its text (a prefill). `tool_choice` constrains the
output through the chat's grammar path (`any` as "required", `tool` as a named function,
`disable_parallel_tool_use` as `parallel_tool_calls: false`), and the chat tool-call parser
splits the output into a text block and `tool_use` blocks, each with an id that names the
engine request that issued it (`tool_call_ids`), so that the next turn, which sends it back,
continues this turn's job.

`cache_control` breakpoints: the last one, in Anthropic's order (tools, system, messages), is
the request's `CacheBreakpoint`: the prompt's tokens up to and including its block (a tool's
or a system block's stands for everything before the first message, where the template puts
them; a `tool_use` block's for everything before the next message) and its TTL, capped at
`MAX_CACHE_TTL_S`. Usage reports `cache_read_input_tokens` (the prompt's tokens whose KV came
from the prefix cache or a pin, as the engine reports them), `cache_creation_input_tokens`
(the tokens up to the breakpoint that were not read, by the breakpoint's TTL in
`cache_creation`) and `input_tokens` (the rest of the prompt).

A stream is Anthropic's events: `message_start` (once the engine's first output arrives, with
the usage then known) and a `ping`; `content_block_start` / `content_block_delta` /
`content_block_stop` for the text block (its text as it comes, held back where a tool call may
begin) and then for each `tool_use` block (its input as one `input_json_delta`);
`message_delta` with the stop reason and the usage; `message_stop`. A failure after the stream
started is an `error` event.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from engine.core.client import EngineDeadError
from engine.entrypoints.openai.anthropic_errors import anthropic_error_body
from engine.entrypoints.openai.drain import ServerShuttingDownError
from engine.entrypoints.openai.errors import APIError, check_unique_names
from engine.entrypoints.openai.protocol import (
    ChatTool,
    FunctionDefinition,
    NamedFunction,
    NamedToolChoice,
)
from engine.entrypoints.openai.protocol_messages import (
    CacheControl,
    CacheTTL,
    Message,
    MessagesCountTokensRequest,
    MessagesFields,
    MessagesRequest,
    TextBlock,
    ToolChoiceAny,
    ToolChoiceAuto,
    ToolChoiceNone,
    ToolChoiceTool,
    ToolResultBlock,
    ToolUseBlock,
)
from engine.entrypoints.openai.refusal_pacing import RefusalPacer
from engine.entrypoints.openai.serving import (
    ClientContext,
    OpenAIServing,
    ServerSettings,
    merge_streams,
    new_id,
    sse,
)
from engine.entrypoints.openai.structured_outputs import (
    GrammarChecker,
    chat_structured_output,
    may_constrain,
)
from engine.entrypoints.openai.tool_call_ids import continued_request_id, issued_call_id
from engine.entrypoints.openai.tool_call_stream import StreamingToolCallSplitter
from engine.entrypoints.openai.work_pool import TenantWorkPool
from engine.frontend.async_llm import AsyncLLM
from engine.frontend.chat_template import render_chat
from engine.frontend.outputs import CompletionOutput, RequestOutput
from engine.frontend.processor import COUNT_ANY_LENGTH, ProcessedRequest, PromptTooLongError
from engine.sampling_params import CacheBreakpoint, SamplingParams
from engine.tool_calls import (
    TOOL_CALL_MARKERS,
    ParsedToolCall,
    ToolCallFormat,
    ToolParser,
    make_tool_parser,
)

logger = logging.getLogger(__name__)

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


@dataclass(frozen=True)
class PreparedMessage:
    """A Messages request queued with the engine: its output stream, how its output is read
    for tool calls (`parser`, None without tools), its cache breakpoint with the TTL the
    client named for it, and the client's `X-Request-Id`."""

    message_id: str
    request: ProcessedRequest
    stream: AsyncIterator[RequestOutput]
    parser: ToolParser | None
    cache_breakpoint: CacheBreakpoint | None
    cache_ttl: CacheTTL | None
    client_request_id: str | None = None

    @property
    def engine_request_id(self) -> str:
        return self.request.core_requests[0].request_id


@dataclass(frozen=True)
class _ChatToolFields:
    """A Messages request's tools, `tool_choice` and `output_config.format` in the chat shape
    that `structured_outputs.py` reads (the format as `guided_json`)."""

    tools: list[ChatTool]
    tool_choice: str | NamedToolChoice | None
    parallel_tool_calls: bool | None
    guided_json: dict[str, Any] | None = None

    @classmethod
    def of(cls, body: MessagesFields) -> _ChatToolFields:
        choice = body.tool_choice
        chat_choice: str | NamedToolChoice | None = None
        if isinstance(choice, ToolChoiceAuto):
            chat_choice = "auto"
        elif isinstance(choice, ToolChoiceAny):
            chat_choice = "required"
        elif isinstance(choice, ToolChoiceTool):
            chat_choice = NamedToolChoice(function=NamedFunction(name=choice.name))
        elif isinstance(choice, ToolChoiceNone):
            chat_choice = "none"
        disable_parallel = getattr(choice, "disable_parallel_tool_use", False)
        output_config = getattr(body, "output_config", None)
        output_format = None if output_config is None else output_config.format
        return cls(
            tools=[ChatTool(function=FunctionDefinition(
                name=tool.name, description=tool.description, parameters=tool.input_schema,
                strict=tool.strict)) for tool in body.tools or ()],
            tool_choice=chat_choice, parallel_tool_calls=False if disable_parallel else None,
            guided_json=None if output_format is None else output_format.schema_)


class OpenAIServingMessages(OpenAIServing):
    """Validates a Messages request, runs it, and formats Anthropic's `message` (whole or as
    events); counts a request's input tokens."""

    prompt_param = "messages"
    clamps_max_tokens = True  # clients' defaults (litellm's 128,000) exceed small contexts

    def __init__(self, engine: AsyncLLM, settings: ServerSettings, pool: TenantWorkPool,
                 grammar_checker: GrammarChecker, refusal_pacer: RefusalPacer) -> None:
        super().__init__(engine, settings, pool, grammar_checker, refusal_pacer)
        make_tool_parser(settings.tool_call_parser)  # fail at start-up on an unknown name
        self._tool_call_marker_ids = engine.processor.special_token_ids(TOOL_CALL_MARKERS)

    async def prepare(self, body: MessagesRequest, client: ClientContext) -> PreparedMessage:
        """Validates the request, renders its conversation and queues it; APIError on bad
        input, or 429 if the waiting queue or the tenant's cap has no room, a refusal for a
        limit paced (`refusals_paced`). Rendering runs off the event loop."""
        async with self.refusals_paced(client.tenant):
            return await self._prepare(body, client)

    async def _prepare(self, body: MessagesRequest, client: ClientContext) -> PreparedMessage:
        self.check_request(body)
        check_messages_fields(body)
        if body.n != 1:
            raise APIError(400, "a message has one output: n must be 1", param="n")
        if body.stop is not None:
            raise APIError(400, "stop is this API's stop_sequences: send stop_sequences",
                           param="stop")
        fields = _ChatToolFields.of(body)
        structured_output = None
        if may_constrain(fields):
            structured_output = await self.run_for(client, self._structured_output, fields)
        sampled = body if body.stop_sequences is None else body.model_copy(
            update={"stop": body.stop_sequences})
        params = self.sampling_params(sampled, max_tokens=body.max_tokens, logprobs=None,
                                      stream=body.stream, structured_output=structured_output)
        self.check_queue_room(1, client.tenant)
        message_id = new_id("msg").replace("-", "_")
        tool_call_format = _tool_call_format(body, self.settings.tool_call_parser)
        request, cache_breakpoint = await self.run_for(
            client, self._render_and_process, message_id, body, params, client,
            tool_call_format)
        (stream,) = self.submit([request])
        last_control = _last_cache_control(body)
        return PreparedMessage(
            message_id=message_id, request=request, stream=stream,
            parser=None if tool_call_format is None else tool_call_format.make_parser(),
            cache_breakpoint=cache_breakpoint,
            cache_ttl=None if last_control is None else last_control.ttl,
            client_request_id=client.request_id)

    async def count_tokens(self, body: MessagesCountTokensRequest,
                           client: ClientContext) -> dict[str, int]:
        """`{"input_tokens": N}`: the prompt the same Messages request would run. APIError
        on bad input, or a 400 for a prompt over the model's context."""
        self.check_request(body)
        check_messages_fields(body)
        return {"input_tokens": await self.run_for(client, self._count, body)}

    def context_overflow(self, count: str) -> APIError:
        """Anthropic's text for a prompt that leaves no room for output, which its clients
        (and coding agents deciding to compact) recognise."""
        return APIError(400, f"prompt is too long: {count} tokens > {self.max_model_len - 1} "
                             "maximum", param="messages", code="context_length_exceeded")

    def _count(self, body: MessagesCountTokensRequest) -> int:
        """The prompt's tokens, however many: counting a conversation past the context is
        how a client learns how far to trim it."""
        return len(self._prompt_token_ids(template_conversation(body), count_only=True))

    def _structured_output(self, fields: _ChatToolFields) -> Any:
        try:
            return chat_structured_output(fields, self.grammar_checker,
                                          self.settings.tool_call_parser)
        except APIError as error:
            param = error.param or ""
            name = (param.replace(".function.parameters", ".input_schema")
                    .replace("guided_json", "output_config.format.schema"))
            if name != param:
                raise APIError(error.status_code, error.message.replace(param, name),
                               param=name, code=error.code) from error
            raise

    def _prompt_token_ids(self, conversation: Conversation, *,
                          count_only: bool = False) -> list[int]:
        """The conversation's prompt; with `count_only`, however long (no room is kept)."""
        try:
            return self.engine.processor.chat_prompt(
                conversation.messages, tools=conversation.tools,
                max_tokens=COUNT_ANY_LENGTH if count_only else None,
                **conversation.render_options())
        except PromptTooLongError:
            raise
        except ValueError as error:
            raise APIError(400, str(error), param="messages") from error

    def _render_and_process(
        self, message_id: str, body: MessagesRequest, params: SamplingParams,
        client: ClientContext, tool_call_format: ToolCallFormat | None,
    ) -> tuple[ProcessedRequest, CacheBreakpoint | None]:
        conversation = template_conversation(body)
        try:
            token_ids = self._prompt_token_ids(conversation)
        except PromptTooLongError as error:
            raise self.prompt_too_long(error, params) from error
        cache_breakpoint = prompt_cache_breakpoint(self.engine.processor.tokenizer,
                                                   conversation, token_ids)
        if cache_breakpoint is not None:
            params = msgspec.structs.replace(params, cache_breakpoint=cache_breakpoint)
        kept = self._tool_call_marker_ids if tool_call_format is not None else frozenset()
        request = self.process(message_id, token_ids, params, body, client,
                               kept_special_token_ids=kept,
                               continues_request_id=continued_request_id(conversation.messages),
                               tool_call_format=tool_call_format)
        return request, cache_breakpoint

    async def create(self, body: MessagesRequest, prepared: PreparedMessage
                     ) -> dict[str, Any]:
        """The whole (non-streaming) message."""
        final: RequestOutput | None = None
        async for _, output in merge_streams([prepared.stream]):
            final = output
        assert final is not None and final.finished
        (completion,) = final.outputs
        text, calls = _split(prepared.parser, completion.text)
        content = [*([{"type": "text", "text": text}] if text else []),
                   *(_tool_use_block(call, issued_call_id(prepared.engine_request_id, index))
                     for index, call in enumerate(calls))]
        stop_reason, stop_sequence = _stop_reason(completion, calls)
        return {
            "id": prepared.message_id, "type": "message", "role": "assistant",
            "model": self.settings.served_model_name,
            "content": content or [{"type": "text", "text": ""}],
            "stop_reason": stop_reason, "stop_sequence": stop_sequence,
            "usage": self._usage(prepared, final.num_cached_tokens, len(completion.token_ids)),
        }

    async def stream(self, body: MessagesRequest, prepared: PreparedMessage
                     ) -> AsyncIterator[bytes]:
        """The message as Anthropic's SSE events (see the module's docstring)."""
        splitter = None if prepared.parser is None else StreamingToolCallSplitter(
            prepared.parser)
        started = text_open = False
        num_output_tokens = num_cached_tokens = 0
        calls: tuple[ParsedToolCall, ...] = ()
        last: CompletionOutput | None = None
        try:
            async for _, output in merge_streams([prepared.stream]):
                num_cached_tokens = output.num_cached_tokens
                if not started:
                    started = True
                    yield _event("message_start", message=self._message_opening(
                        prepared, num_cached_tokens))
                    yield _event("ping")
                for completion in output.outputs:
                    num_output_tokens += len(completion.token_ids)
                    delta = completion.text
                    if splitter is not None:
                        delta = splitter.push(delta)
                        if completion.finished:
                            rest, calls = splitter.finish()
                            delta += rest
                    if delta:
                        if not text_open:
                            text_open = True
                            yield _event("content_block_start", index=0,
                                         content_block={"type": "text", "text": ""})
                        yield _event("content_block_delta", index=0,
                                     delta={"type": "text_delta", "text": delta})
                    if completion.finished:
                        last = completion
            assert last is not None
            if text_open or not calls:
                if not text_open:  # nothing at all: one empty text block, as `create` has
                    yield _event("content_block_start", index=0,
                                 content_block={"type": "text", "text": ""})
                yield _event("content_block_stop", index=0)
            first_call_index = 1 if text_open or not calls else 0
            for offset, call in enumerate(calls):
                index = first_call_index + offset
                block = _tool_use_block(call, issued_call_id(prepared.engine_request_id,
                                                             offset))
                yield _event("content_block_start", index=index,
                             content_block={**block, "input": {}})
                yield _event("content_block_delta", index=index, delta={
                    "type": "input_json_delta", "partial_json": call.arguments})
                yield _event("content_block_stop", index=index)
            stop_reason, stop_sequence = _stop_reason(last, calls)
            yield _event("message_delta",
                         delta={"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                         usage=self._usage(prepared, num_cached_tokens, num_output_tokens))
            yield _event("message_stop")
        except Exception as error:
            yield _event("error", **_stream_error(error, prepared.client_request_id))

    def _message_opening(self, prepared: PreparedMessage, num_cached_tokens: int
                         ) -> dict[str, Any]:
        return {"id": prepared.message_id, "type": "message", "role": "assistant",
                "model": self.settings.served_model_name, "content": [],
                "stop_reason": None, "stop_sequence": None,
                "usage": self._usage(prepared, num_cached_tokens, 0)}

    @staticmethod
    def _usage(prepared: PreparedMessage, num_cached_tokens: int,
               num_output_tokens: int) -> dict[str, Any]:
        """Anthropic's usage: the prompt split into tokens read from the cache, tokens up to
        the breakpoint that were not (written under it), and the rest."""
        num_prompt_tokens = len(prepared.request.prompt_token_ids)
        cache_read = min(num_cached_tokens, num_prompt_tokens)
        breakpoint_ = prepared.cache_breakpoint
        cache_creation = 0 if breakpoint_ is None else max(
            0, breakpoint_.num_prompt_tokens - cache_read)
        return {
            "input_tokens": num_prompt_tokens - cache_read - cache_creation,
            "cache_creation_input_tokens": cache_creation,
            "cache_read_input_tokens": cache_read,
            "cache_creation": {
                "ephemeral_5m_input_tokens": cache_creation if prepared.cache_ttl == "5m" else 0,
                "ephemeral_1h_input_tokens": cache_creation if prepared.cache_ttl == "1h" else 0,
            },
            "output_tokens": num_output_tokens,
        }


def check_messages_fields(body: MessagesFields) -> None:
    """APIError(400) for what the models cannot say, as Anthropic refuses it: tools named
    twice, a `tool_choice` without tools or naming none of them, too many cache
    breakpoints, a first message not the user's, a `tool_use` or `tool_result` in the wrong
    role's message, a `tool_use` not answered by a `tool_result` in the next message, a last
    message that calls a tool."""
    names = [tool.name for tool in body.tools or ()]
    check_unique_names(names, "tools")
    choice = body.tool_choice
    if isinstance(choice, ToolChoiceAny | ToolChoiceTool) and not names:
        raise APIError(400, f"tool_choice {choice.type!r} needs tools", param="tool_choice")
    if isinstance(choice, ToolChoiceTool) and choice.name not in names:
        raise APIError(400, f"tool_choice names {choice.name!r}, which is not among the tools",
                       param="tool_choice.name")
    num_breakpoints = len(_cache_controls(body))
    if num_breakpoints > MAX_CACHE_BREAKPOINTS:
        raise APIError(400, f"{num_breakpoints} blocks have cache_control, over the limit of "
                            f"{MAX_CACHE_BREAKPOINTS}", param="cache_control")
    if body.messages[0].role != "user":
        raise APIError(400, "messages.0: the first message must be the user's",
                       param="messages.0.role")
    for index, message in enumerate(body.messages):
        wrong, name = ((ToolResultBlock, "tool_result") if message.role == "assistant"
                       else (ToolUseBlock, "tool_use"))
        if any(isinstance(block, wrong) for block in message.blocks):
            raise APIError(400, f"messages.{index}: a {message.role} message cannot hold "
                                f"{name} blocks", param=f"messages.{index}.content")
        if index + 1 < len(body.messages):
            _check_answered(index, message, body.messages[index + 1])
    last = body.messages[-1]
    if last.role == "assistant" and any(isinstance(block, ToolUseBlock)
                                        for block in last.blocks):
        raise APIError(400, "the last message may be an assistant's only to be continued "
                            "(text); a tool_use must be answered by a tool_result",
                       param=f"messages.{len(body.messages) - 1}.content")


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


def _last_cache_control(body: MessagesFields) -> CacheControl | None:
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


def _tool_call_format(body: MessagesRequest, parser: str) -> ToolCallFormat | None:
    """How this request's output is read for tool calls, or None when tools are off."""
    if not body.tools or isinstance(body.tool_choice, ToolChoiceNone):
        return None
    disable_parallel = getattr(body.tool_choice, "disable_parallel_tool_use", False)
    return ToolCallFormat(parser=parser, tool_names=tuple(tool.name for tool in body.tools),
                          parallel=not disable_parallel)


def _split(parser: ToolParser | None, text: str) -> tuple[str, tuple[ParsedToolCall, ...]]:
    """The output's text and its tool calls."""
    if parser is None:
        return text, ()
    parsed = parser.parse(text)
    return parsed.content or "", parsed.tool_calls


def _tool_use_block(call: ParsedToolCall, call_id: str) -> dict[str, Any]:
    return {"type": "tool_use", "id": call_id, "name": call.name,
            "input": json.loads(call.arguments)}


def _stop_reason(completion: CompletionOutput, calls: tuple[ParsedToolCall, ...]
                 ) -> tuple[str, str | None]:
    """Anthropic's stop reason and the stop sequence that ended the output, if one did."""
    if completion.finish_reason == "length":
        return "max_tokens", None
    if calls:
        return "tool_use", None
    if isinstance(completion.stop_reason, str):
        return "stop_sequence", completion.stop_reason
    return "end_turn", None


def _event(kind: str, **fields: Any) -> bytes:
    """One SSE event of a stream: its type as the event's name and in its data."""
    return b"event: " + kind.encode() + b"\n" + sse({"type": kind, **fields})


def _stream_error(error: Exception, client_request_id: str | None) -> dict[str, Any]:
    """The `error` event's fields for a failure after the stream started."""
    if isinstance(error, EngineDeadError):
        status, message = 503, f"the engine is not running: {str(error).partition(chr(10))[0]}"
    elif isinstance(error, ServerShuttingDownError):
        status, message = 503, str(error) or "the server is shutting down"
    elif isinstance(error, ValueError):  # the core rejected the request
        status, message = 400, str(error)
    else:
        logger.exception("a message stream failed (request id %s)", client_request_id)
        status, message = 500, f"internal server error: {type(error).__name__}"
    body = anthropic_error_body(status, message, client_request_id)
    return {"error": body["error"], **({"request_id": client_request_id}
                                       if client_request_id is not None else {})}

