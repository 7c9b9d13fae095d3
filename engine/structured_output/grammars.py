"""Building and checking the grammars of structured outputs (the frontend's side).

Every kind of constraint becomes one grammar in llguidance's Lark dialect, which embeds JSON
schemas (`%json { ... }`) and names special tokens (`<tool_call>`), so that a tool call in the
model's own format is one rule. llguidance was chosen over xgrammar for three reasons: its
Lark grammars compose JSON schemas with literal text and special tokens directly (a tool call is
`<tool_call> "\\n" %json {...} "\\n" </tool_call>`), it computes masks lazily so "compiling" a
grammar is a parse plus a warm-up mask rather than a pass over the whole vocabulary, and it is
a 8 MB wheel with no dependencies, where xgrammar pulls triton (1 GB) into CPU installs.

JSON is generated without flexible whitespace, with `", "` and `": "` as separators: the
format of Python's `json.dumps` and of the `tojson` filter chat templates use to render tool
calls, so a model sees its constrained output in the form its template shows it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import llguidance

from engine.structured_output.spec import StructuredOutputSpec

JSON_OPTIONS: Mapping[str, Any] = {
    "whitespace_flexible": False, "item_separator": ", ", "key_separator": ": ",
}
MAX_GRAMMAR_CHARS = 1 << 20
# The magnitude past which no JSON schema may start an integer range (a lower bound above
# it, an upper bound below its negative). llguidance 1.9 builds integer ranges in 64-bit
# integers: a range wholly below them crashes the process, and one wholly above them yields
# numbers outside the range.
MAX_RANGE_START = 2**63 - 2**10
_LOWER_BOUNDS = ("minimum", "exclusiveMinimum")
_UPPER_BOUNDS = ("maximum", "exclusiveMaximum")
MAX_ERROR_CHARS = 300  # of a grammar's error message, as a client gets it

ToolCallStyle = Literal["hermes", "llama3_json"]


def json_schema_grammar(schema: Mapping[str, Any]) -> str:
    """The grammar of a JSON value matching `schema` (a JSON Schema object)."""
    if not isinstance(schema, Mapping):
        raise ValueError("a JSON schema must be an object")
    return f"start: {_json_rule(schema)}\n"


def json_object_grammar() -> str:
    """Any JSON object (OpenAI's `json_object` response format)."""
    return json_schema_grammar({"type": "object"})


def regex_grammar(pattern: str) -> str:
    """Text matching the regular expression `pattern` (Rust `regex` syntax) in full."""
    if not isinstance(pattern, str) or not pattern:
        raise ValueError("a regex must be a non-empty string")
    return f"start: /{llguidance.regex_to_lark(pattern)}/\n"


def choice_grammar(choices: Sequence[str]) -> str:
    """Exactly one of `choices`."""
    if isinstance(choices, str) or not choices:
        raise ValueError("choices must be a non-empty list of strings")
    if not all(isinstance(choice, str) and choice for choice in choices):
        raise ValueError("every choice must be a non-empty string")
    return "start: " + " | ".join(json.dumps(choice) for choice in choices) + "\n"


@dataclass(frozen=True)
class ToolSchema:
    """One offered function: its name and its parameters' JSON schema (None: any object)."""

    name: str
    parameters: Mapping[str, Any] | None


@dataclass(frozen=True)
class ToolCallFormat:
    """How the model writes tool calls: Hermes (`<tool_call>` JSON `</tool_call>`, the markers
    special tokens when `markers_are_tokens`) or Llama-3 JSON (`{"name", "parameters"}`,
    several separated by `; `). Matches the parsers in `engine.tool_calls`."""

    style: ToolCallStyle
    markers_are_tokens: bool = True


def tool_calls_grammar(tools: Sequence[ToolSchema], call_format: ToolCallFormat, *,
                       parallel: bool) -> str:
    """One tool call (or, with `parallel`, one or more) to one of `tools`, in the model's
    tool-call format, and nothing else: `tool_choice` "required", or a named choice when
    `tools` holds only the named function."""
    if not tools:
        raise ValueError("a tool-call grammar needs at least one tool")
    return f"start: {_tool_calls_expression(call_format, parallel=parallel)}\n" + (
        _call_rules(tools, call_format))


def tool_calls_or_json_grammar(tools: Sequence[ToolSchema], call_format: ToolCallFormat, *,
                               parallel: bool, schema: Mapping[str, Any]) -> str:
    """Either tool calls (as `tool_calls_grammar`) or a JSON value matching `schema`: a
    response format combined with `tool_choice` "auto"."""
    calls = _tool_calls_expression(call_format, parallel=parallel)
    return f"start: {_json_rule(schema)} | {calls}\n" + _call_rules(tools, call_format)


def text_then_one_call_grammar(tools: Sequence[ToolSchema], call_format: ToolCallFormat) -> str:
    """Text, or text followed by one tool call and nothing after it: `tool_choice` "auto"
    with `parallel_tool_calls: false`. Only for formats whose call starts with a special
    token, which free text can never contain."""
    if call_format.style != "hermes" or not call_format.markers_are_tokens:
        raise ValueError("one optional call after text needs a call marker that is a token")
    return "start: TEXT | TEXT? call\nTEXT: /(?s:.+)/\n" + _call_rules(tools, call_format)


def check_grammar(grammar: str, tokenizer: llguidance.LLTokenizer | None = None) -> None:
    """ValueError naming the problem if llguidance rejects `grammar` (with `tokenizer`,
    special-token names are checked too)."""
    if len(grammar) > MAX_GRAMMAR_CHARS:
        raise ValueError(f"the grammar is longer than {MAX_GRAMMAR_CHARS} characters")
    check_schema_ranges(grammar)
    failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, tokenizer)
    if failed:
        raise ValueError(short_error(messages[0]) if messages and messages[0].strip()
                         else "invalid grammar")


