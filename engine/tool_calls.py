"""Tool calls in model output, parsed as the server returns them to clients (OpenAI
`tool_calls`) and as the estimator learns tools from them: one parser for both.

Two output styles are understood:
- Hermes (Qwen, Hermes, the embedded `tiny` template): `<tool_call>{"name": ..., "arguments":
  {...}}</tool_call>`, possibly several, possibly after some text.
- Llama-3 JSON: the whole answer is `{"name": ..., "parameters": {...}}` (or `"arguments"`),
  optionally after `<|python_tag|>`, several calls separated by `;`.

A text cut off (by its token limit or a stop string) inside its last call (`parse(text,
cut=True)`; a call begun, a `<tool_call>` followed by nothing or a JSON object) gives the
calls before it, and that call as `cut_call` when its name was written whole (its arguments
as far as they go, or whole if only the call's end is missing); the cut call's markup is not
content. Other text that does not parse completely is returned, unchanged, as content with no
tool calls:
parsing is total, whatever the text (JSON the decoder refuses, nesting deeper than it
recurses, integers longer than Python converts), since model output can hold anything.
Content before Hermes calls loses its trailing whitespace. `ToolCallFormat`, carried by an
engine request that offered tools, names the parser and the tools, so that the engine core
reads a finished turn's calls exactly as the frontend returns them to the client (a cut call
is not among them: no tool runs on it).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import msgspec

from engine.registry import Registry

HERMES_START = "<tool_call>"
HERMES_END = "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
# The markers the parsers read: where a vocabulary makes them special tokens, they must stay
# in the text that the parsers see.
TOOL_CALL_MARKERS = (HERMES_START, HERMES_END, PYTHON_TAG)

_HERMES_CALL = re.compile(
    re.escape(HERMES_START) + r"(.*?)(?:" + re.escape(HERMES_END) + r"|\Z)", re.DOTALL
)
# The head of a call object cut off before its end: its name, then its arguments' key.
_CUT_CALL_NAME = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")')
_CUT_CALL_ARGUMENTS = re.compile(r'\s*,\s*"(?:arguments|parameters)"\s*:\s*')
_ARGUMENTS_KEYS = (',"arguments":', ',"parameters":')
_WHITESPACE = re.compile(r"\s+")


@dataclass(frozen=True, slots=True)
class ParsedToolCall:
    """One call: the function's name and its arguments as a JSON object text."""

    name: str
    arguments: str


@dataclass(frozen=True, slots=True)
class ParsedOutput:
    """Model output split into content and tool calls: without calls the content is the
    whole text; with calls it is None when nothing but whitespace precedes them. `cut_call`:
    the call a cut-off text ended inside, its `arguments` the unfinished JSON text written."""

    content: str | None
    tool_calls: tuple[ParsedToolCall, ...] = ()
    cut_call: ParsedToolCall | None = None


class ToolParser(Protocol):
    """Parses one completion's text (`cut`: the text was cut off, see the module docstring).
    `may_start_call(text)` says, for a streamed prefix of the text, from which character a
    tool call may begin (None: not yet), so that streaming holds that part back until the
    completion ends."""

    def parse(self, text: str, *, cut: bool = False) -> ParsedOutput: ...

    def may_start_call(self, text: str) -> int | None: ...


# What the JSON decoder and encoder raise on text they refuse: a `ValueError` (a
# `JSONDecodeError`, or an integer of more digits than `sys.get_int_max_str_digits()`), a
# `RecursionError` on deep nesting.
JSON_ERRORS = (ValueError, RecursionError)


def _call_from_json(value: Any, argument_keys: tuple[str, ...]) -> ParsedToolCall | None:
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    if not value["name"]:
        return None
    arguments: Any = {}
    for key in argument_keys:
        if key in value:
            arguments = value[key]
            break
    try:
        if isinstance(arguments, str):
            arguments = json.loads(arguments)
        if not isinstance(arguments, dict):
            return None
        return ParsedToolCall(value["name"], json.dumps(arguments, ensure_ascii=False))
    except JSON_ERRORS:
        return None


def _cut_call(text: str) -> ParsedToolCall | None:
    """The call a call object cut off before its end was writing, if its name is whole and
    nothing but its arguments' key follows it: its arguments are the JSON value after that
    key, or as much of it as was written ("" if not yet reached)."""
    head = _CUT_CALL_NAME.match(text)
    if head is None:
        return None
    try:
        name = json.loads(head.group(1))
    except JSON_ERRORS:
        return None
    if not name:
        return None
    key = _CUT_CALL_ARGUMENTS.match(text, head.end())
    if key is None:
        written = _WHITESPACE.sub("", text[head.end():])
        return ParsedToolCall(name, "") if any(
            whole.startswith(written) for whole in _ARGUMENTS_KEYS) else None
    arguments = text[key.end():]
    try:
        end = json.JSONDecoder().raw_decode(arguments)[1]
    except JSON_ERRORS:
        return ParsedToolCall(name, arguments.rstrip())
    return ParsedToolCall(name, arguments[:end])


