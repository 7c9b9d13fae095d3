"""Request bodies of the OpenAI-compatible API, as pydantic models (FastAPI validates them).

These are HTTP schemas, separate from the engine's wire types. Unknown fields are ignored, as
OpenAI clients send fields this engine does not use. Beyond OpenAI's fields, requests accept
vLLM's sampling extensions (`top_k`, `min_p`, `ignore_eos`, `min_tokens`, `return_token_ids`,
`cache_salt`, ...) and the job extension (`job_id`, `is_last_step`, `tool_name` / `this_func_call`;
OpenAI's `prompt_cache_key` is taken as the job when no `job_id` is given).
An explicit `null` for an optional field means its default (`NullMeansDefault`).
"""

from __future__ import annotations

import functools
import types
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal, Union, get_args, get_origin

from pydantic import BaseModel, ConfigDict, Field, GetJsonSchemaHandler, model_validator
from pydantic.json_schema import JsonSchemaValue
from pydantic_core import CoreSchema

from engine.entrypoints.openai.body_limits import BodyLimitError, check_counts
from engine.entrypoints.openai.errors import APIError
from engine.entrypoints.openai.unicode_text import lone_surrogate_path
from engine.sampling_params import (
    MAX_INT32,
    MAX_LOGIT_BIAS,
    MAX_LOGIT_BIAS_ENTRIES,
    MAX_LOGPROBS,
    MAX_SEED,
)

MAX_ID_CHARS = 256
MAX_CACHE_SALT_CHARS = 1024

JobId = Annotated[str, Field(min_length=1, max_length=MAX_ID_CHARS)]


