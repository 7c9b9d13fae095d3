"""POST /v1/chat/completions: a conversation through the chat template, streamed or not,
with tool calls in the output parsed into `tool_calls` when the request offers `tools`.

`tool_choice` "required", a named function, `parallel_tool_calls: false` and response
formats are enforced by constrained decoding (`structured_outputs.py`). When tools are offered,
the tool-call markers stay in the text the parser reads even where they are special tokens (the
Hermes `<tool_call>` tags are in many vocabularies); other special tokens are left out as
`skip_special_tokens` says. A call the output was cut off in (by `max_tokens` or a stop
string) is its last tool call, its arguments as far as written; the finish reason says why it
ended. Streamed content adds up to the content of the same completion unstreamed. A stream's
first chunk for a choice, which carries its role, is sent once the choice has its first token
(clients time the first token by it).
"""

from __future__ import annotations

import functools
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from engine.entrypoints.openai.chat_prompt import check_chat_fields, render_chat_prompt
from engine.entrypoints.openai.generation import (
    ChoiceOutput,
    ForcedTool,
    GenerationPlan,
    OfferedTool,
    ToolOffer,
)
from engine.entrypoints.openai.protocol import ChatCompletionRequest
from engine.entrypoints.openai.serving import (
    SSE_DONE,
    ClientContext,
    OpenAIServing,
    OutputDelta,
    Prepared,
    choice_deltas,
    new_id,
    sse,
    sse_error,
)
from engine.entrypoints.openai.structured_outputs import may_constrain, output_constraint
from engine.entrypoints.openai.tool_call_ids import issued_call_id
from engine.frontend.processor import ProcessedRequest, core_request_id
from engine.outputs import TokenLogprobs
from engine.sampling_params import SamplingParams
from engine.tool_calls import ParsedToolCall, ToolCallFormat


@dataclass(kw_only=True)
class _ChoiceStream(ChoiceOutput):
    """Streaming state of one choice: its output, and whether its role was sent."""

    role_sent: bool = False


def chat_offer(body: ChatCompletionRequest) -> ToolOffer:
    """The tools a chat request offers, as chat names its fields."""
    choice = body.tool_choice
    return ToolOffer(
        tools=tuple(OfferedTool(tool.function.name, tool.function.parameters,
                                bool(tool.function.strict),
                                f"tools[{index}].function.parameters")
                    for index, tool in enumerate(body.tools or ())),
        choice=ForcedTool(choice.function.name) if choice is not None and not isinstance(
            choice, str) else choice or "auto",
        parallel=body.parallel_tool_calls is not False)


