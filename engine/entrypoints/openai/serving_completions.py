"""POST /v1/completions: text or token-id prompts (or a batch), streamed or not.

Choice `i` of prompt `p` has index `p * n + i`. With `return_token_ids`, each choice carries
its `prompt_token_ids` and `token_ids` (in streams, the prompt's ids come with the choice's
first chunk and each chunk carries its new token ids).

With `echo`, a choice's text starts with the prompt (a token-id prompt decoded), and with
`logprobs` its logprobs start with the prompt's tokens (the first has `null` logprob and top
logprobs); in streams both come with the choice's first chunk. `max_tokens: 0` is allowed only
with `echo`: the engine generates one token, which is dropped (finish reason `length`). A
prompt's echoed logprobs are made and encoded once (`_EchoLogprobs`), however many choices
carry them.

A response estimated large (`response_body.is_large`) is built and encoded on the work pool,
in pieces; a smaller one on the event loop. Either way its logprob values are bounded before
any work by `max_response_logprobs`.
"""

from __future__ import annotations

import functools
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

import msgspec
from starlette.responses import Response

from engine.entrypoints.openai.errors import APIError
from engine.entrypoints.openai.generation import GenerationPlan
from engine.entrypoints.openai.protocol import CompletionRequest
from engine.entrypoints.openai.response_body import is_large, json_pieces
from engine.entrypoints.openai.serving import (
    SSE_DONE,
    ClientContext,
    OpenAIServing,
    Prepared,
    merge_streams,
    new_id,
    sse,
    sse_error,
)
from engine.entrypoints.openai.structured_outputs import may_constrain, output_constraint
from engine.frontend.processor import ProcessedRequest
from engine.frontend.request_outputs import CompletionOutput, RequestOutput
from engine.outputs import TokenLogprobs
from engine.sampling_params import SamplingParams


@dataclass(frozen=True, kw_only=True)
class PreparedCompletion(Prepared):
    """A completion request queued with the engine, one engine request per prompt; its
    response id, and with echo each prompt as text."""

    response_id: str
    echo_texts: list[str] | None = None


_LOGPROB_FIELDS = ("tokens", "token_logprobs", "top_logprobs", "text_offset")
_json = msgspec.json.Encoder()


@dataclass(frozen=True)
class _EchoLogprobs:
    """An echoed prompt's legacy logprobs (from text offset 0), each field's list encoded
    once as a JSON array, for every choice of the prompt to share."""

    arrays: tuple[bytes, ...]  # in `_LOGPROB_FIELDS` order
    alone: msgspec.Raw  # the logprobs object of a choice that generated nothing shown

    @classmethod
    def of(cls, logprobs: dict[str, Any]) -> _EchoLogprobs:
        arrays = tuple(_json.encode(logprobs[name]) for name in _LOGPROB_FIELDS)
        return cls(arrays, cls._object(arrays))

    def joined(self, generated: dict[str, Any] | None) -> msgspec.Raw:
        """The logprobs object of a choice: the prompt's, then `generated`'s (legacy
        logprobs of the choice's own tokens, or None)."""
        if generated is None or not generated["tokens"]:
            return self.alone
        arrays = []
        for name, prompt_array in zip(_LOGPROB_FIELDS, self.arrays, strict=True):
            own = _json.encode(generated[name])
            arrays.append(own if prompt_array == b"[]"
                          else prompt_array[:-1] + b"," + own[1:])
        return self._object(arrays)

    @staticmethod
    def _object(arrays: Sequence[bytes]) -> msgspec.Raw:
        return msgspec.Raw(b"{" + b",".join(
            b'"' + name.encode() + b'":' + array
            for name, array in zip(_LOGPROB_FIELDS, arrays, strict=True)) + b"}")


@dataclass(frozen=True)
class _PromptEcho:
    """What `echo` puts before the completion in a choice's first chunk: the prompt's text,
    and with logprobs the prompt tokens' (None without)."""

    text: str
    logprobs: _EchoLogprobs | None


