"""POST /v1/responses (OpenAI's Responses API) on top of the chat machinery, and GET / DELETE
of stored responses.

Input items become chat messages (`function_call` items join the assistant message before
them as `tool_calls`, `function_call_output` items become `tool` messages), rendered by the
chat template with the function tools; the output is parsed by the chat tool-call parser into
a `message` item and `function_call` items (an `incomplete` one for the call the output was
cut off in, its arguments as far as written). Streams are OpenAI's semantic events.

A response is stored (unless `store` is false) with its whole conversation, so that
`previous_response_id` continues it; `GET /v1/responses/{id}` sends the stored JSON as it is.
A response estimated large (`response_body.is_large`: long, or with many logprobs) is
finished and encoded on the work pool, in pieces, its logprobs encoded once for all the
events and the stored copy that carry them. A turn's job is the one its client names (`job_id`, the
job header or `prompt_cache_key`), else that of the stored turn it chains onto, else the
engine infers it, as for chat: a turn that re-sends the conversation (the default of most agent
frameworks) or chains onto one continues the job of the turn whose output it carries, found
by the function calls it sends back (`tool_call_ids`) or the response it names, else by its
prompt. So the engine's job order and KV pins apply to every agent's turns.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
from starlette.responses import Response

from engine.entrypoints.openai.body_limits import MAX_CONVERSATION_ITEMS
from engine.entrypoints.openai.errors import APIError, check_unique_names
from engine.entrypoints.openai.generation import (
    ChoiceOutput,
    Constraint,
    ForcedTool,
    GenerationPlan,
    OfferedTool,
    ToolOffer,
)
from engine.entrypoints.openai.job_extension import JOB_ID_HEADER, job_info
from engine.entrypoints.openai.protocol_responses import (
    LOGPROBS_INCLUDE,
    SUPPORTED_INCLUDES,
    ConversationItem,
    FunctionCallItem,
    FunctionToolChoice,
    MessageItem,
    OutputTextPart,
    ResponsesRequest,
    TextFormatJSONSchema,
)
from engine.entrypoints.openai.refusal_pacing import RefusalPacer
from engine.entrypoints.openai.response_body import (
    is_large,
    json_pieces,
)
from engine.entrypoints.openai.response_store import ResponseStore, StoredResponse, item_json
from engine.entrypoints.openai.responses_prompt import (
    conversation,
    input_items,
    template_messages,
    template_tools,
)
from engine.entrypoints.openai.serving import (
    ClientContext,
    OpenAIServing,
    Prepared,
    ServerSettings,
    choice_deltas,
    merge_streams,
    new_id,
    sse,
    sse_pieces,
    stream_failure,
)
from engine.entrypoints.openai.structured_outputs import (
    GrammarChecker,
    json_object_constraint,
    json_schema_constraint,
)
from engine.entrypoints.openai.tool_call_ids import continued_request_id, issued_call_id
from engine.entrypoints.openai.work_pool import TenantWorkPool
from engine.frontend.async_llm import AsyncLLM
from engine.frontend.processor import ProcessedRequest
from engine.frontend.request_outputs import CompletionOutput
from engine.outputs import TokenLogprobs
from engine.sampling_params import SamplingParams
from engine.tool_calls import ParsedToolCall, ToolCallFormat

logger = logging.getLogger(__name__)
_json = msgspec.json.Encoder()


@dataclass(frozen=True, kw_only=True)
class PreparedResponse(Prepared):
    """A response request queued with the engine, and what the response object and the store
    need (`item_jsons`: the conversation the prompt was rendered from, as the store keeps it;
    `job_id` the job as the client names it)."""

    response_id: str
    created_at: int
    item_jsons: tuple[bytes, ...]
    job_id: str | None
    store: bool


@dataclass(kw_only=True)
class _Output(ChoiceOutput):
    """One response's output as it arrives (the same for streamed and whole responses, so
    both give the same items): its function calls as items, and its logprobs."""

    with_logprobs: bool
    engine_request_id: str
    message_id: str = field(default_factory=lambda: new_id("msg", "_"))
    calls: list[dict[str, Any]] = field(default_factory=list)
    logprobs: list[dict[str, Any]] = field(default_factory=list)
    encoded_logprobs: msgspec.Raw | None = None  # set by `encode_logprobs`
    num_unsent_logprobs: int = 0

    def push(self, completion: CompletionOutput) -> str:
        delta = super().push(completion)
        if completion.finished:
            self.calls = [_function_call_item(call, issued_call_id(self.engine_request_id, i),
                                              complete=call is not self.cut_call)
                          for i, call in enumerate(self.calls_shown)]
        return delta

    def add_logprobs(self, logprobs: list[dict[str, Any]]) -> None:
        """Takes the logprob entries of the latest delta's tokens."""
        self.logprobs.extend(logprobs)
        self.num_unsent_logprobs += len(logprobs)

    def unsent_logprobs(self) -> list[dict[str, Any]]:
        """The logprobs of the tokens since the last call (sent with a text delta)."""
        start = len(self.logprobs) - self.num_unsent_logprobs
        self.num_unsent_logprobs = 0
        return self.logprobs[start:]

    @property
    def has_message(self) -> bool:
        """A message item is output when there is text, or when there is nothing else."""
        return bool(self.text) or not self.calls

    @property
    def incomplete(self) -> bool:
        return self.finish_reason == "length"

    def num_logprob_values(self, top_logprobs: int) -> int:
        """The logprob values of the output so far (each token's and its `top_logprobs`
        alternatives)."""
        return len(self.logprobs) * (1 + top_logprobs) if self.with_logprobs else 0

    def encode_logprobs(self) -> None:
        """Encodes the finished output's logprobs once, for every event and body that
        carries them (for a worker thread)."""
        self.encoded_logprobs = msgspec.Raw(b"".join(json_pieces(self.logprobs)))

    def text_part(self) -> dict[str, Any]:
        logprobs: list[dict[str, Any]] | msgspec.Raw = []
        if self.with_logprobs:
            logprobs = self.logprobs if self.encoded_logprobs is None else self.encoded_logprobs
        return {"type": "output_text", "text": self.text, "annotations": [],
                "logprobs": logprobs}

    def message_item(self, *, done: bool) -> dict[str, Any]:
        status = "in_progress" if not done else "incomplete" if self.incomplete else "completed"
        return {"id": self.message_id, "type": "message", "status": status,
                "role": "assistant", "content": [self.text_part()] if done else []}

    def items(self) -> list[dict[str, Any]]:
        """The output items, once the output is finished."""
        message = [self.message_item(done=True)] if self.has_message else []
        return [*message, *self.calls]

    def conversation_items(self) -> list[ConversationItem]:
        """The output as input items of a later turn."""
        items: list[ConversationItem] = []
        if self.has_message:
            items.append(MessageItem(role="assistant", id=self.message_id,
                                     content=[OutputTextPart(type="output_text",
                                                             text=self.text)]))
        items.extend(FunctionCallItem(type="function_call", call_id=call["call_id"],
                                      name=call["name"], arguments=call["arguments"],
                                      id=call["id"], status=call["status"])
                     for call in self.calls)
        return items


