"""Request bodies of the OpenAI-compatible API, as pydantic models (FastAPI validates them).

These are HTTP schemas, separate from the engine's wire types. Unknown fields are ignored, as
OpenAI clients send fields this engine does not use. Beyond OpenAI's fields, requests accept
vLLM's sampling extensions (`top_k`, `min_p`, `ignore_eos`, `min_tokens`, `return_token_ids`,
`cache_salt`, ...) and the job extension (`job_id`, `is_last_step`, `tool_name` / `this_func_call`).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from engine.sampling_params import MAX_INT32, MAX_LOGPROBS, MAX_SEED

MAX_ID_CHARS = 256
MAX_CACHE_SALT_CHARS = 1024

JobId = Annotated[str, Field(min_length=1, max_length=MAX_ID_CHARS)]


class JobFields(BaseModel):
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


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    include_usage: bool = False


Count = Annotated[int, Field(ge=0, le=MAX_INT32)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]
StopString = Annotated[str, Field(min_length=1)]
TokenId = Annotated[int, Field(ge=0)]
Int64 = Annotated[int, Field(ge=-MAX_SEED - 1, le=MAX_SEED)]


class SamplingFields(JobFields):
    """Fields shared by completions and chat completions. Types are strict (no strings for
    numbers); this server's limits on `n`, `max_tokens` and `stop` are in its OpenAPI
    document."""

    model_config = ConfigDict(extra="ignore", strict=True)

    model: str | None = None
    n: Annotated[int, Field(ge=1)] = 1
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Count | None = Field(None, description="0 disables top-k.")
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    seed: Int64 | None = None
    stop: StopString | list[StopString] | None = None
    stop_token_ids: list[TokenId] | None = None
    min_tokens: Count = 0
    ignore_eos: bool = False
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0, le=2.0)] | None = None
    logit_bias: dict[str, float] | None = Field(None, description="Not supported: must be "
                                                               "empty or omitted.")
    stream: bool = False
    stream_options: StreamOptions | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    return_token_ids: bool = Field(
        False, description="Also return the prompt's and each choice's token ids."
    )
    priority: Int64 = Field(0, description="Used by the priority policy: lower runs first.")
    cache_salt: Annotated[str, Field(min_length=1, max_length=MAX_CACHE_SALT_CHARS)] | None = (
        Field(None, description="Prompts reuse cached KV only from requests with the same "
                                "salt (and, on a server with API keys, the same tenant)."))
    user: str | None = None


MaxTokens = Annotated[int, Field(ge=1)]
Logprobs = Annotated[int, Field(ge=0, le=MAX_LOGPROBS)]
NonEmptyText = Annotated[str, Field(min_length=1)]
TokenIds = Annotated[list[TokenId], Field(min_length=1)]


class CompletionRequest(SamplingFields):
    """POST /v1/completions: a text or token-id prompt (or a batch of them)."""

    prompt: (NonEmptyText | Annotated[list[NonEmptyText], Field(min_length=1)] | TokenIds
             | Annotated[list[TokenIds], Field(min_length=1)])
    max_tokens: MaxTokens | None = Field(16, description="null: up to the context length.")
    logprobs: Logprobs | None = None
    echo: bool = Field(False, description="Not supported: must be false.")
    suffix: str | None = Field(None, description="Not supported: must be empty or omitted.")
    best_of: int | None = Field(None, description="Must equal n, or be omitted.")


class TextContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["text"]
    text: str


class FunctionCallIn(BaseModel):
    name: str
    arguments: str | dict[str, Any]


class ToolCallIn(BaseModel):
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


class ChatTool(BaseModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"] = "function"
    function: NamedFunction


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: str


class ChatCompletionRequest(SamplingFields):
    """POST /v1/chat/completions: a conversation rendered by the model's chat template."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: MaxTokens | None = Field(None, description="Deprecated by OpenAI in favour "
                                                           "of max_completion_tokens.")
    max_completion_tokens: MaxTokens | None = None
    logprobs: bool = False
    top_logprobs: Logprobs | None = Field(None, description="Needs logprobs: true.")
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
