"""The request body of the OpenAI Responses API (`POST /v1/responses`), as pydantic models.

Follows `protocol.py`'s conventions: unknown fields are ignored, types are strict, nulls mean
"not given". Beside its own fields the request takes this server's sampling and job
extensions (`GenerationFields`: `top_k`, `seed`, `cache_salt`, `job_id`, ...); chat's `n` and
`stop` are refused. Input items are the
text subset of OpenAI's: messages (text parts only), `function_call`, `function_call_output`
and `reasoning` (accepted, not rendered); other item, content-part and tool types are
rejected naming the field.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, ClassVar, Literal

from pydantic import ConfigDict, Discriminator, Field, Tag

from engine.entrypoints.openai.protocol import (
    MAX_ID_CHARS,
    GenerationFields,
    Logprobs,
    MaxTokens,
    NullMeansDefault,
    Sampling,
)

# OpenAI's limits on `metadata`: pairs, key and value lengths.
MAX_METADATA_PAIRS = 16
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512
# `include` values this server honours: logprobs of the output text, and reasoning's
# encrypted content (vacuously: this server never outputs reasoning items).
LOGPROBS_INCLUDE = "message.output_text.logprobs"
SUPPORTED_INCLUDES = frozenset({LOGPROBS_INCLUDE, "reasoning.encrypted_content"})

ItemStatus = Literal["in_progress", "completed", "incomplete"]
Id = Annotated[str, Field(min_length=1, max_length=MAX_ID_CHARS)]
FunctionName = Annotated[str, Field(min_length=1, max_length=MAX_ID_CHARS)]


class _Model(NullMeansDefault):
    model_config = ConfigDict(extra="ignore", strict=True)


class InputTextPart(_Model):
    type: Literal["input_text"]
    text: str


class OutputTextPart(_Model):
    """Output text sent back as input (its annotations and logprobs are ignored)."""

    type: Literal["output_text"]
    text: str


class RefusalPart(_Model):
    type: Literal["refusal"]
    refusal: str


ContentPart = Annotated[InputTextPart | OutputTextPart | RefusalPart,
                        Field(discriminator="type")]


def _json_kind(value: Any) -> str:
    if isinstance(value, str):
        return "str"
    return "list" if isinstance(value, list) else "dict"


def _text_or(items: Any, message: str) -> Any:
    """A string or a list of `items`. Tagged so that a bad value is reported against one
    alternative, not each; error messages leave the tags (`str`, `list`) out of the field's
    path."""
    return Annotated[
        Annotated[str, Tag("str")] | Annotated[list[items], Tag("list")],
        Discriminator(_json_kind, custom_error_type="invalid_type",
                      custom_error_message=message),
    ]


TextOrParts = _text_or(ContentPart, "must be a string or a list of text content parts")
TextOrTextParts = _text_or(InputTextPart, "must be a string or a list of input_text parts")


def part_text(part: InputTextPart | OutputTextPart | RefusalPart) -> str:
    return part.refusal if isinstance(part, RefusalPart) else part.text


def content_text(content: str | list[Any]) -> str:
    """The text of a message's content: a string, or its parts' texts joined."""
    if isinstance(content, str):
        return content
    return "".join(part_text(part) for part in content)


class MessageItem(_Model):
    """A message of the conversation (`type` may be omitted, as OpenAI's easy input)."""

    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: TextOrParts
    id: str | None = None
    status: ItemStatus | None = None


class FunctionCallItem(_Model):
    """A function call the model made (sent back as input for the next turn)."""

    type: Literal["function_call"]
    call_id: Id
    name: FunctionName
    arguments: str
    id: str | None = None
    status: ItemStatus | None = None


class FunctionCallOutputItem(_Model):
    """The result of a function call, answering the call with the same `call_id`."""

    type: Literal["function_call_output"]
    call_id: Id
    output: TextOrTextParts
    id: str | None = None
    status: ItemStatus | None = None


class ReasoningItem(_Model):
    """A reasoning item of another model's output: accepted and left out of the prompt."""

    type: Literal["reasoning"]
    id: str | None = None


def _item_tag(value: Any) -> str | None:
    kind = value.get("type", "message") if isinstance(value, dict) else getattr(
        value, "type", None)
    return f"{kind} item" if isinstance(kind, str) else None


InputItem = Annotated[
    Annotated[MessageItem, Tag("message item")]
    | Annotated[FunctionCallItem, Tag("function_call item")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output item")]
    | Annotated[ReasoningItem, Tag("reasoning item")],
    Discriminator(_item_tag, custom_error_type="invalid_item_type",
                  custom_error_message="unsupported item type (this server takes message, "
                                       "function_call, function_call_output and reasoning "
                                       "items)"),
]
ConversationItem = MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem


class FunctionTool(_Model):
    """A function the model may call (the only tool type this server offers)."""

    type: Literal["function"]
    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionToolChoice(_Model):
    type: Literal["function"]
    name: FunctionName


class TextFormatText(_Model):
    type: Literal["text"]


class TextFormatJSONObject(_Model):
    type: Literal["json_object"]


class TextFormatJSONSchema(_Model):
    model_config = ConfigDict(extra="ignore", strict=True, populate_by_name=True)

    type: Literal["json_schema"]
    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")]
    schema_: dict[str, Any] = Field(alias="schema")
    description: str | None = None
    strict: bool | None = None


TextFormat = Annotated[TextFormatText | TextFormatJSONObject | TextFormatJSONSchema,
                       Field(discriminator="type")]


class TextConfig(_Model):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


Metadata = Annotated[
    dict[Annotated[str, Field(max_length=MAX_METADATA_KEY_CHARS)],
         Annotated[str, Field(max_length=MAX_METADATA_VALUE_CHARS)]],
    Field(max_length=MAX_METADATA_PAIRS),
]
Input = _text_or(InputItem, "must be a string or a list of input items")
ToolChoice = Annotated[
    Annotated[Literal["none", "auto", "required"], Tag("str")]
    | Annotated[FunctionToolChoice, Tag("dict")],
    Discriminator(_json_kind, custom_error_type="invalid_type",
                  custom_error_message="must be none, auto, required or a function "
                                       '({"type": "function", "name": ...})'),
]


class ResponsesRequest(GenerationFields):
    """POST /v1/responses: a conversation as input items, optionally continuing a stored
    response (`previous_response_id`); see the module docstring for what is supported."""

    conversation_field: ClassVar[str | None] = "input"
    refused_fields: ClassVar[Mapping[str, str]] = {
        "n": "a response has one output: n is not a field of the Responses API",
        "stop": "stop is not a field of the Responses API (it is chat's)"}

    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    user: str | None = None

    input: Input
    instructions: str | None = Field(None, description="A system message before the input "
                                                       "(not carried to later responses).")
    max_output_tokens: MaxTokens | None = None
    previous_response_id: Id | None = Field(
        None, description="Continue a stored response: its input and output come first.")
    store: bool | None = Field(None, description="Keep the response for previous_response_id "
                                                 "and GET (default true).")
    metadata: Metadata | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = Field(
        None, description="false: only the first function call of the output is kept.")
    text: TextConfig | None = None
    reasoning: dict[str, Any] | None = Field(None, description="Accepted and ignored.")
    include: list[str] | None = Field(
        None, description=f"Supported: {', '.join(sorted(SUPPORTED_INCLUDES))}.")
    top_logprobs: Logprobs | None = Field(
        None, description=f"Alternatives per token, with include {LOGPROBS_INCLUDE}.")
    truncation: Literal["auto", "disabled"] | None = Field(
        None, description="Only disabled is supported.")
    background: bool | None = Field(None, description="Not supported: must be false.")
    conversation: str | dict[str, Any] | None = Field(
        None, description="Not supported: must be omitted.")
    prompt: dict[str, Any] | None = Field(None, description="Not supported: must be omitted.")
    max_tool_calls: Annotated[int, Field(ge=1)] | None = Field(
        None, description="Accepted (it bounds built-in tools, which this server has none "
                          "of).")
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_retention: str | None = None

    def sampling(self) -> Sampling:
        return Sampling(temperature=self.temperature, top_p=self.top_p)
