"""What the completion and chat endpoints share: settings, request validation into engine
requests, usage, logprob token texts, SSE framing, stream merging and disconnect handling."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import msgspec
from starlette.requests import Request as HTTPRequest

from engine.core.client import EngineDeadError
from engine.entrypoints.openai.errors import APIError, engine_dead_error, error_body
from engine.entrypoints.openai.job_extension import job_info
from engine.entrypoints.openai.protocol import SamplingFields
from engine.frontend.async_llm import AsyncLLM
from engine.frontend.outputs import RequestOutput
from engine.frontend.processor import ProcessedRequest
from engine.sampling_params import RequestOutputKind, SamplingParams

DEFAULT_MAX_REQUEST_BODY_BYTES = 16 * 1024 * 1024

logger = logging.getLogger(__name__)

_T = TypeVar("_T")
_json = msgspec.json.Encoder()


@dataclass(frozen=True)
class ServerSettings:
    """How the HTTP layer behaves; the engine has its own config.

    `served_model_name` is the only model id requests may name; `api_key`, when set, is
    required as a bearer token on every endpoint but `/health`.
    """

    served_model_name: str
    api_key: str | None = None
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES
    tool_call_parser: str = "auto"

    def __post_init__(self) -> None:
        if not self.served_model_name:
            raise ValueError("served_model_name must not be empty")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must not be empty when given")
        if self.max_request_body_bytes < 1024:
            raise ValueError("max_request_body_bytes must be at least 1024")


class OpenAIServing:
    """Base of the endpoint handlers: turns validated HTTP bodies into engine requests."""

    def __init__(self, engine: AsyncLLM, settings: ServerSettings) -> None:
        self.engine = engine
        self.settings = settings
        self._token_texts: dict[int, str] = {}

    @property
    def max_model_len(self) -> int:
        return self.engine.config.scheduler.max_model_len

    def check_request(self, body: SamplingFields) -> None:
        """Errors common to every generation request: unknown model, unsupported fields,
        a dead engine."""
        if body.model is not None and body.model != self.settings.served_model_name:
            raise APIError(404, f"the model {body.model!r} does not exist", param="model",
                           code="model_not_found")
        if body.logit_bias:
            raise APIError(400, "logit_bias is not supported", param="logit_bias")
        if self.engine.is_dead:
            raise engine_dead_error()

    def sampling_params(
        self, body: SamplingFields, *, max_tokens: int | None, logprobs: int | None,
        stream: bool, skip_special_tokens: bool | None = None,
    ) -> SamplingParams:
        stop = [body.stop] if isinstance(body.stop, str) else (body.stop or [])
        fields: dict[str, Any] = {
            "n": body.n, "temperature": body.temperature, "top_p": body.top_p,
            "top_k": body.top_k, "min_p": body.min_p,
            "presence_penalty": body.presence_penalty,
            "frequency_penalty": body.frequency_penalty,
            "repetition_penalty": body.repetition_penalty,
        }
        fields = {name: value for name, value in fields.items() if value is not None}
        try:
            return SamplingParams(
                **fields, seed=body.seed, max_tokens=max_tokens, min_tokens=body.min_tokens,
                stop=tuple(stop), stop_token_ids=tuple(body.stop_token_ids or ()),
                ignore_eos=body.ignore_eos, logprobs=logprobs,
                include_stop_str_in_output=body.include_stop_str_in_output,
                skip_special_tokens=body.skip_special_tokens if skip_special_tokens is None
                else skip_special_tokens,
                output_kind=RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY,
            )
        except ValueError as error:
            raise APIError(400, str(error)) from error

    def process(
        self, request_id: str, token_ids: list[int], params: SamplingParams,
        body: SamplingFields, headers: Mapping[str, str],
    ) -> ProcessedRequest:
        """The validated engine request; APIError(400) naming what is wrong (including a
        prompt plus `max_tokens` beyond the model's context)."""
        max_tokens = params.max_tokens
        if max_tokens is not None and len(token_ids) + max_tokens > self.max_model_len:
            raise APIError(
                400,
                f"this model's maximum context length is {self.max_model_len} tokens, but "
                f"{len(token_ids) + max_tokens} were requested ({len(token_ids)} in the "
                f"prompt, {max_tokens} for the completion); reduce the prompt or max_tokens",
                param="max_tokens", code="context_length_exceeded",
            )
        try:
            return self.engine.processor.process(
                request_id, token_ids, params, job=job_info(body, headers),
                priority=body.priority,
            )
        except ValueError as error:
            raise APIError(400, str(error)) from error

    def token_text(self, token_id: int) -> str:
        text = self._token_texts.get(token_id)
        if text is None:
            text = self.engine.tokenizer.decode([token_id])
            self._token_texts[token_id] = text
        return text

    @staticmethod
    def usage(num_prompt_tokens: int, num_completion_tokens: int,
              num_cached_tokens: int) -> dict[str, Any]:
        return {
            "prompt_tokens": num_prompt_tokens,
            "completion_tokens": num_completion_tokens,
            "total_tokens": num_prompt_tokens + num_completion_tokens,
            "prompt_tokens_details": {"cached_tokens": num_cached_tokens},
        }


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def sse(payload: Mapping[str, Any]) -> bytes:
    return b"data: " + _json.encode(payload) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


def sse_error(error: BaseException) -> bytes:
    """The SSE event that reports a failure after the stream started (the status is sent)."""
    if isinstance(error, EngineDeadError):
        dead = engine_dead_error(error)
        return sse(error_body(dead.status_code, dead.message, code=dead.code))
    if isinstance(error, ValueError):  # the core rejected the request
        return sse(error_body(400, str(error)))
    logger.exception("a response stream failed")
    return sse(error_body(500, f"internal server error: {type(error).__name__}"))


async def merge_streams(
    streams: list[AsyncIterator[RequestOutput]],
) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Outputs of several requests as they come, tagged with their stream's index. Closing
    the merged stream (or an error in one) stops every request still running."""
    if len(streams) == 1:
        async with contextlib.aclosing(streams[0]) as only:  # type: ignore[type-var]
            async for output in only:
                yield 0, output
        return
    queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def pump(index: int, stream: AsyncIterator[RequestOutput]) -> None:
        try:
            async for output in stream:
                queue.put_nowait((index, output))
            queue.put_nowait((index, None))
        except Exception as error:
            queue.put_nowait((index, error))

    tasks = [asyncio.ensure_future(pump(i, stream)) for i, stream in enumerate(streams)]
    try:
        num_open = len(tasks)
        while num_open:
            index, item = await queue.get()
            if item is None:
                num_open -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()


async def cancel_on_disconnect(request: HTTPRequest, work: Awaitable[_T]) -> _T:
    """Awaits `work`, cancelling it if the client disconnects first (for non-streaming
    responses; a cancelled generation aborts its engine request)."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        raise APIError(499, "the client disconnected", code="client_closed_request")
    finally:
        watcher.cancel()
        task.cancel()
