"""Which tool(s) an agent turn called, read from the turn's output text.

Tool durations are kept per tool, so a finished turn needs a tool name. Agents announce their
calls in several formats; the rules below are tried in order and the first that yields a name
wins:

1. ``client``: a name the client passed explicitly.
2. ``openai``: OpenAI chat ``tool_calls`` (given directly, or as a JSON message in the text).
3. ``hermes``: ``<tool_call>{"name": ...}</tool_call>`` blocks.
4. ``json``: the whole text (optionally one ```json block) is Llama 3's JSON call objects, or
   a JSON list of them.
5. ``call``: the whole text is calls such as ``get_weather(city="Paris")`` (BFCL style).
6. ``bash``: exactly one ```` ```bash ```` block (mini-swe-agent); its command's program.

Rules 3 and 4 are the server's own parsers (`engine.tool_calls`, the ones that return calls to
clients), so a Hermes or Llama 3 text is read here exactly as the server reads it: a block
that does not parse means no calls, not the calls of the other blocks.

Parsing never raises on any string and runs in time linear in the text for the usual inputs.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from engine.tool_calls import HERMES_START, HermesToolParser, Llama3JsonToolParser, ParsedOutput

MAX_NAME_CHARS = 128
MAX_KEY_NAMES = 8

# Chat-format control tokens a decoder may leave around a call when it keeps special tokens
# (`<|python_tag|>`, `<|eot_id|>`, `<|im_end|>`, `</s>`, ...); Hermes' `<tool_call>` is not one.
_CONTROL_TOKEN = re.compile(r"<\|[A-Za-z0-9_.:-]{1,40}\|>|</?s>|<eos>|<end_of_turn>")

_FENCE = "```"
_BASH_LANGUAGES = frozenset({"bash", "sh", "shell"})

_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*")
_WHITESPACE = re.compile(r"\s*")
_CALL_SEPARATOR = re.compile(r"\s*[,;]?\s*")

# A shell word as the prefixes below see it: quoted, or a run of ordinary characters.
_SHELL_ARG = r"""(?:"[^"\n]*"|'[^'\n]*'|[^\s;&|]+)"""
_ASSIGNMENT = r"""[A-Za-z_][A-Za-z0-9_]*=(?:"[^"\n]*"|'[^'\n]*'|[^\s;&|]*)"""
# Prefixes that only set up the command; the program that follows is the tool.
_COMMAND_PREFIX = re.compile(
    "|".join(
        (
            r"#[^\n]*(?:\n|$)\s*",  # a comment line
            rf"cd(?:[ \t]+{_SHELL_ARG})?[ \t]*(?:&&|;|\n)\s*",
            rf"export(?:[ \t]+{_ASSIGNMENT})+[ \t]*(?:&&|;|\n)\s*",
            rf"{_ASSIGNMENT}[ \t]+",
            r"sudo[ \t]+(?:-\S+[ \t]+)*",
            r"timeout[ \t]+(?:-\S+[ \t]+)*\d+(?:\.\d+)?[smhd]?[ \t]+",
            r"\(\s*",  # a subshell
        )
    )
)
_PROGRAM = re.compile(r"[^\s;&|()<>]+")


@dataclass(frozen=True, slots=True)
class ParsedToolCalls:
    """The tools one turn called, in output order, and the rule that recognised them."""

    names: tuple[str, ...]
    source: str

    @property
    def key(self) -> str:
        """The name statistics are kept under: the names joined by "+" in output order (at
        most `MAX_KEY_NAMES` of them, so one runaway output cannot make a huge key)."""
        return "+".join(self.names[:MAX_KEY_NAMES])


def parse_tool_calls(
    text: str | None, *, client_tool_name: str | None = None, tool_calls: object = None
) -> ParsedToolCalls | None:
    """The tool calls of a turn.

    `text` is the turn's output text, `client_tool_name` a name the client reported (it wins
    when non-empty) and `tool_calls` OpenAI-style tool calls of the turn, if any. Returns None
    when no tool call is recognised (empty, plain prose, garbage).
    """
    client = _clean_name(client_tool_name)
    if client is not None:
        return ParsedToolCalls((client,), "client")
    names = _names_from_calls(tool_calls)
    if names:
        return ParsedToolCalls(names, "openai")
    if not isinstance(text, str):
        return None
    text = _CONTROL_TOKEN.sub("", text)
    if not text.strip():
        return None
    stripped = text.strip()
    document = _load_document(stripped)
    rules: tuple[tuple[str, Callable[[], tuple[str, ...]]], ...] = (
        ("openai", lambda: _openai_names(document)),
        ("hermes", lambda: _hermes_names(text)),
        ("json", lambda: _llama3_names(_json_body(stripped), document)),
        ("call", lambda: _call_names(stripped)),
        ("bash", lambda: _bash_names(text)),
    )
    for source, rule in rules:
        names = rule()
        if names:
            return ParsedToolCalls(names, source)
    return None


def without_control_tokens(text: str) -> str:
    """`text` without the chat-format control tokens a decoder keeps (`<|eot_id|>`, ...)."""
    return _CONTROL_TOKEN.sub("", text)


def tool_key(text: str | None, *, client_tool_name: str | None = None) -> str | None:
    """The statistics key of the turn's tool calls (see `parse_tool_calls`), or None."""
    parsed = parse_tool_calls(text, client_tool_name=client_tool_name)
    return parsed.key if parsed is not None else None


def _clean_name(name: object) -> str | None:
    """`name` stripped when it is a usable tool name, else None."""
    if not isinstance(name, str):
        return None
    name = name.strip()
    return name if 0 < len(name) <= MAX_NAME_CHARS else None