def _function_call_item(call: ParsedToolCall, call_id: str, *, complete: bool
                        ) -> dict[str, Any]:
    return {"id": new_id("fc", "_"), "type": "function_call",
            "status": "completed" if complete else "incomplete",
            "call_id": call_id, "name": call.name, "arguments": call.arguments}


def responses_offer(body: ResponsesRequest) -> ToolOffer:
    """The function tools a Responses request offers, as this API names its fields; a
    function is strict unless it says otherwise, as OpenAI has it."""
    choice = body.tool_choice
    return ToolOffer(
        tools=tuple(OfferedTool(tool.name, tool.parameters, tool.strict is not False,
                                f"tools[{index}].parameters")
                    for index, tool in enumerate(body.tools or ())),
        choice=ForcedTool(choice.name) if isinstance(choice, FunctionToolChoice)
        else choice or "auto",
        parallel=body.parallel_tool_calls is not False)


def _format_constraint(body: ResponsesRequest) -> Callable[[], Constraint | None] | None:
    """The constraint `text.format` asks for, to build off the event loop (None: no
    format)."""
    text_format = None if body.text is None else body.text.format
    if isinstance(text_format, TextFormatJSONSchema):
        return functools.partial(json_schema_constraint, "text.format.schema",
                                 text_format.schema_, strict=bool(text_format.strict))
    if text_format is not None and text_format.type == "json_object":
        return functools.partial(json_object_constraint, "text.format")
    return None if text_format is None else _no_constraint