class OpenAIServingCompletion(OpenAIServing[CompletionRequest, PreparedCompletion]):
    """Validates a completion request, runs it, and formats OpenAI's `text_completion`; a
    response over `max_response_logprobs` is refused before any work."""

    async def _prepare(self, body: CompletionRequest, client: ClientContext
                       ) -> PreparedCompletion:
        _check_prompt_only(body)
        if body.suffix:
            raise APIError(400, "suffix is not supported", param="suffix")
        if body.best_of is not None and body.best_of != body.n:
            raise APIError(400, "best_of must equal n (or be omitted)", param="best_of")
        prompts = self._prompts(body.prompt)
        if body.logprobs is not None and body.max_tokens:
            self.check_response_logprobs(
                len(prompts) * body.n * body.max_tokens * (1 + body.logprobs),
                f"{len(prompts)} prompts x n {body.n} x max_tokens {body.max_tokens} x "
                f"(1 + logprobs {body.logprobs}), before any echoed prompt", paced=False)
        # Prompt only (max_tokens 0): one token is generated, and dropped from the response.
        params = await self.params_for(body, GenerationPlan(
            num_completions=len(prompts) * body.n,
            max_tokens=1 if body.max_tokens == 0 else body.max_tokens,
            logprobs=body.logprobs, prompt_logprobs=body.logprobs if body.echo else None,
            constraint=functools.partial(output_constraint, body) if may_constrain(body)
            else None), client)
        response_id = new_id("cmpl")
        echo_texts = (await self.run_for(client, self._echo_texts, prompts)
                      if body.echo else None)
        requests = await self.run_for(client, self._process_prompts, response_id,
                                       prompts, params, body, client)
        return PreparedCompletion(response_id=response_id, requests=requests,
                                  streams=self.submit(requests), tenant=client.tenant,
                                  client_request_id=client.request_id, echo_texts=echo_texts)

    def _echo_texts(self, prompts: list[str | list[int]]) -> list[str]:
        """The text `echo` returns for each prompt: a text prompt as given, a token-id prompt
        decoded (special tokens included: they were scored too)."""
        return [prompt if isinstance(prompt, str) else self.engine.tokenizer.decode(prompt)
                for prompt in prompts]

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

    def _tokenize(self, prompt: str | list[int]) -> list[int]:
        return self.engine.processor.tokenize(prompt)[1]

    def _process_prompts(
        self, response_id: str, prompts: list[str | list[int]], params: SamplingParams,
        body: CompletionRequest, client: ClientContext,
    ) -> list[ProcessedRequest]:
        """The engine request of each prompt; 400 (at the first prompt past it) if their
        logprob values together are over `max_response_logprobs`."""
        requests = []
        num_logprob_values = 0
        for index, prompt in enumerate(prompts):
            token_ids = self.prompt_token_ids(params, self._tokenize, prompt)
            request_id = response_id if len(prompts) == 1 else f"{response_id}-{index}"
            request = self.process(request_id, token_ids, params, body, client)
            num_logprob_values += self.num_logprob_values(len(token_ids),
                                                          request.sampling_params)
            self.check_response_logprobs(
                num_logprob_values, f"the first {index + 1} of {len(prompts)} prompts' tokens "
                                    f"x choices x (1 + logprobs)")
            requests.append(request)
        return requests

    async def create(self, body: CompletionRequest,
                     prepared: PreparedCompletion) -> Response:
        """The whole (non-streaming) response, built and encoded on the work pool if it is
        large."""
        finals: dict[int, RequestOutput] = {}
        async for prompt_index, output in merge_streams(prepared.streams):
            finals[prompt_index] = output
        if is_large(*self._body_size(body, prepared, finals)):
            pieces = await self.pool.run(prepared.tenant, self._encoded_response, body,
                                         prepared, finals)
            return self.large_body_response(prepared.tenant, pieces)
        return Response(_json.encode(self._response(body, prepared, finals)),
                        media_type="application/json")

    def _body_size(self, body: CompletionRequest, prepared: PreparedCompletion,
                   finals: dict[int, RequestOutput]) -> tuple[int, int]:
        """The characters of text and the logprob values of the response."""
        num_chars = num_logprobs = 0
        for prompt_index, output in finals.items():
            echo_text = "" if prepared.echo_texts is None else prepared.echo_texts[prompt_index]
            num_echoed = len(prepared.requests[prompt_index].prompt_token_ids) if (
                echo_text and body.logprobs is not None) else 0
            for completion in output.outputs:
                num_chars += len(echo_text) + len(completion.text)
                num_logprobs += num_echoed + len(completion.logprobs or ())
        return num_chars, num_logprobs * (1 + (body.logprobs or 0))

    def _encoded_response(self, body: CompletionRequest, prepared: PreparedCompletion,
                          finals: dict[int, RequestOutput]) -> list[bytes]:
        """The response's JSON in pieces, for a worker thread."""
        return json_pieces(self._response(body, prepared, finals))

    def _response(self, body: CompletionRequest, prepared: PreparedCompletion,
                  finals: dict[int, RequestOutput]) -> dict[str, Any]:
        response_id, requests = prepared.response_id, prepared.requests
        choices = []
        num_completion_tokens = 0
        for prompt_index, request in enumerate(requests):
            output = finals[prompt_index]
            echo = self._prompt_echo(prepared, prompt_index, output.prompt_logprobs)
            for completion in output.outputs:
                completion = _shown(body, completion)
                num_completion_tokens += len(completion.token_ids)
                choices.append(self._choice(body, prompt_index, completion, request,
                                            text_offset=0, first=True, echo=echo))
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
        """SSE chunks, ending with usage (if asked: the other chunks then carry a null one, as
        OpenAI's) and `[DONE]`."""
        response_id, requests = prepared.response_id, prepared.requests
        include_usage = body.includes_usage
        header = {"id": response_id, "object": "text_completion", "created": int(time.time()),
                  "model": self.settings.served_model_name,
                  **({"usage": None} if include_usage else {})}
        text_offsets: dict[int, int] = {}
        num_completion_tokens = 0
        num_cached: dict[int, int] = {}
        prompt_logprobs: dict[int, list[TokenLogprobs | None]] = {}  # from a first output
        echoes: dict[int, _PromptEcho | None] = {}
        try:
            async for prompt_index, output in merge_streams(prepared.streams):
                num_cached[prompt_index] = output.num_cached_tokens
                if output.prompt_logprobs is not None:
                    prompt_logprobs[prompt_index] = output.prompt_logprobs
                request = requests[prompt_index]
                for completion in output.outputs:
                    completion = _shown(body, completion)
                    index = prompt_index * body.n + completion.index
                    first = index not in text_offsets
                    if first and prompt_index not in echoes:
                        echoes[prompt_index] = await self._prompt_echo_for_stream(
                            prepared, prompt_index, prompt_logprobs.get(prompt_index))
                    echo = echoes[prompt_index] if first else None
                    choice = self._choice(body, prompt_index, completion, request,
                                          text_offset=text_offsets.get(index, 0), first=first,
                                          echo=echo)
                    text_offsets[index] = text_offsets.get(index, 0) + len(choice["text"])
                    num_completion_tokens += len(completion.token_ids)
                    yield sse({**header, "choices": [choice]})
            if include_usage:
                usage = self.usage(sum(len(r.prompt_token_ids) for r in requests),
                                   num_completion_tokens, sum(num_cached.values()))
                yield sse({**header, "choices": [], "usage": usage})
        except Exception as error:
            yield sse_error(error, prepared.client_request_id)
        yield SSE_DONE

    def _prompt_echo(self, prepared: PreparedCompletion, prompt_index: int,
                     prompt_logprobs: list[TokenLogprobs | None] | None) -> _PromptEcho | None:
        """What `echo` puts first in each choice of the prompt (None without echo); its
        logprobs made and encoded here, once."""
        if prepared.echo_texts is None:
            return None
        logprobs = None
        if prepared.requests[prompt_index].sampling_params.prompt_logprobs is not None:
            token_ids = prepared.requests[prompt_index].prompt_token_ids
            entries = prompt_logprobs or [None] * len(token_ids)
            logprobs = _EchoLogprobs.of(
                self._logprobs(list(zip(token_ids, entries, strict=True)), 0))
        return _PromptEcho(text=prepared.echo_texts[prompt_index], logprobs=logprobs)

    async def _prompt_echo_for_stream(
        self, prepared: PreparedCompletion, prompt_index: int,
        prompt_logprobs: list[TokenLogprobs | None] | None,
    ) -> _PromptEcho | None:
        """`_prompt_echo`, made on the work pool when its logprobs are large."""
        request = prepared.requests[prompt_index]
        top = request.sampling_params.prompt_logprobs
        num_values = 0 if top is None else len(request.prompt_token_ids) * (1 + top)
        if is_large(0, num_values):
            return await self.pool.run(prepared.tenant, self._prompt_echo, prepared,
                                       prompt_index, prompt_logprobs)
        return self._prompt_echo(prepared, prompt_index, prompt_logprobs)

    def _choice(
        self, body: CompletionRequest, prompt_index: int, completion: CompletionOutput,
        request: ProcessedRequest, *, text_offset: int, first: bool,
        echo: _PromptEcho | None = None,
    ) -> dict[str, Any]:
        """One choice (or a chunk of it, starting at `text_offset` of its text); `echo` puts
        the prompt first (in a choice's first chunk, at text offset 0)."""
        text = completion.text
        logprobs: dict[str, Any] | msgspec.Raw | None = None
        if completion.logprobs is not None:
            generated_offset = text_offset + (0 if echo is None else len(echo.text))
            logprobs = self._logprobs([(e.token_id, e) for e in completion.logprobs],
                                      generated_offset)
        if echo is not None:
            text = echo.text + text
            if echo.logprobs is not None:
                logprobs = echo.logprobs.joined(logprobs)
        choice: dict[str, Any] = {
            "index": prompt_index * body.n + completion.index,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": completion.finish_reason,
            "stop_reason": completion.stop_reason,
        }
        if body.return_token_ids:
            if first:
                choice["prompt_token_ids"] = request.prompt_token_ids
            choice["token_ids"] = completion.token_ids
        return choice

    def _logprobs(self, entries: Sequence[tuple[int, TokenLogprobs | None]], text_offset: int
                  ) -> dict[str, Any]:
        """OpenAI's legacy logprobs of tokens `(token_id, entry)`; a token without an entry
        (the first of an echoed prompt) has null logprob and top logprobs. Offsets count the
        characters of the token texts, from `text_offset`."""
        tokens, token_logprobs, offsets = [], [], []
        top_logprobs: list[dict[str, float] | None] = []
        for token_id, entry in entries:
            text = self.token_text(token_id)
            tokens.append(text)
            offsets.append(text_offset)
            text_offset += len(text)
            if entry is None:
                token_logprobs.append(None)
                top_logprobs.append(None)
                continue
            token_logprobs.append(entry.logprob)
            top: dict[str, float] = {}
            # Best first; tokens that decode alike (partial UTF-8) keep the best value.
            for top_id, logprob in zip(entry.top_token_ids, entry.top_logprobs, strict=True):
                top.setdefault(self.token_text(top_id), logprob)
            top.setdefault(text, entry.logprob)
            top_logprobs.append(top)
        return {"tokens": tokens, "token_logprobs": token_logprobs,
                "top_logprobs": top_logprobs, "text_offset": offsets}


def _check_prompt_only(body: CompletionRequest) -> None:
    """`max_tokens: 0` asks for the prompt alone, which only `echo` returns."""
    if body.max_tokens != 0:
        return
    if not body.echo:
        raise APIError(400, "max_tokens must be at least 1 (0 is allowed only with echo, "
                            "which returns the prompt alone)", param="max_tokens")
    if body.min_tokens:
        raise APIError(400, "min_tokens must be 0 when max_tokens is 0", param="min_tokens")


def _shown(body: CompletionRequest, completion: CompletionOutput) -> CompletionOutput:
    """The completion as the response shows it: with `max_tokens: 0` the one token the engine
    generated is dropped, and the completion ends for its length."""
    if body.max_tokens != 0:
        return completion
    finished = completion.finish_reason is not None
    return replace(completion, text="", token_ids=[],
                   logprobs=None if completion.logprobs is None else [],
                   finish_reason="length" if finished else None, stop_reason=None)