class HermesToolParser:
    """`<tool_call>` blocks holding JSON objects; text before the first block is content. An
    unterminated last block (the model stopped at its end token) is accepted."""

    def parse(self, text: str, *, cut: bool = False) -> ParsedOutput:
        start = text.find(HERMES_START)
        if start < 0:
            return ParsedOutput(text)
        if cut:
            parsed = self._parse_cut(text)
            if parsed is not None:
                return parsed
        calls = []
        for match in _HERMES_CALL.finditer(text, start):
            call = _block_call(match.group(1))
            if call is None:
                return ParsedOutput(text)
            calls.append(call)
        return ParsedOutput(text[:start].rstrip() or None, tuple(calls))

    def _parse_cut(self, text: str) -> ParsedOutput | None:
        """A cut-off text whose last block is a call begun and unfinished (None: the text
        reads as if whole)."""
        last = text.rfind(HERMES_START)
        block = text[last + len(HERMES_START):]
        end = _partial_marker_start(block, HERMES_END)
        if end is not None and _block_call(block[:end]) is not None:
            return self.parse(text[:last + len(HERMES_START) + end])  # only `</...` was cut
        if (HERMES_END in block or block.lstrip()[:1] not in ("", "{")
                or _block_call(block) is not None):
            return None
        head = text[:last]
        parsed = self.parse(head)
        if HERMES_START in head and not parsed.tool_calls:
            return ParsedOutput(text)
        content = parsed.content if parsed.tool_calls else head.rstrip() or None
        return ParsedOutput(content, parsed.tool_calls, _cut_call(block))

    def may_start_call(self, text: str) -> int | None:
        start = text.find(HERMES_START)
        if start >= 0:
            return start
        return _partial_marker_start(text, HERMES_START)


def _block_call(block: str) -> ParsedToolCall | None:
    try:
        return _call_from_json(json.loads(block), ("arguments", "parameters"))
    except JSON_ERRORS:
        return None


class Llama3JsonToolParser:
    """The whole output is one or more JSON call objects (`;`-separated), optionally after
    `<|python_tag|>`."""

    def parse(self, text: str, *, cut: bool = False) -> ParsedOutput:
        body = text.strip()
        body = body.removeprefix(PYTHON_TAG).lstrip()
        if not body.startswith("{"):
            return ParsedOutput(text)
        decoder = json.JSONDecoder()
        calls = []
        position = 0
        while position < len(body):
            try:
                value, end = decoder.raw_decode(body, position)
            except JSON_ERRORS:
                cut_call = _cut_call(body[position:]) if cut else None
                begun = cut and calls and body.startswith("{", position)
                if cut_call is None and not begun:
                    return ParsedOutput(text)
                return ParsedOutput(None, tuple(calls), cut_call)
            call = _call_from_json(value, ("parameters", "arguments"))
            if call is None:
                return ParsedOutput(text)
            calls.append(call)
            position = _skip_separator(body, end)
        return ParsedOutput(None, tuple(calls))

    def may_start_call(self, text: str) -> int | None:
        stripped = text.lstrip()
        if not stripped:
            return 0  # only whitespace so far: a call may still begin
        if stripped.startswith("{") or stripped.startswith(PYTHON_TAG):
            return 0
        return 0 if PYTHON_TAG.startswith(stripped) else None


class AutoToolParser:
    """Hermes when the output holds a `<tool_call>` block, else Llama-3 JSON."""

    def __init__(self) -> None:
        self._hermes = HermesToolParser()
        self._llama3 = Llama3JsonToolParser()

    def parse(self, text: str, *, cut: bool = False) -> ParsedOutput:
        if HERMES_START in text:
            return self._hermes.parse(text, cut=cut)
        return self._llama3.parse(text, cut=cut)

    def may_start_call(self, text: str) -> int | None:
        starts = [start for start in (self._llama3.may_start_call(text),
                                      self._hermes.may_start_call(text)) if start is not None]
        return min(starts, default=None)


class OfferedToolsParser:
    """Another parser restricted to the tools a request offered: output that names any other
    function is content, not a call (a JSON answer with a "name" field is not a tool call),
    and a cut call of any other function is read as if the text were whole.
    With `parallel=False` only the first call is returned (`parallel_tool_calls: false`, for
    formats whose grammar cannot stop a second call)."""

    def __init__(self, parser: ToolParser, tool_names: frozenset[str], *,
                 parallel: bool = True) -> None:
        self._parser = parser
        self._tool_names = tool_names
        self._parallel = parallel

    def parse(self, text: str, *, cut: bool = False) -> ParsedOutput:
        parsed = self._parser.parse(text, cut=cut)
        if parsed.cut_call is not None and parsed.cut_call.name not in self._tool_names:
            return self.parse(text)
        if any(call.name not in self._tool_names for call in parsed.tool_calls):
            return ParsedOutput(text)
        if not self._parallel and parsed.tool_calls and (
                len(parsed.tool_calls) > 1 or parsed.cut_call is not None):
            return ParsedOutput(parsed.content, parsed.tool_calls[:1])
        return parsed

    def may_start_call(self, text: str) -> int | None:
        return self._parser.may_start_call(text)


TOOL_PARSERS: Registry[Callable[[], ToolParser]] = Registry("tool-call parser", {
    "auto": AutoToolParser,
    "hermes": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
})


def make_tool_parser(name: str) -> ToolParser:
    """The parser registered as `name`; ValueError if there is none."""
    return TOOL_PARSERS.load(name)()


def _partial_marker_start(text: str, marker: str) -> int | None:
    """Where a suffix of `text` that is a proper prefix of `marker` begins, if any."""
    for length in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:length]):
            return len(text) - length
    return None


def _skip_separator(body: str, position: int) -> int:
    while position < len(body) and body[position] in " \t\r\n;":
        position += 1
    return position


class ToolCallFormat(msgspec.Struct, frozen=True, kw_only=True):
    """How a request's output is read for tool calls: the parser registered as `parser`,
    restricted to the offered `tool_names` (one call only unless `parallel`). Built by the
    frontend for a request that offers tools, and sent with it to the engine core."""

    parser: str
    tool_names: tuple[str, ...]
    parallel: bool = True

    def __post_init__(self) -> None:
        TOOL_PARSERS.check(self.parser)

    def make_parser(self) -> ToolParser:
        """The parser of this format."""
        return OfferedToolsParser(make_tool_parser(self.parser), frozenset(self.tool_names),
                                  parallel=self.parallel)