def _no_constraint() -> None:
    """A plain-text format: nothing to constrain, but the tools' schemas are checked."""


class _Events:
    """SSE events of one streamed response, numbered from 0 (`sequence_number`). With
    `in_pieces`, each event comes as `sse_pieces` make it (for a large output's closing
    events, on a worker thread)."""

    def __init__(self) -> None:
        self.sequence_number = 0
        self.in_pieces = False

    def __call__(self, kind: str, **fields: Any) -> bytes:
        return b"".join(self.pieces(kind, **fields))

    def pieces(self, kind: str, **fields: Any) -> list[bytes]:
        payload = {"type": kind, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        head = b"event: " + kind.encode() + b"\n"
        if self.in_pieces:
            return [head, *sse_pieces(payload)]
        return [head + sse(payload)]


class OpenAIServingResponses(OpenAIServing[ResponsesRequest, PreparedResponse]):
    """Validates a Responses request, runs it, formats OpenAI's `response` object (whole or
    as events), and keeps finished responses in `store` for later turns and GET."""

    prompt_param = "input"
    max_tokens_param = "max_output_tokens"

    def __init__(self, engine: AsyncLLM, settings: ServerSettings, pool: TenantWorkPool,
                 grammar_checker: GrammarChecker, refusal_pacer: RefusalPacer,
                 store: ResponseStore) -> None:
        super().__init__(engine, settings, pool, grammar_checker, refusal_pacer)
        self.store = store

    async def _prepare(self, body: ResponsesRequest, client: ClientContext
                       ) -> PreparedResponse:
        self._check_fields(body)
        previous = self._previous(body, client)
        items = input_items(body)
        num_items = len(items) + (0 if previous is None else len(previous.item_jsons))
        if num_items == 0:
            raise APIError(400, "input must not be empty", param="input")
        if num_items > MAX_CONVERSATION_ITEMS:
            raise APIError(400, f"the conversation (the stored responses this one continues and "
                                f"its input) has {num_items} items, over the limit of "
                                f"{MAX_CONVERSATION_ITEMS}", param="input",
                           code="limit_exceeded")
        offer = responses_offer(body)
        call_format = offer.call_format(self.settings.tool_call_parser)
        job_body, job_id = _with_job(body, None if previous is None else previous.job_id,
                                     client)
        params = await self.params_for(body, GenerationPlan(
            num_completions=1, max_tokens=body.max_output_tokens,
            logprobs=(body.top_logprobs or 0) if LOGPROBS_INCLUDE in (body.include or ())
            else None, offer=offer, constraint=_format_constraint(body)), client)
        response_id = new_id("resp", "_")
        store = body.store is not False
        items, item_jsons = await self.run_for(client, conversation, previous, items)
        request = await self.run_for(
            client, self._render_and_process, response_id, job_body, items, params, client,
            None if previous is None else previous.response_id, call_format)
        return PreparedResponse(
            requests=[request], streams=self.submit([request]), tenant=client.tenant,
            client_request_id=client.request_id, response_id=response_id,
            created_at=int(time.time()), item_jsons=item_jsons, job_id=job_id,
            parser=None if call_format is None else call_format.make_parser(), store=store)

    def _check_fields(self, body: ResponsesRequest) -> None:
        unsupported = [(name, why) for name, value, why in (
            ("background", body.background, "background responses are not supported"),
            ("conversation", body.conversation, "conversations are not supported; use "
                                                "previous_response_id"),
            ("prompt", body.prompt, "prompt templates are not supported"),
            ("truncation", body.truncation == "auto", "truncation 'auto' is not supported"),
        ) if value]
        if unsupported:
            name, why = unsupported[0]
            raise APIError(400, why, param=name)
        for value in body.include or ():
            if value not in SUPPORTED_INCLUDES:
                raise APIError(400, f"include {value!r} is not supported (supported: "
                                    f"{', '.join(sorted(SUPPORTED_INCLUDES))})",
                               param="include")
        _check_tools(body)

    def _previous(self, body: ResponsesRequest, client: ClientContext) -> StoredResponse | None:
        if body.previous_response_id is None:
            return None
        previous = self.store.get(client.tenant, body.previous_response_id)
        if previous is None:
            raise APIError(400, f"Previous response with id {body.previous_response_id!r} not "
                                "found.", param="previous_response_id",
                           code="previous_response_not_found")
        return previous

    def _render_and_process(
        self, response_id: str, body: ResponsesRequest, items: Sequence[ConversationItem],
        params: SamplingParams, client: ClientContext, previous_request_id: str | None,
        call_format: ToolCallFormat | None,
    ) -> ProcessedRequest:
        """The engine request of a turn (its id is the response's); it continues the turn of
        `previous_request_id` (the response it chains onto), else the turn whose function
        calls its input sends back."""
        messages = template_messages(body.instructions, items)
        tools = template_tools(body)
        token_ids = self.prompt_token_ids(params, self._chat_prompt, messages, tools)
        return self.process(response_id, token_ids, params, body, client,
                            continues_request_id=previous_request_id
                            or continued_request_id(messages), tool_call_format=call_format)

    def _chat_prompt(self, messages: list[dict[str, Any]],
                     tools: list[dict[str, Any]] | None) -> list[int]:
        return self.engine.processor.chat_prompt(messages, tools=tools)

    async def create(self, body: ResponsesRequest, prepared: PreparedResponse) -> Response:
        """The whole (non-streaming) response; stored unless `store` is false. Finished and
        encoded on the work pool if it is large."""
        output = self._new_output(body, prepared)
        num_cached_tokens = 0
        completions: list[CompletionOutput] = []
        async for _, result in merge_streams(prepared.streams):
            num_cached_tokens = result.num_cached_tokens
            completions.extend(result.outputs)
        num_tokens = sum(len(completion.token_ids) for completion in completions)
        large = is_large(sum(len(completion.text) for completion in completions),
                         num_tokens * (1 + (body.top_logprobs or 0)) if output.with_logprobs
                         else 0)
        whole = (body, prepared, output, completions, num_cached_tokens, large)
        pieces, stored = (await self.pool.run(prepared.tenant, self._whole_response, *whole)
                          if large else self._whole_response(*whole))
        self._keep(prepared, stored)
        if large:
            return self.large_body_response(prepared.tenant, pieces)
        return Response(b"".join(pieces), media_type="application/json")

    def _whole_response(self, body: ResponsesRequest, prepared: PreparedResponse,
                        output: _Output, completions: Sequence[CompletionOutput],
                        num_cached_tokens: int, large: bool
                        ) -> tuple[list[bytes], StoredResponse | None]:
        """The response's JSON, and its record for the store; a `large` one's in pieces, its
        logprobs encoded once, on a worker thread."""
        for completion in completions:
            output.add_logprobs(self._logprobs(completion.logprobs))
            output.push(completion)
        if large:
            output.encode_logprobs()
        final = self._finished(body, prepared, output, num_cached_tokens)
        pieces = json_pieces(final) if large else [_json.encode(final)]
        return pieces, self._record(prepared, output, b"".join(pieces))

    async def stream(self, body: ResponsesRequest, prepared: PreparedResponse
                     ) -> AsyncIterator[bytes]:
        """The response as SSE events: created, in_progress, the output items with their
        deltas, then completed, incomplete (max_output_tokens) or failed. The closing events
        of a large output are made on the work pool."""
        event = _Events()
        output = self._new_output(body, prepared)
        snapshot = self._response_object(body, prepared, status="in_progress")
        yield event("response.created", response=snapshot)
        yield event("response.in_progress", response=snapshot)
        try:
            num_cached_tokens = 0
            message_open = False
            async for delta in choice_deltas(prepared.streams, [output]):
                num_cached_tokens = delta.num_cached_tokens
                output.add_logprobs(self._logprobs(delta.completion.logprobs))
                if delta.text:
                    if not message_open:
                        message_open = True
                        for chunk in _message_opening(event, output):
                            yield chunk
                    yield event("response.output_text.delta", item_id=output.message_id,
                                output_index=0, content_index=0, delta=delta.text,
                                logprobs=output.unsent_logprobs())
            closing = (body, prepared, output, event, message_open, num_cached_tokens)
            if is_large(len(output.text), output.num_logprob_values(body.top_logprobs or 0)):
                chunks, stored = await self.pool.run(
                    prepared.tenant, self._closing_events, *closing, True)
            else:
                chunks, stored = self._closing_events(*closing, False)
            self._keep(prepared, stored)
            for chunk in chunks:
                yield chunk
        except Exception as error:
            failure = stream_failure(error, prepared.client_request_id)
            failed = self._response_object(body, prepared, status="failed", error={
                "code": "invalid_prompt" if failure.status_code < 500 else "server_error",
                "message": failure.message})
            yield event("response.failed", response=failed)

    def _closing_events(self, body: ResponsesRequest, prepared: PreparedResponse,
                        output: _Output, event: _Events, message_open: bool,
                        num_cached_tokens: int, large: bool
                        ) -> tuple[list[bytes], StoredResponse | None]:
        """The events that end a streamed response (see `_output_closing`, then completed
        or incomplete), and its record for the store. A `large` output's are made on a
        worker thread, in pieces, its logprobs encoded once."""
        if large:
            output.encode_logprobs()
            event.in_pieces = True
        chunks = _output_closing(event, output, message_open=message_open)
        final = self._finished(body, prepared, output, num_cached_tokens)
        body_json = b"".join(json_pieces(final)) if large else _json.encode(final)
        kind = "response.incomplete" if output.incomplete else "response.completed"
        chunks += event.pieces(kind, response=msgspec.Raw(body_json))
        event.in_pieces = False
        return chunks, self._record(prepared, output, body_json)

    def _new_output(self, body: ResponsesRequest, prepared: PreparedResponse) -> _Output:
        return _Output(
            parser=prepared.parser,
            with_logprobs=LOGPROBS_INCLUDE in (body.include or ()),
            engine_request_id=prepared.request.core_requests[0].request_id)

    def _finished(self, body: ResponsesRequest, prepared: PreparedResponse, output: _Output,
                  num_cached_tokens: int) -> dict[str, Any]:
        """The finished response object."""
        num_prompt_tokens = len(prepared.request.prompt_token_ids)
        return self._response_object(
            body, prepared, status="incomplete" if output.incomplete else "completed",
            output=output.items(),
            usage={"input_tokens": num_prompt_tokens,
                   "input_tokens_details": {"cached_tokens": num_cached_tokens,
                                            "cache_write_tokens": 0},
                   "output_tokens": output.num_tokens,
                   "output_tokens_details": {"reasoning_tokens": 0},
                   "total_tokens": num_prompt_tokens + output.num_tokens})

    @staticmethod
    def _record(prepared: PreparedResponse, output: _Output, body_json: bytes
                ) -> StoredResponse | None:
        """The store's record of a finished response whose JSON is `body_json`; None if it
        is not stored (`store` false)."""
        if not prepared.store:
            return None
        return StoredResponse.of(
            prepared.response_id, prepared.job_id,
            (*prepared.item_jsons, *map(item_json, output.conversation_items())), body_json,
            num_input_items=len(prepared.item_jsons))

    def _keep(self, prepared: PreparedResponse, stored: StoredResponse | None) -> None:
        """Puts a finished response's record in the store (on the event loop)."""
        if stored is not None and not self.store.put(prepared.tenant, stored):
            logger.warning("response %s is not stored: its conversation (%d bytes) is over the "
                           "store's limit of %d bytes a tenant", prepared.response_id,
                           stored.num_bytes, self.store.max_bytes_per_tenant)

    def _response_object(
        self, body: ResponsesRequest, prepared: PreparedResponse, *, status: str,
        output: list[dict[str, Any]] | None = None, usage: dict[str, Any] | None = None,
        error: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        params = prepared.request.sampling_params
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {
            "id": prepared.response_id, "object": "response", "created_at": prepared.created_at,
            "status": status, "background": False, "error": error,
            "completed_at": int(time.time()) if status == "completed" else None,
            "incomplete_details": incomplete, "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens, "max_tool_calls": body.max_tool_calls,
            "model": self.settings.served_model_name, "output": output or [],
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": body.previous_response_id,
            "reasoning": {"effort": None, "summary": None}, "service_tier": "default",
            "store": prepared.store, "temperature": params.temperature,
            "text": _text_config(body), "tool_choice": _tool_choice(body),
            "tools": [tool.model_dump() for tool in body.tools or ()],
            "top_logprobs": body.top_logprobs or 0, "top_p": params.top_p,
            "truncation": "disabled", "usage": usage, "user": body.user,
            "safety_identifier": body.safety_identifier, "metadata": body.metadata or {},
            "prompt_cache_key": body.prompt_cache_key,
            "job_id": prepared.job_id,
        }

    def _logprobs(self, entries: list[TokenLogprobs] | None) -> list[dict[str, Any]]:
        return self.token_logprobs(entries or [])


def _check_tools(body: ResponsesRequest) -> None:
    names = [tool.name for tool in body.tools or ()]
    check_unique_names(names, "tools")
    choice = body.tool_choice
    if (choice == "required" or isinstance(choice, FunctionToolChoice)) and not names:
        raise APIError(400, "tool_choice needs tools", param="tool_choice")
    if isinstance(choice, FunctionToolChoice) and choice.name not in names:
        raise APIError(400, f"tool_choice names {choice.name!r}, which is not among the tools",
                       param="tool_choice")


def _with_job(body: ResponsesRequest, chain_job_id: str | None, client: ClientContext
              ) -> tuple[ResponsesRequest, str | None]:
    """The body with the chain's job unless the client names one (which wins), and with a
    forced function as the turn's known tool unless the client names one; and the job's id
    as the client names it (None: no job)."""
    names_job = body.job_id is not None or body.prompt_cache_key is not None or \
        JOB_ID_HEADER in client.headers
    if not names_job and chain_job_id is not None:
        body = body.model_copy(update={"job_id": chain_job_id})
    job = job_info(body, client.headers)
    if job is None:
        return body, None
    if isinstance(body.tool_choice, FunctionToolChoice) and job.tool_name is None:
        body = body.model_copy(update={"tool_name": body.tool_choice.name})
    return body, job.job_id


def _message_opening(event: _Events, output: _Output) -> list[bytes]:
    return [
        event("response.output_item.added", output_index=0,
              item=output.message_item(done=False)),
        event("response.content_part.added", item_id=output.message_id, output_index=0,
              content_index=0, part={"type": "output_text", "text": "", "annotations": [],
                                     "logprobs": []}),
    ]


def _output_closing(event: _Events, output: _Output, *, message_open: bool) -> list[bytes]:
    """The events that end the message (opening it if no text was sent) and carry the
    function calls, once the output is finished."""
    chunks = []
    if output.has_message:
        if not message_open:
            chunks.extend(_message_opening(event, output))
        part = output.text_part()
        chunks += [
            *event.pieces("response.output_text.done", item_id=output.message_id,
                          output_index=0, content_index=0, text=output.text,
                          logprobs=part["logprobs"]),
            *event.pieces("response.content_part.done", item_id=output.message_id,
                          output_index=0, content_index=0, part=part),
            *event.pieces("response.output_item.done", output_index=0,
                          item=output.message_item(done=True)),
        ]
    for index, call in enumerate(output.calls, start=1 if output.has_message else 0):
        chunks += [
            event("response.output_item.added", output_index=index,
                  item={**call, "status": "in_progress", "arguments": ""}),
            event("response.function_call_arguments.delta", item_id=call["id"],
                  output_index=index, delta=call["arguments"]),
            event("response.function_call_arguments.done", item_id=call["id"],
                  output_index=index, name=call["name"], arguments=call["arguments"]),
            event("response.output_item.done", output_index=index, item=call),
        ]
    return chunks


def _text_config(body: ResponsesRequest) -> dict[str, Any]:
    text = body.text
    text_format = None if text is None else text.format
    return {"format": {"type": "text"} if text_format is None
            else text_format.model_dump(by_alias=True, exclude_none=True),
            "verbosity": "medium" if text is None or text.verbosity is None
            else text.verbosity}


def _tool_choice(body: ResponsesRequest) -> str | dict[str, Any]:
    choice = body.tool_choice
    if choice is None:
        return "auto"
    return choice if isinstance(choice, str) else {"type": "function", "name": choice.name}