def check_schema_ranges(grammar: str) -> None:
    """ValueError for a JSON schema of the Lark grammar `grammar` (a `%json` rule) with a
    range that starts past `MAX_RANGE_START`, and for a grammar in llguidance's JSON form
    (whose schemas this does not read; the frontend writes only Lark). A rule that is not
    JSON is left to llguidance to refuse."""
    if grammar.lstrip().startswith("{"):
        raise ValueError("a grammar must be written in Lark")
    decoder = json.JSONDecoder()
    start = grammar.find("%json")
    while start != -1:
        end = start + len("%json")
        while end < len(grammar) and grammar[end].isspace():
            end += 1
        try:
            schema, end = decoder.raw_decode(grammar, end)
        except (ValueError, RecursionError):  # llguidance refuses it (nested past its limit)
            schema = None
        _check_ranges(schema)
        start = grammar.find("%json", end)


def _check_ranges(schema: Any) -> None:
    pending = [schema]
    while pending:
        value = pending.pop()
        if isinstance(value, list):
            pending.extend(value)
        if not isinstance(value, dict):
            continue
        pending.extend(value.values())
        for key in (*_LOWER_BOUNDS, *_UPPER_BOUNDS):
            bound = value.get(key)
            if isinstance(bound, bool) or not isinstance(bound, int | float):
                continue
            if (bound > MAX_RANGE_START) if key in _LOWER_BOUNDS else (
                    bound < -MAX_RANGE_START):
                raise ValueError(f"{key} {bound} leaves no number within the range this "
                                 f"server constrains output to (+/-{MAX_RANGE_START})")


def checked_spec(kind: Any, grammar: str,
                 tokenizer: llguidance.LLTokenizer | None = None) -> StructuredOutputSpec:
    """The spec of `grammar`, after `check_grammar`."""
    check_grammar(grammar, tokenizer)
    return StructuredOutputSpec(kind=kind, grammar=grammar)


def _json_rule(schema: Mapping[str, Any]) -> str:
    options = {**JSON_OPTIONS, **schema.get("x-guidance", {})}
    return "%json " + json.dumps({**schema, "x-guidance": options})


def _call_schema(tool: ToolSchema, arguments_key: str) -> dict[str, Any]:
    parameters = dict(tool.parameters) if tool.parameters else {"type": "object"}
    return {
        "type": "object",
        "properties": {"name": {"const": tool.name}, arguments_key: parameters},
        "required": ["name", arguments_key],
        "additionalProperties": False,
    }


def _tool_calls_expression(call_format: ToolCallFormat, *, parallel: bool) -> str:
    if not parallel:
        return "call"
    if call_format.style == "hermes" and not call_format.markers_are_tokens:
        # Markers as text are what the chat template's tools fallback teaches a small model;
        # with a newline allowed after `</tool_call>` it writes one (its prompt's example has
        # one) and then repeats its call until max_tokens, while with none ending the turn
        # outscores another block.
        return "call+"
    separator = '"\\n"' if call_format.style == "hermes" else '"; "'
    return f"call ({separator} call)*"


def _call_rules(tools: Sequence[ToolSchema], call_format: ToolCallFormat) -> str:
    if call_format.style == "llama3_json":
        return f"call: {_call_bodies(tools, 'parameters')}\n"
    start, end = ("<tool_call>", "</tool_call>") if call_format.markers_are_tokens else (
        '"<tool_call>"', '"</tool_call>"')
    return (f'call: {start} "\\n" call_body "\\n" {end}\n'
            f"call_body: {_call_bodies(tools, 'arguments')}\n")


def _call_bodies(tools: Sequence[ToolSchema], arguments_key: str) -> str:
    return " | ".join(_json_rule(_call_schema(tool, arguments_key)) for tool in tools)


def short_error(error: BaseException | str) -> str:
    """The first line of an error, at most `MAX_ERROR_CHARS` long: llguidance's messages can
    carry its parser's state after their first line, and echo a whole rule in it. A first
    line that ends in a colon (a regex's error, which draws the regex before saying what is
    wrong) gets the line that says it."""
    lines = str(error).strip().splitlines()
    line = lines[0] if lines else type(error).__name__
    if line.endswith(":"):
        line += next((" " + later.removeprefix("error: ") for later in lines[1:]
                      if later.startswith("error: ")), "")
    return line if len(line) <= MAX_ERROR_CHARS else line[:MAX_ERROR_CHARS - 3] + "..."
