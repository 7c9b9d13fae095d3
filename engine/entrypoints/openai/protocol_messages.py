"""The request bodies of the Anthropic Messages API (`POST /v1/messages` and
`POST /v1/messages/count_tokens`), as pydantic models.

Follows `protocol.py`'s conventions: unknown fields are ignored, types are strict, nulls mean
"not given". Content blocks are the text subset of Anthropic's: `text`, `tool_use`,
`tool_result` (its content a string or text blocks) and `thinking` / `redacted_thinking`
(accepted, not rendered: this server never outputs them); images, documents and other block
types are refused naming the field. Tools are custom tools (`name`, `description`,
`input_schema`); Anthropic's server tools are refused. `cache_control` breakpoints
(`{"type": "ephemeral", "ttl": "5m" | "1h"}`) are taken on system blocks, tools and message
blocks, and at the top level for the last block of the last message. Beyond Anthropic's
fields the requests take this server's sampling and job extensions (`GenerationFields`:
`top_k`, `seed`, `min_p`, `job_id`, `cache_salt`, ...); OpenAI's `n` and `stop` are refused
(`stop_sequences` is this API's name for `stop`), and so is `mcp_servers` (this server runs
no tools). `service_tier` is checked and has one tier here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, ClassVar, Literal

from pydantic import ConfigDict, Discriminator, Field, Tag, field_validator, model_validator

from engine.entrypoints.openai.protocol import (
    MAX_ID_CHARS,
    GenerationFields,
    NullMeansDefault,
    Sampling,
    StopString,
)

# Anthropic's TTLs of a cache breakpoint, in seconds.
CACHE_TTL_S = {"5m": 300.0, "1h": 3600.0}
CacheTTL = Literal["5m", "1h"]
Id = Annotated[str, Field(min_length=1, max_length=MAX_ID_CHARS)]
ToolName = Annotated[str, Field(min_length=1, max_length=MAX_ID_CHARS)]
# A tool's name as Anthropic takes it where the tool is defined or chosen.
DefinedToolName = Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,128}$")]


class _Model(NullMeansDefault):
    model_config = ConfigDict(extra="ignore", strict=True)


class CacheControl(_Model):
    """A breakpoint: keep the prompt's KV up to and including this block for `ttl`."""

    type: Literal["ephemeral"]
    ttl: CacheTTL = "5m"

    @property
    def ttl_s(self) -> float:
        return CACHE_TTL_S[self.ttl]


class TextBlock(_Model):
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None


class ToolUseBlock(_Model):
    """A tool call the model made, sent back in an assistant message."""

    type: Literal["tool_use"]
    id: Id
    name: ToolName
    input: dict[str, Any]
    cache_control: CacheControl | None = None


def _json_kind(value: Any) -> str:
    return "str" if isinstance(value, str) else "list"


# A string or a list of text blocks, tagged so that a bad value is reported against one
# alternative, not each.
TextOrTextBlocks = Annotated[
    Annotated[str, Tag("str")] | Annotated[list[TextBlock], Tag("list")],
    Discriminator(_json_kind, custom_error_type="invalid_type",
                  custom_error_message="must be a string or a list of text blocks"),
]


class ToolResultBlock(_Model):
    """The result of a tool call, answering the `tool_use` block of the same id."""

    type: Literal["tool_result"]
    tool_use_id: Id
    content: TextOrTextBlocks = ""
    is_error: bool = False
    cache_control: CacheControl | None = None

    @property
    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(block.text for block in self.content)


class ThinkingBlock(_Model):
    """Reasoning a model showed in an earlier turn: accepted, and left out of the prompt."""

    type: Literal["thinking", "redacted_thinking"]
    cache_control: CacheControl | None = None


ContentBlock = Annotated[TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock,
                         Field(discriminator="type")]
ContentBlocks = Annotated[
    Annotated[str, Tag("str")] | Annotated[list[ContentBlock], Tag("list")],
    Discriminator(_json_kind, custom_error_type="invalid_type",
                  custom_error_message="must be a string or a list of content blocks"),
]


