"""What every generation API hands the shared pipeline and gets back from it: its plan of a
generation (`GenerationPlan`), the tools it offers (`ToolOffer`, each API's names for its
fields kept for its errors) and its output constraint (`Constraint`), and one choice's
output as it arrives (`ChoiceOutput`), split into text and, at its end, tool calls.

Chat, the Responses API and the Messages API each build a `ToolOffer` from their own request
model; the offer decides how the output is read for tool calls (`call_format`) and how the
structured-output path constrains it (`structured_outputs.offer_structured_output`). Each
renders `ChoiceOutput` in its own shapes, whole or streamed, so that a streamed response's
text adds up to the whole response's.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from engine.entrypoints.openai.tool_call_stream import StreamingToolCallSplitter
from engine.frontend.request_outputs import CompletionOutput
from engine.structured_output.spec import StructuredOutputKind
from engine.tool_calls import ParsedToolCall, ToolCallFormat, ToolParser


@dataclass(frozen=True)
class OfferedTool:
    """A function the model may call: its name, its parameters' JSON schema (None: any),
    whether it asks for strict mode, and the request field holding its schema, as the
    request's API names it in errors (`tools[0].function.parameters` for chat)."""

    name: str
    parameters: Mapping[str, Any] | None
    strict: bool
    parameters_field: str


@dataclass(frozen=True)
class ForcedTool:
    """A `tool_choice` that names the one function to call."""

    name: str


ToolChoice = Literal["auto", "none", "required"] | ForcedTool


@dataclass(frozen=True)
class ToolOffer:
    """The tools a request offers and how it lets the model call them: `choice` ("auto"
    when the request says nothing; `choice_name`, how the request's API names it in errors,
    if not as chat does) and `parallel` (False: one call at most)."""

    tools: tuple[OfferedTool, ...] = ()
    choice: ToolChoice = "auto"
    parallel: bool = True
    choice_name: str | None = None

    @property
    def enabled(self) -> bool:
        """Whether the output is read for tool calls."""
        return bool(self.tools) and self.choice != "none"

    @property
    def may_constrain(self) -> bool:
        """Whether the offer alone may constrain the output (built off the event loop, where
        a strict tool's schema is checked)."""
        return bool(self.tools) and (self.choice not in ("auto", "none") or not self.parallel)

    @property
    def choice_text(self) -> str:
        """The choice as errors name it."""
        if self.choice_name is not None:
            return self.choice_name
        if isinstance(self.choice, ForcedTool):
            return f"{{function: {self.choice.name!r}}}"
        return repr(self.choice)

    def call_format(self, parser: str) -> ToolCallFormat | None:
        """How the output is read for tool calls with the parser registered as `parser`;
        None when tools are off."""
        if not self.enabled:
            return None
        return ToolCallFormat(parser=parser, tool_names=tuple(tool.name for tool in self.tools),
                              parallel=self.parallel)


@dataclass(frozen=True)
class Constraint:
    """One constraint field of a request: its name, what it asks for, its grammar, and the
    JSON schema when it asks for JSON (a JSON constraint combines with tools)."""

    field: str
    kind: StructuredOutputKind
    grammar: str
    schema: Mapping[str, Any] | None = None


@dataclass(frozen=True)
class GenerationPlan:
    """What an API's adapter makes of a validated body for the shared pipeline
    (`OpenAIServing.params_for`): the engine requests it will queue (`num_completions`:
    prompts x n), the most tokens each may generate and the logprobs it asks for, as the
    engine takes them, the tools it offers, and its output constraint (`constraint`, called
    off the event loop: it builds a grammar; None when the body names none)."""

    num_completions: int
    max_tokens: int | None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    offer: ToolOffer = ToolOffer()
    constraint: Callable[[], Constraint | None] | None = None

    @property
    def may_constrain(self) -> bool:
        """Whether the output may be constrained (its grammar is then built off the loop)."""
        return self.constraint is not None or self.offer.may_constrain


@dataclass(kw_only=True)
class ChoiceOutput:
    """One choice's output, pushed delta by delta (a whole output is one push): the text that
    can be sent now is returned, text where a tool call may begin held back until the output
    ends; then `tool_calls` holds its calls, `cut_call` the call it was cut off in (by its
    token limit or a stop string; its arguments unfinished JSON text) and `text` the content
    the parser left (all of `text` was returned by the pushes). Owned by one response being
    rendered."""

    parser: ToolParser | None
    text: str = ""
    num_tokens: int = 0
    tool_calls: tuple[ParsedToolCall, ...] = ()
    cut_call: ParsedToolCall | None = None
    last: CompletionOutput | None = None  # the output's last delta, once it finished
    _splitter: StreamingToolCallSplitter | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        if self.parser is not None:
            self._splitter = StreamingToolCallSplitter(self.parser)

    def push(self, completion: CompletionOutput) -> str:
        """Takes the choice's next delta; returns the text that can be sent now."""
        self.num_tokens += len(completion.token_ids)
        delta = completion.text
        if self._splitter is not None:
            delta = self._splitter.push(delta)
            if completion.finished:
                cut = completion.finish_reason == "length" or isinstance(
                    completion.stop_reason, str)
                rest, parsed = self._splitter.finish(cut=cut)
                self.tool_calls, self.cut_call = parsed.tool_calls, parsed.cut_call
                delta += rest
        if completion.finished:
            self.last = completion
        self.text += delta
        return delta

    @property
    def calls_shown(self) -> tuple[ParsedToolCall, ...]:
        """The calls the output shows: its tool calls, then the one it was cut off in."""
        return self.tool_calls if self.cut_call is None else (*self.tool_calls, self.cut_call)

    @property
    def ends_in_calls(self) -> bool:
        """Whether the output ended by calling tools (it has calls, none of them cut off)."""
        return bool(self.tool_calls) and self.cut_call is None

    @property
    def finish_reason(self) -> str | None:
        """The engine's finish reason (None while running)."""
        return None if self.last is None else self.last.finish_reason
