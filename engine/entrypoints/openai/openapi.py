"""The server's OpenAPI document: response bodies, error responses and this server's limits.

Handlers build their responses as plain dicts (cheaper than validating each one); the models
here describe those dicts for the schema, and the schema fuzz test checks that every response
matches them. `openapi_document` adds what FastAPI cannot infer: the OpenAI error body for
every status the server answers with (400, never FastAPI's 422), the SSE content of streams,
the bearer-token scheme when an API key is set, and the limits that depend on the running
engine (context length, vocabulary) and on the server's settings (`n`, `max_tokens`, `stop`).
"""

from __future__ import annotations

from typing import Any, Literal

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, ConfigDict, Field

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
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
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
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    root: str = Field(description="The model directory (or tiny) the engine loaded.")
    max_model_len: int


class ModelList(_Documented):
    object: Literal["list"]
    data: list[ModelCard]


class VersionInfo(_Documented):
    version: str


class PinInfo(_Documented):
    request_id: str = Field(description="The turn whose KV the pin holds.")
    num_blocks: int
    ttl_s: float
    remaining_ttl_s: float


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


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """The `responses` entry documenting these error statuses with the OpenAI error body."""
    return {status: {"model": ErrorResponse, "description": _ERROR_DESCRIPTIONS[status]}
            for status in statuses}


_ERROR_DESCRIPTIONS = {
    400: "Invalid request (the message and param say what is wrong).",
    404: "No such model or job.",
    405: "Method not allowed.",
    413: "The request body is over the server's limit.",
    429: "The waiting queue is full; retry after Retry-After seconds.",
    499: "The client disconnected before the response.",
    500: "Internal server error.",
    503: "The engine is not running.",
}

SSE_RESPONSE = {"text/event-stream": {"schema": {
    "description": "With stream=true, Server-Sent Events (this schema describes one): each "
                   "`data` is a chunk of the completion as JSON, or an error body when the "
                   "request fails after the stream started, and the last is `[DONE]`.",
    "type": "object",
    "required": ["data"],
    "properties": {"data": {"type": "string"}},
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


def _error_reference(description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {
        "schema": {"$ref": "#/components/schemas/ErrorResponse"}}}}


def _add_limits(schemas: dict[str, Any], settings: ServerSettings, *, max_model_len: int,
                vocab_size: int) -> None:
    max_prompt_tokens = min(settings.max_prompt_tokens or max_model_len, max_model_len - 1)
    max_output_tokens = min(settings.max_output_tokens or max_model_len, max_model_len - 1)
    for name in ("CompletionRequest", "ChatCompletionRequest"):
        properties = schemas[name]["properties"]
        properties["n"]["maximum"] = settings.max_n
        for field in ("max_tokens", "max_completion_tokens"):
            if field in properties:
                _set_in_variants(properties[field], "integer", maximum=max_output_tokens)
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
