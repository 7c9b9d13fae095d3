"""POST /v1/chat/completions: a conversation through the chat template, streamed or not,
with tool calls in the output parsed into `tool_calls` when the request offers `tools`.

`tool_choice` "required", a named function, `parallel_tool_calls: false` and response
formats are enforced by constrained decoding (`structured_outputs.py`). When tools are offered,
the tool-call markers stay in the text the parser reads even where they are special tokens (the
Hermes `<tool_call>` tags are in many vocabularies); other special tokens are left out as
`skip_special_tokens` says. Streamed content adds up to the content of the same completion
unstreamed. A stream's first chunk for a choice, which carries its role, is sent once the choice
has its first token (clients time the first token by it).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from engine.entrypoints.openai.chat_prompt import check_chat_fields, render_chat_prompt
from engine.entrypoints.openai.errors import APIError
from engine.entrypoints.openai.protocol import ChatCompletionRequest
from engine.entrypoints.openai.refusal_pacing import RefusalPacer
from engine.entrypoints.openai.serving import (
    SSE_DONE,
    ClientContext,
    OpenAIServing,
    ServerSettings,
    merge_streams,
    new_id,
    sse,
    sse_error,
)
from engine.entrypoints.openai.structured_outputs import (
    GrammarChecker,
    chat_structured_output,
    may_constrain,
)
from engine.entrypoints.openai.tool_call_ids import issued_call_id
from engine.entrypoints.openai.tool_call_stream import StreamingToolCallSplitter
from engine.entrypoints.openai.work_pool import TenantWorkPool
from engine.frontend.async_llm import AsyncLLM
from engine.frontend.processor import ProcessedRequest, PromptTooLongError, core_request_id
from engine.frontend.request_outputs import CompletionOutput, RequestOutput
from engine.outputs import TokenLogprobs
from engine.sampling_params import SamplingParams
from engine.tool_calls import (
    TOOL_CALL_MARKERS,
    ParsedToolCall,
    ToolCallFormat,
    ToolParser,
    make_tool_parser,
)


@dataclass(frozen=True)
class PreparedChat:
    """A chat request queued with the engine, its output stream, and the client's
    `X-Request-Id` (for log lines)."""

    request: ProcessedRequest
    stream: AsyncIterator[RequestOutput]
    client_request_id: str | None = None


@dataclass
class _ChoiceStream:
    """Streaming state of one choice."""

    splitter: StreamingToolCallSplitter | None
    role_sent: bool = False
    num_tokens: int = 0
    tool_calls: tuple[ParsedToolCall, ...] = ()


class OpenAIServingChat(OpenAIServing):
    """Validates a chat request, runs it, and formats OpenAI's `chat.completion`."""

    prompt_param = "messages"

    def __init__(self, engine: AsyncLLM, settings: ServerSettings, pool: TenantWorkPool,
                 grammar_checker: GrammarChecker, refusal_pacer: RefusalPacer) -> None:
        super().__init__(engine, settings, pool, grammar_checker, refusal_pacer)
        make_tool_parser(settings.tool_call_parser)  # fail at start-up on an unknown name
        self._tool_call_marker_ids = engine.processor.special_token_ids(TOOL_CALL_MARKERS)

    def _tool_call_format(self, body: ChatCompletionRequest) -> ToolCallFormat | None:
        """How this request's output is read for tool calls, or None when tools are off."""
        if not body.tools or body.tool_choice == "none":
            return None
        return ToolCallFormat(parser=self.settings.tool_call_parser,
                              tool_names=tuple(tool.function.name for tool in body.tools),
                              parallel=body.parallel_tool_calls is not False)

    def _parser(self, body: ChatCompletionRequest) -> ToolParser | None:
        """The tool-call parser for this request, or None when tools are off."""
        tool_call_format = self._tool_call_format(body)
        return None if tool_call_format is None else tool_call_format.make_parser()

    async def prepare(
        self, body: ChatCompletionRequest, client: ClientContext
    ) -> PreparedChat:
        """Validates the request and queues it; APIError on bad input, or 429 if the waiting
        queue or the tenant's cap has no room for its completions, a refusal for a limit
        paced (`refusals_paced`). Rendering and validating run off the event loop."""
        async with self.refusals_paced(client.tenant):
            return await self._prepare(body, client)

    async def _prepare(self, body: ChatCompletionRequest, client: ClientContext) -> PreparedChat:
        self.check_request(body)
        check_chat_fields(body)
        structured_output = None
        if may_constrain(body):
            structured_output = await self.run_for(
                client, chat_structured_output, body, self.grammar_checker,
                self.settings.tool_call_parser)
        params = self.sampling_params(
            body,
            max_tokens=body.max_completion_tokens if body.max_completion_tokens is not None
            else body.max_tokens,
            logprobs=(body.top_logprobs or 0) if body.logprobs else None,
            stream=body.stream,
            structured_output=structured_output,
        )
        self.check_queue_room(body.n, client.tenant)
        request = await self.run_for(client, self._render_and_process, body, params, client)
        (stream,) = self.submit([request])
        return PreparedChat(request, stream, client.request_id)

    def _render_and_process(self, body: ChatCompletionRequest, params: SamplingParams,
                            client: ClientContext) -> ProcessedRequest:
        tool_call_format = self._tool_call_format(body)
        kept = self._tool_call_marker_ids if tool_call_format is not None else frozenset()
        prompt = client.chat_prompt or render_chat_prompt(self.engine.processor, body)
        try:
            token_ids = prompt.checked_token_ids(self.max_model_len)
        except PromptTooLongError as error:
            raise self.prompt_too_long(error, params) from error
        except ValueError as error:
            raise APIError(400, str(error), param="messages") from error
        return self.process(new_id("chatcmpl"), token_ids, params, body, client,
                            kept_special_token_ids=kept,
                            continues_request_id=prompt.continues_request_id,
                            tool_call_format=tool_call_format)

    async def create(self, body: ChatCompletionRequest,
                     prepared: PreparedChat) -> dict[str, Any]:
        """The whole (non-streaming) response."""
        request = prepared.request
        final = None
        async for _, output in merge_streams([prepared.stream]):
            final = output
        assert final is not None and final.finished
        parser = self._parser(body)
        choices = [self._message_choice(body, completion, parser,
                                        core_request_id(request.request_id, completion.index,
                                                        body.n))
                   for completion in final.outputs]
        response: dict[str, Any] = {
            "id": request.request_id, "object": "chat.completion", "created": int(time.time()),
            "model": self.settings.served_model_name, "choices": choices,
            "usage": self.usage(len(request.prompt_token_ids),
                                sum(len(c.token_ids) for c in final.outputs),
                                final.num_cached_tokens),
        }
        if body.return_token_ids:
            response["prompt_token_ids"] = request.prompt_token_ids
        return response

    def _message_choice(
        self, body: ChatCompletionRequest, completion: CompletionOutput,
        parser: ToolParser | None, engine_request_id: str,
    ) -> dict[str, Any]:
        content: str | None = completion.text
        tool_calls: tuple[ParsedToolCall, ...] = ()
        if parser is not None:
            parsed = parser.parse(completion.text)
            content, tool_calls = parsed.content, parsed.tool_calls
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if tool_calls:
            message["tool_calls"] = [_tool_call(call, issued_call_id(engine_request_id, index))
                                     for index, call in enumerate(tool_calls)]
        choice: dict[str, Any] = {
            "index": completion.index, "message": message,
            "logprobs": self._logprobs(completion.logprobs),
            "finish_reason": _finish_reason(completion.finish_reason, tool_calls),
            "stop_reason": completion.stop_reason,
        }
        if body.return_token_ids:
            choice["token_ids"] = completion.token_ids
        return choice

    async def stream(
        self, body: ChatCompletionRequest, prepared: PreparedChat
    ) -> AsyncIterator[bytes]:
        """SSE chunks: per choice, a first chunk with the role once the choice has a token,
        content deltas, tool calls and the finish reason at its end; then usage (if asked) and
        `[DONE]`. With `return_token_ids`, the first chunk carries the prompt's token ids."""
        request = prepared.request
        header = {"id": request.request_id, "object": "chat.completion.chunk",
                  "created": int(time.time()), "model": self.settings.served_model_name}
        parser = self._parser(body)
        choices = [_ChoiceStream(None if parser is None else StreamingToolCallSplitter(parser))
                   for _ in range(body.n)]
        num_cached_tokens = 0
        prompt_token_ids_sent = not body.return_token_ids
        try:
            async for _, output in merge_streams([prepared.stream]):
                num_cached_tokens = output.num_cached_tokens
                for completion in output.outputs:
                    choice = self._delta_choice(
                        body, completion, choices[completion.index],
                        core_request_id(request.request_id, completion.index, body.n))
                    if choice is None:
                        continue
                    chunk = {**header, "choices": [choice]}
                    if not prompt_token_ids_sent:
                        chunk["prompt_token_ids"] = request.prompt_token_ids
                        prompt_token_ids_sent = True
                    yield sse(chunk)
            if body.stream_options is not None and body.stream_options.include_usage:
                usage = self.usage(len(request.prompt_token_ids),
                                   sum(c.num_tokens for c in choices), num_cached_tokens)
                yield sse({**header, "choices": [], "usage": usage})
        except Exception as error:
            yield sse_error(error, prepared.client_request_id)
        yield SSE_DONE

    def _delta_choice(
        self, body: ChatCompletionRequest, completion: CompletionOutput, state: _ChoiceStream,
        engine_request_id: str,
    ) -> dict[str, Any] | None:
        state.num_tokens += len(completion.token_ids)
        text = completion.text
        delta: dict[str, Any] = {}
        if not state.role_sent:  # the choice's first output: it has a token, or it ended
            delta = {"role": "assistant", "content": ""}
            state.role_sent = True
        if state.splitter is not None:
            text = state.splitter.push(text)
            if completion.finished:
                rest, state.tool_calls = state.splitter.finish()
                text += rest
        if text:
            delta["content"] = text
        if state.tool_calls:
            delta["tool_calls"] = [
                {"index": i, **_tool_call(call, issued_call_id(engine_request_id, i))}
                for i, call in enumerate(state.tool_calls)]
        carries_tokens = completion.token_ids and (body.return_token_ids or completion.logprobs)
        if not delta and not completion.finished and not carries_tokens:
            return None  # text held back (a partial character, stop string or tool call)
        choice: dict[str, Any] = {
            "index": completion.index, "delta": delta,
            "logprobs": self._logprobs(completion.logprobs),
            "finish_reason": _finish_reason(completion.finish_reason, state.tool_calls),
        }
        if completion.finished:
            choice["stop_reason"] = completion.stop_reason
        if body.return_token_ids:
            choice["token_ids"] = completion.token_ids
        return choice

    def _logprobs(self, entries: list[TokenLogprobs] | None) -> dict[str, Any] | None:
        return None if entries is None else {"content": self.token_logprobs(entries)}


def _finish_reason(reason: str | None, tool_calls: tuple[ParsedToolCall, ...]) -> str | None:
    return "tool_calls" if tool_calls and reason == "stop" else reason


def _tool_call(call: ParsedToolCall, call_id: str) -> dict[str, Any]:
    return {"id": call_id, "type": "function",
            "function": {"name": call.name, "arguments": call.arguments}}
