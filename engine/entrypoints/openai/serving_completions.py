"""POST /v1/completions: text or token-id prompts (or a batch), streamed or not.

Choice `i` of prompt `p` has index `p * n + i`. With `return_token_ids`, each choice carries
its `prompt_token_ids` and `token_ids` (in streams, the prompt's ids come with the choice's
first chunk and each chunk carries its new token ids).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from engine.entrypoints.openai.errors import APIError
from engine.entrypoints.openai.protocol import CompletionRequest
from engine.entrypoints.openai.serving import (
    SSE_DONE,
    ClientContext,
    OpenAIServing,
    merge_streams,
    new_id,
    sse,
    sse_error,
)
from engine.frontend.outputs import CompletionOutput, RequestOutput
from engine.frontend.processor import ProcessedRequest
from engine.outputs import TokenLogprobs
from engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class PreparedCompletion:
    """A completion request queued with the engine: its response id, one engine request per
    prompt, and their output streams."""

    response_id: str
    requests: list[ProcessedRequest]
    streams: list[AsyncIterator[RequestOutput]]


class OpenAIServingCompletion(OpenAIServing):
    """Validates a completion request, runs it, and formats OpenAI's `text_completion`."""

    async def prepare(
        self, body: CompletionRequest, client: ClientContext
    ) -> PreparedCompletion:
        """Validates the request and queues it (all prompts or none); APIError on bad input,
        or 429 if the waiting queue has no room for it. Tokenizing and validating run off the
        event loop."""
        self.check_request(body)
        if body.echo:
            raise APIError(400, "echo is not supported", param="echo")
        if body.suffix:
            raise APIError(400, "suffix is not supported", param="suffix")
        if body.best_of is not None and body.best_of != body.n:
            raise APIError(400, "best_of must equal n (or be omitted)", param="best_of")
        prompts = self._prompts(body.prompt)
        params = self.sampling_params(body, max_tokens=body.max_tokens, logprobs=body.logprobs,
                                      stream=body.stream)
        self.check_queue_room(len(prompts) * body.n)
        response_id = new_id("cmpl")
        requests = await asyncio.to_thread(self._process_prompts, response_id, prompts, params,
                                           body, client)
        return PreparedCompletion(response_id, requests, self.submit(requests))

    def _prompts(self, prompt: str | list[str] | list[int] | list[list[int]]
                 ) -> list[str | list[int]]:
        """The request's prompts; 400 beyond `max_prompts`."""
        if isinstance(prompt, str):
            prompts: list[Any] = [prompt]
        elif prompt and all(isinstance(item, int) for item in prompt):
            prompts = [prompt]
        else:
            prompts = list(prompt)
        if not prompts:
            raise APIError(400, "prompt must not be empty", param="prompt")
        if len(prompts) > self.settings.max_prompts:
            raise APIError(400, f"{len(prompts)} prompts given, over this server's limit of "
                                f"{self.settings.max_prompts}", param="prompt",
                           code="limit_exceeded")
        return prompts

    def _process_prompts(
        self, response_id: str, prompts: list[str | list[int]], params: SamplingParams,
        body: CompletionRequest, client: ClientContext,
    ) -> list[ProcessedRequest]:
        requests = []
        for index, prompt in enumerate(prompts):
            try:
                token_ids = self.engine.processor.tokenize(prompt)[1]
            except ValueError as error:
                raise APIError(400, str(error), param="prompt") from error
            request_id = response_id if len(prompts) == 1 else f"{response_id}-{index}"
            requests.append(self.process(request_id, token_ids, params, body, client))
        return requests

    async def create(self, body: CompletionRequest,
                     prepared: PreparedCompletion) -> dict[str, Any]:
        """The whole (non-streaming) response."""
        response_id, requests = prepared.response_id, prepared.requests
        finals: dict[int, RequestOutput] = {}
        async for prompt_index, output in merge_streams(prepared.streams):
            finals[prompt_index] = output
        choices = []
        num_completion_tokens = 0
        for prompt_index, request in enumerate(requests):
            output = finals[prompt_index]
            for completion in output.outputs:
                num_completion_tokens += len(completion.token_ids)
                choices.append(self._choice(body, prompt_index, completion, request,
                                            text_offset=0, first=True))
        return {
            "id": response_id,
            "object": "text_completion", "created": int(time.time()),
            "model": self.settings.served_model_name, "choices": choices,
            "usage": self.usage(
                sum(len(r.prompt_token_ids) for r in requests), num_completion_tokens,
                sum(finals[i].num_cached_tokens for i in finals),
            ),
        }

    async def stream(
        self, body: CompletionRequest, prepared: PreparedCompletion
    ) -> AsyncIterator[bytes]:
        """SSE chunks, ending with usage (if asked) and `[DONE]`."""
        response_id, requests = prepared.response_id, prepared.requests
        created = int(time.time())
        model = self.settings.served_model_name
        text_offsets: dict[int, int] = {}
        num_completion_tokens = 0
        num_cached: dict[int, int] = {}
        try:
            async for prompt_index, output in merge_streams(prepared.streams):
                num_cached[prompt_index] = output.num_cached_tokens
                request = requests[prompt_index]
                for completion in output.outputs:
                    index = prompt_index * body.n + completion.index
                    first = index not in text_offsets
                    choice = self._choice(body, prompt_index, completion, request,
                                          text_offset=text_offsets.get(index, 0), first=first)
                    text_offsets[index] = text_offsets.get(index, 0) + len(completion.text)
                    num_completion_tokens += len(completion.token_ids)
                    yield sse({"id": response_id, "object": "text_completion",
                               "created": created, "model": model, "choices": [choice]})
            if body.stream_options is not None and body.stream_options.include_usage:
                usage = self.usage(sum(len(r.prompt_token_ids) for r in requests),
                                   num_completion_tokens, sum(num_cached.values()))
                yield sse({"id": response_id, "object": "text_completion", "created": created,
                           "model": model, "choices": [], "usage": usage})
        except Exception as error:
            yield sse_error(error)
        yield SSE_DONE

    def _choice(
        self, body: CompletionRequest, prompt_index: int, completion: CompletionOutput,
        request: ProcessedRequest, *, text_offset: int, first: bool,
    ) -> dict[str, Any]:
        choice: dict[str, Any] = {
            "index": prompt_index * body.n + completion.index,
            "text": completion.text,
            "logprobs": None if completion.logprobs is None
            else self._logprobs(completion.logprobs, text_offset),
            "finish_reason": completion.finish_reason,
            "stop_reason": completion.stop_reason,
        }
        if body.return_token_ids:
            if first:
                choice["prompt_token_ids"] = request.prompt_token_ids
            choice["token_ids"] = completion.token_ids
        return choice

    def _logprobs(self, entries: list[TokenLogprobs], text_offset: int) -> dict[str, Any]:
        tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
        for entry in entries:
            text = self.token_text(entry.token_id)
            tokens.append(text)
            token_logprobs.append(entry.logprob)
            top: dict[str, float] = {}
            # Best first; tokens that decode alike (partial UTF-8) keep the best value.
            for token_id, logprob in zip(entry.top_token_ids, entry.top_logprobs, strict=True):
                top.setdefault(self.token_text(token_id), logprob)
            top.setdefault(text, entry.logprob)
            top_logprobs.append(top)
            offsets.append(text_offset)
            text_offset += len(text)
        return {"tokens": tokens, "token_logprobs": token_logprobs,
                "top_logprobs": top_logprobs, "text_offset": offsets}