class Message(_Model):
    role: Literal["user", "assistant"]
    content: ContentBlocks

    @property
    def blocks(self) -> list[TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock]:
        """The content as blocks (a string is one text block)."""
        if isinstance(self.content, str):
            return [TextBlock(type="text", text=self.content)]
        return list(self.content)


class Tool(_Model):
    """A custom tool: the model calls it with an input matching `input_schema`. Anthropic's
    own tool types (its server tools, `web_search_*`, and its schema-less client tools,
    `bash_*`, `text_editor_*`) are refused with a message saying so."""

    type: Literal["custom"] | None = None

    @model_validator(mode="before")
    @classmethod
    def _refuse_anthropic_tool_types(cls, data: Any) -> Any:
        kind = data.get("type") if isinstance(data, dict) else None
        if isinstance(kind, str) and kind != "custom":
            raise ValueError(
                f"tools of type {kind!r} are Anthropic's own, which this server does not "
                "run; define the tool as a custom tool (name, description, input_schema)")
        return data
    name: DefinedToolName
    description: str | None = None
    input_schema: dict[str, Any]
    strict: bool | None = Field(None, description="The input takes only the schema's named "
                                                  "properties (a forced call's grammar).")
    cache_control: CacheControl | None = None

    @field_validator("input_schema")
    @classmethod
    def _schema_of_an_object(cls, schema: dict[str, Any]) -> dict[str, Any]:
        if schema.get("type") != "object":
            raise ValueError("the input_schema of a tool must have type 'object'")
        return schema


class ToolChoiceAuto(_Model):
    type: Literal["auto"]
    disable_parallel_tool_use: bool = False


class ToolChoiceAny(_Model):
    type: Literal["any"]
    disable_parallel_tool_use: bool = False


class ToolChoiceTool(_Model):
    type: Literal["tool"]
    name: DefinedToolName
    disable_parallel_tool_use: bool = False


class ToolChoiceNone(_Model):
    type: Literal["none"]


ToolChoice = Annotated[ToolChoiceAuto | ToolChoiceAny | ToolChoiceTool | ToolChoiceNone,
                       Field(discriminator="type")]


class Metadata(_Model):
    user_id: Annotated[str, Field(max_length=MAX_ID_CHARS)] | None = None


class MessagesFields(GenerationFields):
    """What both endpoints read: the model, the conversation, the system prompt and tools."""

    conversation_field: ClassVar[str | None] = "messages"

    model: Annotated[str, Field(min_length=1)]  # type: ignore[assignment]
    messages: Annotated[list[Message], Field(min_length=1)]
    system: TextOrTextBlocks | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    cache_control: CacheControl | None = Field(
        None, description="A breakpoint on the last block of the last message.")


class MessagesCountTokensRequest(MessagesFields):
    """POST /v1/messages/count_tokens: how many input tokens the same request would take."""


class JSONOutputFormat(_Model):
    """Structured output: the answer is JSON that validates against `schema`."""

    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(_Model):
    """`format` constrains the answer; `effort` is accepted and has no effect here."""

    format: JSONOutputFormat | None = None
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None


class MessagesRequest(MessagesFields):
    """POST /v1/messages: the next assistant message of a conversation. `thinking` (extended
    thinking) is accepted and has no effect: the served models answer without it."""

    refused_fields: ClassVar[Mapping[str, str]] = {
        "n": "a message has one output: n is not a field of the Messages API",
        "stop": "stop is this API's stop_sequences: send stop_sequences",
        "mcp_servers": "MCP servers are not supported by this server: define their tools "
                       "as custom tools and run them in the client"}

    max_tokens: Annotated[int, Field(ge=1)]
    stop_sequences: list[StopString] | None = None
    metadata: Metadata | None = None
    service_tier: Literal["auto", "standard_only"] | None = None  # one tier here
    output_config: OutputConfig | None = None
    temperature: Annotated[float, Field(ge=0.0, le=1.0)] | None = None  # Anthropic's range
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None

    def sampling(self) -> Sampling:
        return Sampling(temperature=self.temperature, top_p=self.top_p,
                        stop=tuple(self.stop_sequences or ()))