class NullMeansDefault(BaseModel):
    """A request model in which an explicit `null` for an optional field means its default,
    as in OpenAI's API and vLLM (clients such as the openai SDK and litellm send `null` for
    fields they leave unset). A field whose type admits None keeps None as its value (for
    `max_tokens` it has a meaning); required fields still reject `null`. The JSON schema marks
    the fields that take `null` this way as nullable."""

    @classmethod
    def null_defaulted_fields(cls) -> frozenset[str]:
        """The fields for which `null` stands for the default."""
        return _null_defaulted_fields(cls)

    @model_validator(mode="before")
    @classmethod
    def _drop_nulls(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        defaulted = cls.null_defaulted_fields()
        return {key: value for key, value in data.items()
                if value is not None or key not in defaulted}

    @classmethod
    def __get_pydantic_json_schema__(cls, core_schema: CoreSchema,
                                     handler: GetJsonSchemaHandler) -> JsonSchemaValue:
        json_schema = handler(core_schema)
        properties = handler.resolve_ref_schema(json_schema).get("properties", {})
        for name in cls.null_defaulted_fields() & properties.keys():
            properties[name] = _nullable(properties[name])
        return json_schema


@functools.cache
def _null_defaulted_fields(model: type[BaseModel]) -> frozenset[str]:
    return frozenset(name for name, field in model.model_fields.items()
                     if not field.is_required() and not _admits_none(field.annotation))


def _admits_none(annotation: Any) -> bool:
    if annotation is None or annotation is types.NoneType:
        return True
    if get_origin(annotation) is Annotated:
        return _admits_none(get_args(annotation)[0])
    if get_origin(annotation) in (Union, types.UnionType):
        return any(_admits_none(member) for member in get_args(annotation))
    return False


_SCHEMA_ANNOTATIONS = ("title", "description", "default", "examples", "deprecated")


def _nullable(schema: JsonSchemaValue) -> JsonSchemaValue:
    """`schema` that also accepts null (annotations such as the default stay outside)."""
    if "anyOf" in schema:
        return {**schema, "anyOf": [*schema["anyOf"], {"type": "null"}]}
    value = {key: item for key, item in schema.items() if key not in _SCHEMA_ANNOTATIONS}
    annotations = {key: item for key, item in schema.items() if key in _SCHEMA_ANNOTATIONS}
    return {"anyOf": [value, {"type": "null"}], **annotations}


class JobFields(NullMeansDefault):
    """The job extension: which agent job a request is a turn of."""

    job_id: JobId | None = Field(
        None, description="The agent job (program) this request is a turn of."
    )
    is_last_step: bool | None = Field(
        None, description="This is the job's last turn: its KV is not pinned afterwards."
    )
    tool_name: JobId | None = Field(
        None, description="The tool the turn is known to call, if the client knows it."
    )
    this_func_call: JobId | None = Field(
        None, description="Alias of tool_name (the name used by the Continuum preview)."
    )
    prompt_cache_key: JobId | None = Field(
        None, description="OpenAI's cache hint: used as the job_id when none is given, so "
                          "requests sharing a key are turns of one job."
    )


class StreamOptions(NullMeansDefault):
    model_config = ConfigDict(extra="ignore", strict=True)

    include_usage: bool = False


Count = Annotated[int, Field(ge=0, le=MAX_INT32)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]
StopString = Annotated[str, Field(min_length=1)]
TokenId = Annotated[int, Field(ge=0)]
Int64 = Annotated[int, Field(ge=-MAX_SEED - 1, le=MAX_SEED)]


class JsonSchemaFormat(BaseModel):
    """OpenAI's `response_format.json_schema`: the schema the output must match."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    name: Annotated[str, Field(min_length=1, max_length=MAX_ID_CHARS)] = "response"
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's `response_format`: `text` (no constraint), any JSON object, or JSON matching
    a schema (enforced by constrained decoding)."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsParams(BaseModel):
    """vLLM's `structured_outputs`: exactly one of these constrains the output."""

    model_config = ConfigDict(extra="forbid")

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: Annotated[list[str], Field(min_length=1)] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class StructuredOutputFields(BaseModel):
    """Fields that constrain the output to a format (`engine/entrypoints/openai/
    structured_outputs.py` turns them into one grammar)."""

    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsParams | None = Field(
        None, description="vLLM's structured outputs: one of json, regex, choice, grammar, "
                          "json_object.")
    guided_json: dict[str, Any] | str | None = Field(
        None, description="Deprecated vLLM form of structured_outputs.json.")
    guided_regex: str | None = Field(None, description="Deprecated vLLM form of "
                                                       "structured_outputs.regex.")
    guided_choice: Annotated[list[str], Field(min_length=1)] | None = Field(
        None, description="Deprecated vLLM form of structured_outputs.choice.")
    guided_grammar: str | None = Field(None, description="Deprecated vLLM form of "
                                                         "structured_outputs.grammar.")


class GenerationFields(JobFields):
    """What every generation API's request takes beside its own fields: the model, streaming,
    and this server's sampling, scheduling and cache extensions (vLLM's names). Each API's
    request declares its own sampling fields and says them in `sampling()`. Types are strict
    (no strings for numbers); this server's limits are in its OpenAPI document.

    `refused_fields`: fields of other APIs that a client may send by mistake and that would
    change the output (`n`, `stop`), refused naming the field, with why, before any field is
    validated."""

    model_config = ConfigDict(extra="ignore", strict=True)

    # The field holding the conversation (chat messages, Responses input items), if any.
    conversation_field: ClassVar[str | None] = None
    refused_fields: ClassVar[Mapping[str, str]] = {}

    @model_validator(mode="before")
    @classmethod
    def _check_raw_body(cls, data: Any) -> Any:
        """Refuses, before any field is validated, a body over the counts of `body_limits`
        (400 `limit_exceeded`; a large body was checked as it was parsed), a body with a
        lone surrogate anywhere (`unicode_text`), and a refused field, naming the field. An
        `APIError`, which passes through pydantic and FastAPI's body parsing unchanged, so
        that `param` names the field."""
        if not isinstance(data, dict):
            return data
        try:
            check_counts(data, cls.conversation_field)
        except BodyLimitError as error:
            raise APIError(400, error.message, param=error.param,
                           code="limit_exceeded") from error
        path = lone_surrogate_path(data)
        if path is not None:
            param = ".".join(path) or None
            raise APIError(400, f"{param or 'the body'}: the text holds a lone UTF-16 "
                                "surrogate, which is not Unicode", param=param)
        for name, why in cls.refused_fields.items():
            if data.get(name) not in (None, []):  # an empty list asks for nothing
                raise APIError(400, why, param=name)
        return data

    model: str | None = None
    stream: bool = False
    top_k: Count | None = Field(None, description="0 disables top-k.")
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    seed: Int64 | None = None
    stop_token_ids: list[TokenId] | None = None
    min_tokens: Count = 0
    ignore_eos: bool = False
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0, le=2.0)] | None = None
    logit_bias: Annotated[
        dict[str, Annotated[float, Field(ge=-MAX_LOGIT_BIAS, le=MAX_LOGIT_BIAS)]],
        Field(max_length=MAX_LOGIT_BIAS_ENTRIES),
    ] | None = Field(None, description=f"Token id (as a string) -> bias in "
                                       f"[-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], added to "
                                       f"the logits before sampling; at most "
                                       f"{MAX_LOGIT_BIAS_ENTRIES} entries.")
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    priority: Int64 = Field(0, description="Used by the priority policy: lower runs first.")
    cache_salt: Annotated[str, Field(min_length=1, max_length=MAX_CACHE_SALT_CHARS)] | None = (
        Field(None, description="Prompts reuse cached KV only from requests with the same "
                                "salt (and, on a server with API keys, the same tenant)."))

    def sampling(self) -> Sampling:
        """The request's own sampling fields, as the engine takes them."""
        return Sampling()


