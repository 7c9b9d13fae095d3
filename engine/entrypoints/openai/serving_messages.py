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
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import msgspec

from engine.core.client import EngineDeadError
from engine.entrypoints.openai.anthropic_errors import anthropic_error_body
from engine.entrypoints.openai.drain import ServerShuttingDownError
from engine.entrypoints.openai.errors import APIError
from engine.entrypoints.openai.messages_prompt import (
    check_messages_fields,
    count_prompt,
    last_cache_control,
    prompt_cache_breakpoint,
    prompt_token_ids,
    template_conversation,
)
from engine.entrypoints.openai.protocol import (
    ChatTool,
    FunctionDefinition,
    NamedFunction,
    NamedToolChoice,
)
from engine.entrypoints.openai.protocol_messages import (
    CacheTTL,
    MessagesCountTokensRequest,
    MessagesFields,
    MessagesRequest,
    ToolChoiceAny,
    ToolChoiceAuto,
    ToolChoiceNone,
    ToolChoiceTool,
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
from engine.frontend.processor import ProcessedRequest, PromptTooLongError
from engine.frontend.request_outputs import CompletionOutput, RequestOutput
from engine.sampling_params import CacheBreakpoint, SamplingParams
from engine.tool_calls import (
    TOOL_CALL_MARKERS,
    ParsedToolCall,
    ToolCallFormat,
    ToolParser,
    make_tool_parser,
)

logger = logging.getLogger(__name__)

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
        last_control = last_cache_control(body)
        return PreparedMessage(
            message_id=message_id, request=request, stream=stream,
            parser=None if tool_call_format is None else tool_call_format.make_parser(),
            cache_breakpoint=cache_breakpoint,
            cache_ttl=None if last_control is None else last_control.ttl,
            client_request_id=client.request_id)

    async def count_tokens(self, body: MessagesCountTokensRequest,
                           client: ClientContext) -> dict[str, int]:
        """`{"input_tokens": N}`: the prompt the same Messages request would run, however
        long (counted in the child that parsed a large or tool-heavy body: `client.
        chat_prompt`). APIError on bad input."""
        self.check_request(body)
        prompt = client.chat_prompt
        if prompt is None:
            check_messages_fields(body)
            prompt = await self.run_for(client, count_prompt, self.engine.processor, body)
        if prompt.token_ids is None:
            raise APIError(400, prompt.error or "the prompt cannot be rendered",
                           param="messages")
        return {"input_tokens": len(prompt.token_ids)}

    def context_overflow(self, count: str) -> APIError:
        """Anthropic's text for a prompt that leaves no room for output, which its clients
        (and coding agents deciding to compact) recognise."""
        return APIError(400, f"prompt is too long: {count} tokens > {self.max_model_len - 1} "
                             "maximum", param="messages", code="context_length_exceeded")

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

    def _render_and_process(
        self, message_id: str, body: MessagesRequest, params: SamplingParams,
        client: ClientContext, tool_call_format: ToolCallFormat | None,
    ) -> tuple[ProcessedRequest, CacheBreakpoint | None]:
        conversation = template_conversation(body)
        try:
            token_ids = prompt_token_ids(self.engine.processor, conversation)
        except PromptTooLongError as error:
            raise self.prompt_too_long(error, params) from error
        except ValueError as error:
            raise APIError(400, str(error), param="messages") from error
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

