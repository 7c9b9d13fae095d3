"""Request bodies of the OpenAI-compatible API, as pydantic models (FastAPI validates them).

These are HTTP schemas, separate from the engine's wire types. Unknown fields are ignored, as
OpenAI clients send fields this engine does not use. Beyond OpenAI's fields, requests accept
vLLM's sampling extensions (`top_k`, `min_p`, `ignore_eos`, `min_tokens`, `return_token_ids`,
...) and the job extension (`job_id`, `is_last_step`, `tool_name` / `this_func_call`).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

MAX_ID_CHARS = 256

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
    include_usage: bool = False


class SamplingFields(JobFields):
    """Fields shared by completions and chat completions."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    return_token_ids: bool = Field(
        False, description="Also return the prompt's and each choice's token ids."
    )
    priority: int = 0
    user: str | None = None


class CompletionRequest(SamplingFields):
    """POST /v1/completions: a text or token-id prompt (or a batch of them)."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


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
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