def _load_json(text: str) -> object:
    """The JSON value of `text`, or None when it is not JSON."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError):  # deep nesting overflows the decoder's recursion
        return None


def _json_body(stripped: str) -> str:
    """The text, or the body of the one ```json fenced block it is."""
    return _unfence_json(stripped) if stripped.startswith(_FENCE) else stripped


def _load_document(stripped: str) -> object:
    """The JSON value of the whole text, which may sit in one ```json fenced block."""
    body = _json_body(stripped)
    if not body.startswith(("{", "[")):
        return None
    return _load_json(body)


def _unfence_json(stripped: str) -> str:
    """The body of a text that is a single ```json (or bare ```) block, else ""."""
    if len(stripped) < 2 * len(_FENCE) or not stripped.endswith(_FENCE):
        return ""
    inner = stripped[len(_FENCE) : -len(_FENCE)]
    info, _, body = inner.partition("\n")
    if info.strip().lower() not in ("", "json") or _FENCE in body:
        return ""
    return body.strip()


def _call_name(call: object) -> str | None:
    """The name of one call: `{"name": ...}` or OpenAI's `{"function": {"name": ...}}`."""
    if not isinstance(call, Mapping):
        return None
    function = call.get("function")
    if isinstance(function, Mapping) and "name" in function:
        return _clean_name(function.get("name"))
    return _clean_name(call.get("name"))


def _names_from_calls(calls: object) -> tuple[str, ...]:
    """The names of a list of calls, skipping those without a usable name."""
    if not isinstance(calls, (list, tuple)):
        return ()
    names = (_call_name(call) for call in calls)
    return tuple(name for name in names if name is not None)


def _openai_names(document: object) -> tuple[str, ...]:
    """The names in a JSON message's `tool_calls` list."""
    if not isinstance(document, dict):
        return ()
    return _names_from_calls(document.get("tool_calls"))


def _server_names(parsed: ParsedOutput) -> tuple[str, ...]:
    """The usable names of the calls one of the server's parsers read."""
    names = (_clean_name(call.name) for call in parsed.tool_calls)
    return tuple(name for name in names if name is not None)


def _llama3_names(body: str, document: object) -> tuple[str, ...]:
    """The names of Llama 3's calls in `body` (the text, unfenced: one or more JSON call
    objects, `;`-separated), or of a JSON list of call objects (`document`, the body's JSON
    value), read as those separated calls."""
    if isinstance(document, list) and document:
        try:
            body = ";".join(json.dumps(call) for call in document)
        except (TypeError, ValueError, RecursionError):  # the encoder nests less deep
            return ()
    return _server_names(Llama3JsonToolParser().parse(body))


def _hermes_names(text: str) -> tuple[str, ...]:
    """The names of the Hermes `<tool_call>` blocks, as the server reads them."""
    if HERMES_START not in text:
        return ()
    return _server_names(HermesToolParser().parse(text))


def _call_end(text: str, start: int) -> int | None:
    """The index just past the bracket closing the one at `start`, or None when unbalanced.

    Quoted strings (with backslash escapes) are skipped so brackets inside them don't count.
    """
    closers = {"(": ")", "[": "]", "{": "}"}
    expected: list[str] = []
    quote: str | None = None
    index = start
    while index < len(text):
        char = text[index]
        if quote is not None:
            if char == "\\":
                index += 1
            elif char == quote:
                quote = None
        elif char in "\"'":
            quote = char
        elif char in closers:
            expected.append(closers[char])
        elif char in ")]}":
            if not expected or expected.pop() != char:
                return None
            if not expected:
                return index + 1
        index += 1
    return None


def _call_names(stripped: str) -> tuple[str, ...]:
    """The names of a text made only of calls `name(...)`, optionally inside `[...]`."""
    if stripped.startswith("[") and stripped.endswith("]"):
        stripped = stripped[1:-1]
    names: list[str] = []
    position = _WHITESPACE.match(stripped).end()
    while position < len(stripped):
        match = _IDENTIFIER.match(stripped, position)
        if match is None or not stripped.startswith("(", match.end()):
            return ()
        end = _call_end(stripped, match.end())
        name = _clean_name(match.group())
        if end is None or name is None:
            return ()
        names.append(name)
        position = _CALL_SEPARATOR.match(stripped, end).end()
    return tuple(names)


def _bash_blocks(text: str) -> list[str]:
    """The bodies of the closed ```bash (```sh, ```shell) fenced blocks of the text."""
    blocks: list[str] = []
    language: str | None = None
    lines: list[str] = []
    for line in text.split("\n"):
        fence = line.lstrip()
        if not fence.startswith(_FENCE):
            if language is not None:
                lines.append(line)
        elif language is None:
            words = fence[len(_FENCE) :].split(maxsplit=1)
            language = words[0].lower() if words else ""
            lines = []
        else:
            if language in _BASH_LANGUAGES:
                blocks.append("\n".join(lines))
            language = None
    return blocks


def _program_name(command: str) -> str | None:
    """The program a shell command runs, past `cd X &&`, `VAR=value` and similar prefixes."""
    position = _WHITESPACE.match(command).end()
    while (prefix := _COMMAND_PREFIX.match(command, position)) is not None:
        if prefix.end() == position:
            break
        position = prefix.end()
    program = _PROGRAM.match(command, position)
    if program is None:
        return None
    return _clean_name(program.group().strip("\"'").rsplit("/", 1)[-1])


def _bash_names(text: str) -> tuple[str, ...]:
    """The program of the text's only bash block; nothing with zero or several blocks."""
    if _FENCE not in text:
        return ()
    blocks = _bash_blocks(text)
    if len(blocks) != 1:
        return ()
    name = _program_name(blocks[0])
    return (name,) if name is not None else ()
