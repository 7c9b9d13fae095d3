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
`message_delta` with the stop reason and the usage; `message_stop`. An output of nothing, or
of whitespace, has no text block (a blank one, sent back, Anthropic refuses): a text block
opens with the text's first other character. A call the output was cut off in (by
`max_tokens` or a stop sequence) is its last `tool_use` block, its input as far as written, as
Anthropic returns one. A failure after the stream started is an `error` event.
"""

from __future__ import annotations

import functools
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import msgspec
import pydantic_core

from engine.entrypoints.openai.anthropic_errors import anthropic_error_body
from engine.entrypoints.openai.errors import APIError
from engine.entrypoints.openai.generation import (
    ChoiceOutput,
    ForcedTool,
    GenerationPlan,
    OfferedTool,
    ToolOffer,
)
from engine.entrypoints.openai.messages_prompt import (
    check_messages_fields,
    count_prompt,
    last_cache_control,
    prompt_cache_breakpoint,
    prompt_token_ids,
    template_conversation,
)
from engine.entrypoints.openai.protocol_messages import (
    CacheTTL,
    MessagesCountTokensRequest,
    MessagesRequest,
    ToolChoiceAny,
    ToolChoiceNone,
    ToolChoiceTool,
)
from engine.entrypoints.openai.serving import (
    ClientContext,
    OpenAIServing,
    Prepared,
    choice_deltas,
    new_id,
    sse,
    stream_failure,
)
from engine.entrypoints.openai.structured_outputs import json_schema_constraint
from engine.entrypoints.openai.tool_call_ids import continued_request_id, issued_call_id
from engine.frontend.processor import ProcessedRequest
from engine.sampling_params import CacheBreakpoint, SamplingParams
from engine.tool_calls import JSON_ERRORS, ToolCallFormat


@dataclass(frozen=True, kw_only=True)
class PreparedMessage(Prepared):
    """A Messages request queued with the engine: its cache breakpoint with the TTL the
    client named for it."""

    message_id: str
    cache_breakpoint: CacheBreakpoint | None
    cache_ttl: CacheTTL | None

    @property
    def engine_request_id(self) -> str:
        return self.request.core_requests[0].request_id


def messages_offer(body: MessagesRequest) -> ToolOffer:
    """The tools a Messages request offers, as this API names its fields (`any` is chat's
    "required", `disable_parallel_tool_use` its `parallel_tool_calls: false`)."""
    choice = body.tool_choice
    return ToolOffer(
        tools=tuple(OfferedTool(tool.name, tool.input_schema, bool(tool.strict),
                                f"tools[{index}].input_schema")
                    for index, tool in enumerate(body.tools or ())),
        choice="required" if isinstance(choice, ToolChoiceAny) else
        ForcedTool(choice.name) if isinstance(choice, ToolChoiceTool) else
        "none" if isinstance(choice, ToolChoiceNone) else "auto",
        parallel=not getattr(choice, "disable_parallel_tool_use", False),
        choice_name=None if choice is None else repr(choice.model_dump(exclude_defaults=True)))


class OpenAIServingMessages(OpenAIServing[MessagesRequest, PreparedMessage]):
    """Validates a Messages request, runs it, and formats Anthropic's `message` (whole or as
    events); counts a request's input tokens."""

    prompt_param = "messages"
    clamps_max_tokens = True  # clients' defaults (litellm's 128,000) exceed small contexts

    async def _prepare(self, body: MessagesRequest, client: ClientContext) -> PreparedMessage:
        check_messages_fields(body)
        offer = messages_offer(body)
        output_format = None if body.output_config is None else body.output_config.format
        params = await self.params_for(body, GenerationPlan(
            num_completions=1, max_tokens=body.max_tokens, offer=offer,
            constraint=None if output_format is None else functools.partial(
                json_schema_constraint, "output_config.format.schema", output_format.schema_,
                strict=False)), client)
        message_id = new_id("msg", "_")
        call_format = offer.call_format(self.settings.tool_call_parser)
        request, cache_breakpoint = await self.run_for(
            client, self._render_and_process, message_id, body, params, client, call_format)
        last_control = last_cache_control(body)
        return PreparedMessage(
            message_id=message_id, requests=[request], streams=self.submit([request]),
            tenant=client.tenant, client_request_id=client.request_id,
            parser=None if call_format is None else call_format.make_parser(),
            cache_breakpoint=cache_breakpoint,
            cache_ttl=None if last_control is None else last_control.ttl)

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

    def _render_and_process(
        self, message_id: str, body: MessagesRequest, params: SamplingParams,
        client: ClientContext, tool_call_format: ToolCallFormat | None,
    ) -> tuple[ProcessedRequest, CacheBreakpoint | None]:
        conversation = template_conversation(body)
        token_ids = self.prompt_token_ids(params, prompt_token_ids, self.engine.processor,
                                          conversation)
        cache_breakpoint = prompt_cache_breakpoint(self.engine.processor.tokenizer,
                                                   conversation, token_ids)
        if cache_breakpoint is not None:
            params = msgspec.structs.replace(params, cache_breakpoint=cache_breakpoint)
        request = self.process(message_id, token_ids, params, body, client,
                               continues_request_id=continued_request_id(conversation.messages),
                               tool_call_format=tool_call_format)
        return request, cache_breakpoint

    async def create(self, body: MessagesRequest, prepared: PreparedMessage
                     ) -> dict[str, Any]:
        output = ChoiceOutput(parser=prepared.parser)
        num_cached_tokens = 0
        async for delta in choice_deltas(prepared.streams, [output]):
            num_cached_tokens = delta.num_cached_tokens
        stop_reason, stop_sequence = _stop_reason(output)
        return {
            "id": prepared.message_id, "type": "message", "role": "assistant",
            "model": self.settings.served_model_name,
            "content": [*([{"type": "text", "text": output.text}] if output.text.strip()
                          else []),
                        *self._tool_use_blocks(prepared, output)],
            "stop_reason": stop_reason, "stop_sequence": stop_sequence,
            "usage": self._usage(prepared, num_cached_tokens, output.num_tokens),
        }

    async def stream(self, body: MessagesRequest, prepared: PreparedMessage
                     ) -> AsyncIterator[bytes]:
        """The message as Anthropic's SSE events (see the module's docstring)."""
        output = ChoiceOutput(parser=prepared.parser)
        started = text_open = False
        num_cached_tokens = 0
        try:
            async for delta in choice_deltas(prepared.streams, [output]):
                num_cached_tokens = delta.num_cached_tokens
                if not started:
                    started = True
                    yield _event("message_start", message=self._message_opening(
                        prepared, num_cached_tokens))
                    yield _event("ping")
                if not text_open and output.text.strip():
                    text_open = True  # with the blank text before it, held till now
                    yield _event("content_block_start", index=0,
                                 content_block={"type": "text", "text": ""})
                    yield _event("content_block_delta", index=0,
                                 delta={"type": "text_delta", "text": output.text})
                elif text_open and delta.text:
                    yield _event("content_block_delta", index=0,
                                 delta={"type": "text_delta", "text": delta.text})
            for chunk in self._closing_events(prepared, output, num_cached_tokens,
                                              text_open=text_open):
                yield chunk
        except Exception as error:
            yield _event("error", **_stream_error(error, prepared.client_request_id))

    def _closing_events(self, prepared: PreparedMessage, output: ChoiceOutput,
                        num_cached_tokens: int, *, text_open: bool) -> list[bytes]:
        """The events that end the text block (if one was open), give each `tool_use` block,
        then the stop reason and usage."""
        events = [_event("content_block_stop", index=0)] if text_open else []
        calls = self._tool_use_blocks(prepared, output)
        first_index = 1 if text_open else 0
        for index, block, call in zip(range(first_index, first_index + len(calls)), calls,
                                      output.calls_shown, strict=True):
            events += [
                _event("content_block_start", index=index, content_block={**block, "input": {}}),
                _event("content_block_delta", index=index, delta={
                    "type": "input_json_delta", "partial_json": call.arguments}),
                _event("content_block_stop", index=index)]
        stop_reason, stop_sequence = _stop_reason(output)
        return [*events, _event(
            "message_delta", delta={"stop_reason": stop_reason, "stop_sequence": stop_sequence},
            usage=self._usage(prepared, num_cached_tokens, output.num_tokens)),
            _event("message_stop")]

    @staticmethod
    def _tool_use_blocks(prepared: PreparedMessage, output: ChoiceOutput
                         ) -> list[dict[str, Any]]:
        return [{"type": "tool_use", "id": issued_call_id(prepared.engine_request_id, index),
                 "name": call.name, "input": json.loads(call.arguments)
                 if call is not output.cut_call else _cut_input(call.arguments)}
                for index, call in enumerate(output.calls_shown)]

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
            "service_tier": "standard",
        }