@dataclass(frozen=True)
class Sampling:
    """The sampling fields each API names in its own way: how many outputs (`n`), the
    temperature and nucleus, and the stop strings."""

    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    stop: tuple[str, ...] = ()


class SamplingFields(GenerationFields):
    """OpenAI's sampling fields of completions and chat completions."""

    n: Annotated[int, Field(ge=1)] = 1
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    stop: StopString | list[StopString] | None = None
    stream_options: StreamOptions | None = None
    return_token_ids: bool = Field(
        False, description="Also return the prompt's and each choice's token ids."
    )
    user: str | None = None

    @model_validator(mode="after")
    def _check_stream_options(self) -> SamplingFields:
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options is only allowed when stream is true",
                           param="stream_options")
        return self

    @property
    def includes_usage(self) -> bool:
        """Whether a stream ends with a usage chunk (`stream_options.include_usage`)."""
        return self.stream_options is not None and self.stream_options.include_usage

    def sampling(self) -> Sampling:
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        return Sampling(n=self.n, temperature=self.temperature, top_p=self.top_p, stop=stop)


MaxTokens = Annotated[int, Field(ge=1)]
Logprobs = Annotated[int, Field(ge=0, le=MAX_LOGPROBS)]
NonEmptyText = Annotated[str, Field(min_length=1)]
TokenIds = Annotated[list[TokenId], Field(min_length=1)]


class CompletionRequest(SamplingFields, StructuredOutputFields):
    """POST /v1/completions: a text or token-id prompt (or a batch of them)."""

    prompt: (NonEmptyText | Annotated[list[NonEmptyText], Field(min_length=1)] | TokenIds
             | Annotated[list[TokenIds], Field(min_length=1)])
    max_tokens: Annotated[int, Field(ge=0)] | None = Field(
        16, description="null: up to the context length; 0 only with echo (the prompt alone).")
    logprobs: Logprobs | None = Field(None, description="Top alternatives per token; with "
                                                        "echo, for the prompt's tokens too.")
    echo: bool = Field(False, description="Return the prompt before the completion (and, with "
                                          "logprobs, the prompt tokens' logprobs).")
    suffix: str | None = Field(None, description="Not supported: must be empty or omitted.")
    best_of: int | None = Field(None, description="Must equal n, or be omitted.")


class TextContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["text"]
    text: str


class FunctionCallIn(BaseModel):
    name: str
    arguments: str | dict[str, Any]


class ToolCallIn(NullMeansDefault):
    """A tool call in an assistant message of the conversation so far."""

    model_config = ConfigDict(extra="ignore")

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCallIn


class ChatMessage(BaseModel):
    """One message of a conversation. Only text content is supported."""

    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="allow")

    name: Annotated[str, Field(min_length=1)]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = Field(None, description="OpenAI's strict mode: a constrained call's "
                                                  "arguments take only the named properties.")


class ChatTool(BaseModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"] = "function"
    function: NamedFunction


class ChatCompletionRequest(SamplingFields, StructuredOutputFields):
    """POST /v1/chat/completions: a conversation rendered by the model's chat template."""

    conversation_field: ClassVar[str | None] = "messages"

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: MaxTokens | None = Field(None, description="Deprecated by OpenAI in favour "
                                                           "of max_completion_tokens.")
    max_completion_tokens: MaxTokens | None = None
    logprobs: bool = False
    top_logprobs: Logprobs | None = Field(None, description="Needs logprobs: true.")
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    functions: list[Any] | None = Field(None, description="OpenAI's deprecated form of "
                                        "tools: refused (400); send tools.")
    function_call: Any = Field(None, description="OpenAI's deprecated form of tool_choice: "
                                                 "refused (400); send tool_choice.")
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
