"""The server's OpenAPI document: response bodies, error responses and this server's limits.

Handlers build their responses as plain dicts (cheaper than validating each one); the models
here describe those dicts for the schema, and the schema fuzz test checks that every response
matches them. `openapi_document` adds what FastAPI cannot infer: the OpenAI error body for
every status the server answers with (400, never FastAPI's 422), the SSE content of streams,
the bearer-token scheme when an API key is set, the X-Request-Id header of every response, and
the limits that depend on the running engine (context length, vocabulary) and on the server's
settings (`n`, `max_tokens`, `stop`).
"""

from __future__ import annotations

from typing import Any, Literal

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, ConfigDict, Field

from engine.entrypoints.openai.request_id import MAX_REQUEST_ID_CHARS
from engine.entrypoints.openai.serving import ServerSettings


class _Documented(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ErrorDetail(_Documented):
    message: str
    type: str = Field(description="invalid_request_error, rate_limit_error or server_error")
    param: str | None = Field(description="The request field the error concerns, if one.")
    code: str | None = Field(description="A machine-readable reason, e.g. context_length_"
                                         "exceeded, limit_exceeded, queue_full, engine_dead.")


class ErrorResponse(_Documented):
    """Every error, in OpenAI's format."""

    error: ErrorDetail


class PromptTokensDetails(_Documented):
    cached_tokens: int = Field(description="Prompt tokens whose KV came from the prefix "
                                           "cache or the job's pin.")


class Usage(_Documented):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class CompletionLogprobs(_Documented):
    tokens: list[str]
    token_logprobs: list[float | None] = Field(description="null for the first token of an "
                                                           "echoed prompt.")
    top_logprobs: list[dict[str, float] | None] = Field(description="null for the first "
                                                                    "token of an echoed "
                                                                    "prompt.")
    text_offset: list[int]


StopReason = str | int | None


class CompletionChoice(_Documented):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None
    stop_reason: StopReason = Field(description="The stop string or token id that ended it.")
    prompt_token_ids: list[int] | None = Field(None, description="With return_token_ids.")
    token_ids: list[int] | None = Field(None, description="With return_token_ids.")


class CompletionResponse(_Documented):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class FunctionCallOut(_Documented):
    name: str
    arguments: str = Field(description="The arguments, as a JSON string.")


class ToolCallOut(_Documented):
    id: str
    type: Literal["function"]
    function: FunctionCallOut


class AssistantMessage(_Documented):
    role: Literal["assistant"]
    content: str | None
    tool_calls: list[ToolCallOut] | None = None


class TokenLogprob(_Documented):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(TokenLogprob):
    top_logprobs: list[TokenLogprob]


class ChatLogprobs(_Documented):
    content: list[ChatTokenLogprob]


class ChatChoice(_Documented):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: str | None = Field(description="stop, length, tool_calls or abort.")
    stop_reason: StopReason
    token_ids: list[int] | None = Field(None, description="With return_token_ids.")


class ChatCompletionResponse(_Documented):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_token_ids: list[int] | None = Field(None, description="With return_token_ids.")


class ModelCard(_Documented):
    """OpenAI's model object, with Anthropic's fields (`type`, `display_name`, `created_at`)
    for its clients."""

    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    root: str = Field(description="The model directory (or tiny) the engine loaded.")
    max_model_len: int
    type: Literal["model"]
    display_name: str
    created_at: str = Field(description="`created` as an RFC 3339 time.")


class ModelList(_Documented):
    """OpenAI's list, with Anthropic's page fields."""

    object: Literal["list"]
    data: list[ModelCard]
    has_more: bool
    first_id: str
    last_id: str


class VersionInfo(_Documented):
    version: str


class PinInfo(_Documented):
    request_id: str = Field(description="The turn whose KV the pin holds.")
    num_blocks: int
    ttl_s: float
    remaining_ttl_s: float
    source: Literal["policy", "client"] = Field(
        description="Who asked for the pin: the scheduling policy, or the client's "
                    "`cache_control` breakpoint (`/v1/messages`).")


class JobInfo(_Documented):
    id: str
    object: Literal["job"]
    num_unfinished_requests: int
    pin: PinInfo | None
    policy: dict[str, Any] | None = Field(
        description="The scheduling policy's books on the job (turns, pins by release "
                    "reason, last TTL and tool); null when the policy keeps none.")


class JobDeleted(_Documented):
    id: str
    object: Literal["job"]
    deleted: Literal[True]
    released_pin: bool


class ResponseOutputText(_Documented):
    type: Literal["output_text"]
    text: str
    annotations: list[dict[str, Any]] = Field(description="Always empty.")
    logprobs: list[ChatTokenLogprob] = Field(
        description="With include message.output_text.logprobs: the generated tokens'.")


class ResponseOutputMessage(_Documented):
    id: str
    type: Literal["message"]
    status: Literal["in_progress", "completed", "incomplete"]
    role: Literal["assistant"]
    content: list[ResponseOutputText]


class ResponseFunctionCall(_Documented):
    id: str
    type: Literal["function_call"]
    status: Literal["in_progress", "completed", "incomplete"]
    call_id: str
    name: str
    arguments: str = Field(description="The arguments, as a JSON string.")


class ResponseFunctionTool(_Documented):
    type: Literal["function"]
    name: str
    description: str | None
    parameters: dict[str, Any] | None
    strict: bool | None


class ResponseNamedFunction(_Documented):
    type: Literal["function"]
    name: str


class ResponseTextConfig(_Documented):
    format: dict[str, Any] = Field(description="text, json_object or json_schema, as given.")
    verbosity: str


class ResponseReasoning(_Documented):
    effort: str | None
    summary: str | None


class ResponseErrorInfo(_Documented):
    code: str = Field(description="server_error or invalid_prompt.")
    message: str


class ResponseIncompleteDetails(_Documented):
    reason: Literal["max_output_tokens"]


class ResponseInputTokensDetails(_Documented):
    cached_tokens: int = Field(description="Input tokens whose KV came from the prefix cache "
                                           "or the job's pin.")
    cache_write_tokens: int = Field(description="Always 0.")


class ResponseOutputTokensDetails(_Documented):
    reasoning_tokens: int = Field(description="Always 0.")


class ResponseUsage(_Documented):
    input_tokens: int
    input_tokens_details: ResponseInputTokensDetails
    output_tokens: int
    output_tokens_details: ResponseOutputTokensDetails
    total_tokens: int


class ResponseObject(_Documented):
    """A response of the Responses API (POST /v1/responses, GET /v1/responses/{id})."""

    id: str
    object: Literal["response"]
    created_at: int
    status: Literal["in_progress", "completed", "incomplete", "failed"]
    background: bool
    error: ResponseErrorInfo | None
    completed_at: int | None
    incomplete_details: ResponseIncompleteDetails | None
    instructions: str | None
    max_output_tokens: int | None
    max_tool_calls: int | None
    model: str
    output: list[ResponseOutputMessage | ResponseFunctionCall]
    parallel_tool_calls: bool
    previous_response_id: str | None
    reasoning: ResponseReasoning
    service_tier: str
    store: bool
    temperature: float
    text: ResponseTextConfig
    tool_choice: str | ResponseNamedFunction
    tools: list[ResponseFunctionTool]
    top_logprobs: int
    top_p: float
    truncation: str
    usage: ResponseUsage | None
    user: str | None
    safety_identifier: str | None
    metadata: dict[str, str]
    prompt_cache_key: str | None
    job_id: str | None = Field(description="The job this response is a turn of (the first "
                                           "response's id for a chain of stored responses, "
                                           "or the request's job_id).")


class ResponseDeleted(_Documented):
    id: str
    object: Literal["response"]
    deleted: Literal[True]


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """The `responses` entry documenting these error statuses with the OpenAI error body."""
    return {status: {"model": ErrorResponse, "description": _ERROR_DESCRIPTIONS[status]}
            for status in statuses}


_ERROR_DESCRIPTIONS = {
    400: "Invalid request (the message and param say what is wrong).",
    404: "No such model, job or stored response.",
    405: "Method not allowed.",
    413: "The request body is over the server's limit.",
    429: "The waiting queue is full, or this client holds its share of request bodies or "
         "preparations; retry after Retry-After seconds (a tenant that sends a body again "
         "sooner may get its refusal for the body that much later).",
    499: "The client disconnected before the response.",
    500: "Internal server error.",
    503: "The engine is not running, the server is draining, or it holds as many request "
         "bodies as it may (then with Retry-After, and as late as a 429 for the body).",
}

SSE_RESPONSE = {"text/event-stream": {"schema": {
    "description": "With stream=true, Server-Sent Events (this schema describes one): each "
                   "`data` is a chunk of the completion as JSON, or an error body when the "
                   "request fails after the stream started, and the last is `[DONE]`.",
    "type": "object",
    "required": ["data"],
    "properties": {"data": {"type": "string"}},
}}}

RESPONSE_EVENTS = {"text/event-stream": {"schema": {
    "description": "With stream=true, Server-Sent Events (this schema describes one): `event` "
                   "names its type and `data` holds it as JSON (`type`, `sequence_number`, "
                   "...): response.created and response.in_progress, then the output items "
                   "with their deltas, and last response.completed, response.incomplete or "
                   "response.failed (with the response's `error`).",
    "type": "object",
    "required": ["event", "data"],
    "properties": {"event": {"type": "string"}, "data": {"type": "string"}},
}}}


def openapi_document(app: FastAPI, settings: ServerSettings, *, max_model_len: int,
                     vocab_size: int) -> dict[str, Any]:
    """The schema of `app` as this server runs it (see the module docstring)."""
    document = get_openapi(title=app.title, version=app.version, routes=app.routes,
                           description=_DESCRIPTION)
    for operations in document["paths"].values():
        for operation in operations.values():
            operation["responses"].pop("422", None)
            if settings.tenants is not None and operation["operationId"] != "health":
                operation["security"] = [{"bearer": []}]
                operation["responses"]["401"] = _error_reference(
                    "A valid API key is required (Authorization: Bearer <key>).")
            for response in operation["responses"].values():
                response.setdefault("headers", {})["X-Request-Id"] = _REQUEST_ID_HEADER
    schemas = document["components"]["schemas"]
    for name in ("HTTPValidationError", "ValidationError"):
        schemas.pop(name, None)
    if settings.tenants is not None:
        document["components"]["securitySchemes"] = {"bearer": {"type": "http",
                                                                "scheme": "bearer"}}
    _add_limits(schemas, settings, max_model_len=max_model_len, vocab_size=vocab_size)
    return document


_DESCRIPTION = (
    "An OpenAI-compatible server for multi-turn agent jobs. Generation requests may name "
    "the agent job they are a turn of (`job_id`, `is_last_step`, `tool_name`, in the body or "
    "as the X-Job-Id, X-Job-Last-Step and X-Tool-Name headers); the engine then keeps the "
    "job's KV cache pinned across the tool call."
)


_REQUEST_ID_HEADER = {
    "description": "The request's id: the client's X-Request-Id when it is 1 to "
                   f"{MAX_REQUEST_ID_CHARS} visible ASCII characters, else one the server made.",
    "required": True,
    "schema": {"type": "string", "minLength": 1, "maxLength": MAX_REQUEST_ID_CHARS},
}


def _error_reference(description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {
        "schema": {"$ref": "#/components/schemas/ErrorResponse"}}}}