def _stop_reason(output: ChoiceOutput) -> tuple[str, str | None]:
    """Anthropic's stop reason and the stop sequence that ended the output, if one did."""
    assert output.last is not None
    if output.finish_reason == "length":
        return "max_tokens", None
    if output.ends_in_calls:
        return "tool_use", None
    if isinstance(output.last.stop_reason, str):
        return "stop_sequence", output.last.stop_reason
    return "end_turn", None


def _cut_input(arguments: str) -> dict[str, Any]:
    """The input of a call cut off in its arguments, as far as they were written (pydantic's
    partial JSON parse, which leaves out an unfinished string as the SDK's stream reader
    does); {} where they give no object."""
    try:
        value = pydantic_core.from_json(arguments, allow_partial=True)
        json.dumps(value, allow_nan=False)  # no non-finite number in the response
    except (*JSON_ERRORS, TypeError):  # TypeError: a lone surrogate
        return {}
    return value if isinstance(value, dict) else {}


def _event(kind: str, **fields: Any) -> bytes:
    """One SSE event of a stream: its type as the event's name and in its data."""
    return b"event: " + kind.encode() + b"\n" + sse({"type": kind, **fields})


def _stream_error(error: Exception, client_request_id: str | None) -> dict[str, Any]:
    """The `error` event's fields for a failure after the stream started."""
    failure = stream_failure(error, client_request_id)
    body = anthropic_error_body(failure.status_code, failure.message, client_request_id)
    return {"error": body["error"], **({"request_id": client_request_id}
                                       if client_request_id is not None else {})}