class OpenAIServingChat(OpenAIServing[ChatCompletionRequest, Prepared]):
    """Validates a chat request, runs it, and formats OpenAI's `chat.completion`."""

    prompt_param = "messages"

    async def _prepare(self, body: ChatCompletionRequest, client: ClientContext) -> Prepared:
        check_chat_fields(body)
        offer = chat_offer(body)
        params = await self.params_for(body, GenerationPlan(
            num_completions=body.n,
            max_tokens=body.max_completion_tokens if body.max_completion_tokens is not None
            else body.max_tokens,
            logprobs=(body.top_logprobs or 0) if body.logprobs else None,
            offer=offer,
            constraint=functools.partial(output_constraint, body) if may_constrain(body)
            else None), client)
        call_format = offer.call_format(self.settings.tool_call_parser)
        request = await self.run_for(client, self._render_and_process, body, params, client,
                                     call_format)
        return Prepared(requests=[request], streams=self.submit([request]),
                        tenant=client.tenant, client_request_id=client.request_id,
                        parser=None if call_format is None else call_format.make_parser())

    def _render_and_process(self, body: ChatCompletionRequest, params: SamplingParams,
                            client: ClientContext, call_format: ToolCallFormat | None
                            ) -> ProcessedRequest:
        prompt = client.chat_prompt or render_chat_prompt(self.engine.processor, body)
        token_ids = self.prompt_token_ids(params, prompt.checked_token_ids, self.max_model_len)
        return self.process(new_id("chatcmpl"), token_ids, params, body, client,
                            continues_request_id=prompt.continues_request_id,
                            tool_call_format=call_format)

    async def create(self, body: ChatCompletionRequest, prepared: Prepared) -> dict[str, Any]:
        request = prepared.request
        choices = [ChoiceOutput(parser=prepared.parser) for _ in range(body.n)]
        num_cached_tokens = 0
        async for delta in choice_deltas(prepared.streams, choices):
            num_cached_tokens = delta.num_cached_tokens
        response: dict[str, Any] = {
            "id": request.request_id, "object": "chat.completion", "created": int(time.time()),
            "model": self.settings.served_model_name,
            "choices": [self._message_choice(body, choice,
                                             core_request_id(request.request_id, index, body.n))
                        for index, choice in enumerate(choices)],
            "usage": self.usage(len(request.prompt_token_ids),
                                sum(choice.num_tokens for choice in choices), num_cached_tokens),
        }
        if body.return_token_ids:
            response["prompt_token_ids"] = request.prompt_token_ids
        return response

    def _message_choice(self, body: ChatCompletionRequest, choice: ChoiceOutput,
                        engine_request_id: str) -> dict[str, Any]:
        completion, calls = choice.last, choice.calls_shown
        assert completion is not None
        message: dict[str, Any] = {"role": "assistant",
                                   "content": choice.text if choice.text or not calls else None}
        if calls:
            message["tool_calls"] = _tool_calls(calls, engine_request_id)
        result: dict[str, Any] = {
            "index": completion.index, "message": message,
            "logprobs": self._logprobs(completion.logprobs),
            "finish_reason": _finish_reason(completion.finish_reason, choice.ends_in_calls),
            "stop_reason": completion.stop_reason,
        }
        if body.return_token_ids:
            result["token_ids"] = completion.token_ids
        return result

    async def stream(
        self, body: ChatCompletionRequest, prepared: Prepared
    ) -> AsyncIterator[bytes]:
        """SSE chunks: per choice, a first chunk with the role once the choice has a token,
        content deltas, tool calls and the finish reason at its end; then usage (if asked: the
        other chunks then carry a null one, as OpenAI's) and `[DONE]`. With
        `return_token_ids`, the first chunk carries the prompt's token ids."""
        request = prepared.request
        include_usage = body.includes_usage
        header = {"id": request.request_id, "object": "chat.completion.chunk",
                  "created": int(time.time()), "model": self.settings.served_model_name,
                  **({"usage": None} if include_usage else {})}
        choices = [_ChoiceStream(parser=prepared.parser) for _ in range(body.n)]
        num_cached_tokens = 0
        prompt_token_ids_sent = not body.return_token_ids
        try:
            async for delta in choice_deltas(prepared.streams, choices):
                num_cached_tokens = delta.num_cached_tokens
                index = delta.completion.index
                choice = self._delta_choice(body, delta, choices[index], core_request_id(
                    request.request_id, index, body.n))
                if choice is None:
                    continue
                chunk = {**header, "choices": [choice]}
                if not prompt_token_ids_sent:
                    chunk["prompt_token_ids"] = request.prompt_token_ids
                    prompt_token_ids_sent = True
                yield sse(chunk)
            if include_usage:
                usage = self.usage(len(request.prompt_token_ids),
                                   sum(c.num_tokens for c in choices), num_cached_tokens)
                yield sse({**header, "choices": [], "usage": usage})
        except Exception as error:
            yield sse_error(error, prepared.client_request_id)
        yield SSE_DONE

    def _delta_choice(self, body: ChatCompletionRequest, output: OutputDelta,
                      state: _ChoiceStream, engine_request_id: str) -> dict[str, Any] | None:
        """The chunk of one choice's delta (its tool call ids name `engine_request_id`);
        None while the choice's text is held back."""
        completion = output.completion
        delta: dict[str, Any] = {}
        if not state.role_sent:  # the choice's first output: it has a token, or it ended
            delta = {"role": "assistant", "content": ""}
            state.role_sent = True
        if output.text:
            delta["content"] = output.text
        if state.calls_shown:
            delta["tool_calls"] = [{"index": index, **call} for index, call in enumerate(
                _tool_calls(state.calls_shown, engine_request_id))]
        carries_tokens = completion.token_ids and (body.return_token_ids or completion.logprobs)
        if not delta and not completion.finished and not carries_tokens:
            return None  # text held back (a partial character, stop string or tool call)
        choice: dict[str, Any] = {
            "index": completion.index, "delta": delta,
            "logprobs": self._logprobs(completion.logprobs),
            "finish_reason": _finish_reason(completion.finish_reason, state.ends_in_calls),
        }
        if completion.finished:
            choice["stop_reason"] = completion.stop_reason
        if body.return_token_ids:
            choice["token_ids"] = completion.token_ids
        return choice

    def _logprobs(self, entries: list[TokenLogprobs] | None) -> dict[str, Any] | None:
        return None if entries is None else {"content": self.token_logprobs(entries)}


def _finish_reason(reason: str | None, ends_in_calls: bool) -> str | None:
    return "tool_calls" if ends_in_calls and reason == "stop" else reason


def _tool_calls(calls: tuple[ParsedToolCall, ...], engine_request_id: str
                ) -> list[dict[str, Any]]:
    return [{"id": issued_call_id(engine_request_id, index), "type": "function",
             "function": {"name": call.name, "arguments": call.arguments}}
            for index, call in enumerate(calls)]