def _add_limits(schemas: dict[str, Any], settings: ServerSettings, *, max_model_len: int,
                vocab_size: int) -> None:
    max_prompt_tokens = min(settings.max_prompt_tokens or max_model_len, max_model_len - 1)
    max_output_tokens = min(settings.max_output_tokens or max_model_len, max_model_len - 1)
    for name in ("CompletionRequest", "ChatCompletionRequest", "ResponsesRequest"):
        properties = schemas[name]["properties"]
        for field in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
            if field in properties:
                _set_in_variants(properties[field], "integer", maximum=max_output_tokens)
        if "n" in properties:  # OpenAI's sampling fields (`SamplingFields`)
            _set_in_variants(properties["n"], "integer", maximum=settings.max_n)
            _set_in_variants(properties["stop"], "array", maxItems=settings.max_stop_strings)
        _set_in_items(properties["stop_token_ids"], maximum=vocab_size - 1)
        _set_in_variants(properties["stop_token_ids"], "array",
                         maxItems=settings.max_stop_token_ids)
    prompt = schemas["CompletionRequest"]["properties"]["prompt"]
    for variant in prompt["anyOf"]:
        items = variant.get("items", {})
        if items.get("type") == "integer":
            items["maximum"] = vocab_size - 1
            variant["maxItems"] = max_prompt_tokens
        elif items.get("type") == "array":
            items["items"]["maximum"] = vocab_size - 1
            items["maxItems"] = max_prompt_tokens
            variant["maxItems"] = settings.max_prompts
        elif items.get("type") == "string":
            variant["maxItems"] = settings.max_prompts


def _set_in_variants(schema: dict[str, Any], kind: str, **constraints: Any) -> None:
    for variant in schema.get("anyOf", [schema]):
        if variant.get("type") == kind:
            variant.update(constraints)


def _set_in_items(schema: dict[str, Any], **constraints: Any) -> None:
    for variant in schema.get("anyOf", [schema]):
        if variant.get("type") == "array":
            variant["items"].update(constraints)
