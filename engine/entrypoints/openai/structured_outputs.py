"""From the request fields that constrain output to one `StructuredOutputSpec`.

Accepted forms, at most one per request (400 naming both otherwise):
- OpenAI's `response_format`: `json_object`, or `json_schema` (`{"name", "schema", "strict"}`;
  with `strict` true, objects take only their named properties, `structured_output.strict`);
  `text` means no constraint;
- vLLM's `structured_outputs` object (`json`, `regex`, `choice`, `grammar`, `json_object`) and
  the older top-level `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`;
- with tools: `tool_choice` "required" (one or more calls, or exactly one with
  `parallel_tool_calls: false`) or a named function (exactly one call of it), in the model's
  tool-call format (a function with `strict: true` in strict mode; Hermes blocks, the
  markers as text, where the chat template's tools fallback taught them). With `tool_choice`
  "auto" and a JSON response format the output is either tool calls or the JSON value; with
  "auto" and `parallel_tool_calls: false` (Hermes-style models, whose call markers are special
  tokens) text may be followed by at most one call.

A schema or grammar llguidance rejects is a 400 naming the field. Grammar checks are cached by
grammar text, so a client that sends the same schema again pays for one dictionary lookup.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import llguidance

from engine.entrypoints.openai.errors import APIError
from engine.entrypoints.openai.generation import Constraint, ForcedTool, OfferedTool, ToolOffer
from engine.frontend.chat_template import template_tool_support
from engine.structured_output import grammars
from engine.structured_output.grammars import ToolCallFormat, ToolSchema
from engine.structured_output.spec import StructuredOutputKind, StructuredOutputSpec
from engine.structured_output.strict import strict_schema
from engine.tool_calls import JSON_ERRORS

MAX_CHECKED_GRAMMARS = 1024
HERMES_CALL_START = "<tool_call>"


class GrammarChecker:
    """Checks grammars against the model's tokenizer (special-token names included) and
    remembers the grammars that passed. Thread-safe: requests are prepared on worker threads.
    `tokenizer` is the Hugging Face tokenizer; its llguidance view is built by `prepare`, or
    on first use. One checker serves all the server's endpoints."""

    def __init__(self, tokenizer: Any, *, max_entries: int = MAX_CHECKED_GRAMMARS) -> None:
        self.tokenizer = tokenizer
        self.max_entries = max_entries
        self._lock = threading.Lock()
        self._llg_tokenizer: llguidance.LLTokenizer | None = None
        self._passed: OrderedDict[str, None] = OrderedDict()
        self._call_formats: dict[str, ToolCallFormat] = {}

    def prepare(self) -> None:
        """Builds the tokenizer's llguidance view now (the server calls it at start-up): it
        holds the GIL for as long as it takes (0.4 s for SmolLM2's 49,152 tokens), which on a
        worker thread, when the first constrained request arrives, would stall the event
        loop."""
        with self._lock:
            self._tokenizer()

    def spec(self, kind: StructuredOutputKind, grammar: str, param: str) -> StructuredOutputSpec:
        """The spec of `grammar`; APIError 400 with `param` if llguidance rejects it."""
        with self._lock:
            if grammar in self._passed:
                self._passed.move_to_end(grammar)
                return StructuredOutputSpec(kind=kind, grammar=grammar, param=param)
            tokenizer = self._tokenizer()
        try:
            grammars.check_grammar(grammar, tokenizer)
        except ValueError as error:
            raise APIError(400, f"{param}: {error}", param=param) from error
        with self._lock:
            self._passed[grammar] = None
            while len(self._passed) > self.max_entries:
                self._passed.popitem(last=False)
        return StructuredOutputSpec(kind=kind, grammar=grammar, param=param)

    def tool_call_format(self, parser_name: str) -> ToolCallFormat:
        """The tool-call format matching the server's parser; worked out once per parser.
        `auto` is Hermes when the tokenizer knows `<tool_call>` or when the chat template
        leaves tool definitions out (the prompt then teaches Hermes blocks,
        `engine.frontend.chat_template`), Llama-3 JSON otherwise."""
        call_format = self._call_formats.get(parser_name)
        if call_format is None:
            call_format = self._call_formats[parser_name] = self._find_call_format(parser_name)
        return call_format

    def _find_call_format(self, parser_name: str) -> ToolCallFormat:
        vocab = self.tokenizer.get_vocab() if hasattr(self.tokenizer, "get_vocab") else {}
        if parser_name == "llama3_json" or (parser_name == "auto"
                                            and HERMES_CALL_START not in vocab
                                            and not self._prompt_teaches_hermes()):
            return ToolCallFormat("llama3_json")
        special = set(getattr(self.tokenizer, "all_special_tokens", ()))
        special |= {str(token) for token in getattr(self.tokenizer, "added_tokens_decoder",
                                                    {}).values()
                    if getattr(token, "special", False)}
        return ToolCallFormat("hermes", markers_are_tokens=HERMES_CALL_START in special)

    def _prompt_teaches_hermes(self) -> bool:
        """Whether tool definitions reach the prompt through the chat template's fallback,
        which tells the model to answer in Hermes blocks."""
        if getattr(self.tokenizer, "chat_template", None) is None:
            return False
        return not template_tool_support(self.tokenizer).renders_tools

    def _tokenizer(self) -> llguidance.LLTokenizer:
        if self._llg_tokenizer is None:
            import llguidance.hf

            self._llg_tokenizer = llguidance.hf.from_tokenizer(self.tokenizer)
        return self._llg_tokenizer


CONSTRAINT_FIELDS = ("response_format", "structured_outputs", "guided_json", "guided_regex",
                     "guided_choice", "guided_grammar")


def may_constrain(body: Any) -> bool:
    """Whether a completion or chat request has fields that may constrain its output (the
    grammar is then built and checked off the event loop)."""
    return any(getattr(body, field, None) is not None for field in CONSTRAINT_FIELDS)


def output_constraint(body: Any) -> Constraint | None:
    """The one output constraint among the request's fields (None: unconstrained); APIError
    naming the fields if there are several or one is malformed."""
    found = [constraint for constraint in _constraints(body) if constraint is not None]
    if len(found) > 1:
        names = " and ".join(constraint.field for constraint in found)
        raise APIError(400, f"{names} cannot be combined: give one output constraint",
                       param=found[1].field)
    return found[0] if found else None


def offer_structured_output(offer: ToolOffer, constraint: Constraint | None,
                            checker: GrammarChecker, parser_name: str
                            ) -> StructuredOutputSpec | None:
    """The constraint of a request offering tools (`offer`) with at most one output
    `constraint`, for every API that offers tools; errors name the request's own fields."""
    tools = [_tool_schema(tool) for tool in offer.tools]
    if not offer.enabled:
        return _spec(checker, constraint)
    call_format = checker.tool_call_format(parser_name)
    parallel = offer.parallel
    if offer.choice != "auto":
        if constraint is not None:
            raise APIError(400, f"{constraint.field} cannot be combined with tool_choice "
                                f"{offer.choice_text}: the output is a tool call",
                           param=constraint.field)
        if isinstance(offer.choice, ForcedTool):
            tools = [tool for tool in tools if tool.name == offer.choice.name]
            parallel = False
        return checker.spec("tool_calls", _tool_grammar(
            lambda: grammars.tool_calls_grammar(tools, call_format, parallel=parallel)), "tools")
    return _auto_tools_spec(checker, constraint, tools, call_format, parallel=parallel)


def _auto_tools_spec(checker: GrammarChecker, constraint: Constraint | None,
                     tools: Sequence[ToolSchema], call_format: ToolCallFormat, *,
                     parallel: bool) -> StructuredOutputSpec | None:
    if constraint is not None:
        schema = constraint.schema
        if schema is None:
            raise APIError(400, f"{constraint.field} of kind {constraint.kind!r} cannot be "
                                "combined with tools (only a JSON constraint can)",
                           param=constraint.field)
        return checker.spec("tool_calls", _tool_grammar(
            lambda: grammars.tool_calls_or_json_grammar(tools, call_format,
                                                        parallel=parallel, schema=schema)),
            constraint.field)
    if parallel or call_format != ToolCallFormat("hermes", markers_are_tokens=True):
        return None
    return checker.spec("tool_calls", _tool_grammar(
        lambda: grammars.text_then_one_call_grammar(tools, call_format)), "parallel_tool_calls")


def _spec(checker: GrammarChecker, constraint: Constraint | None) -> StructuredOutputSpec | None:
    if constraint is None:
        return None
    return checker.spec(constraint.kind, constraint.grammar, constraint.field)


def _tool_schema(tool: OfferedTool) -> ToolSchema:
    """The tool's name and parameters, in OpenAI's strict mode when it says `strict: true`."""
    parameters = tool.parameters
    if tool.strict and parameters is not None:
        try:
            parameters = strict_schema(parameters)
        except ValueError as error:
            param = tool.parameters_field
            raise APIError(400, f"{param}: {error}", param=param) from error
    return ToolSchema(tool.name, parameters)


def _tool_grammar(build: Callable[[], str]) -> str:
    try:
        return build()
    except ValueError as error:
        raise APIError(400, f"tools: {error}", param="tools") from error


# The constraint fields.
def _constraints(body: Any) -> list[Constraint | None]:
    found = [_response_format(getattr(body, "response_format", None))]
    structured = getattr(body, "structured_outputs", None)
    if structured is not None:
        found.append(_structured_outputs(structured))
    for field in ("guided_json", "guided_regex", "guided_choice", "guided_grammar"):
        value = getattr(body, field, None)
        if value is not None:
            found.append(_guided(field, field.removeprefix("guided_"), value))
    return found


def _response_format(response_format: Any) -> Constraint | None:
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object":
        return json_object_constraint("response_format")
    json_schema = response_format.json_schema
    if json_schema is None:
        raise APIError(400, "response_format of type 'json_schema' needs json_schema",
                       param="response_format.json_schema")
    return json_schema_constraint("response_format.json_schema.schema",
                                  json_schema.schema_, strict=bool(json_schema.strict))


def json_schema_constraint(field: str, schema: Mapping[str, Any] | None, *,
                           strict: bool) -> Constraint:
    """The output as JSON valid against `schema` (None: any object), in OpenAI's strict mode
    with `strict`; `field` names the schema in errors."""
    schema = schema if schema is not None else {}
    if strict:
        try:
            schema = strict_schema(schema)
        except ValueError as error:
            raise APIError(400, f"{field}: {error}", param=field) from error
    return _json(field, "json_schema", schema)


def json_object_constraint(field: str) -> Constraint:
    """The output as any JSON object; `field` names the request's field in errors."""
    return _json(field, "json_object", {"type": "object"})


def _structured_outputs(structured: Any) -> Constraint | None:
    given = [(name, value) for name, value in structured.model_dump(by_alias=True).items()
             if value is not None and value is not False]
    if len(given) != 1:
        raise APIError(400, "structured_outputs must set exactly one of json, regex, choice, "
                            "grammar, json_object", param="structured_outputs")
    (name, value), = given
    return _guided(f"structured_outputs.{name}", name, value)


def _guided(field: str, kind: str, value: Any) -> Constraint:
    if kind == "json":
        return _json(field, "json_schema", _schema_value(field, value))
    if kind == "json_object":
        return json_object_constraint(field)
    if kind == "regex":
        return Constraint(field, "regex", _build(field, lambda: grammars.regex_grammar(value)))
    if kind == "choice":
        return Constraint(field, "choice",
                          _build(field, lambda: grammars.choice_grammar(value)))
    return Constraint(field, "grammar", _build(field, lambda: _grammar_text(value)))


def _json(field: str, kind: StructuredOutputKind, schema: Mapping[str, Any]) -> Constraint:
    return Constraint(field, kind,
                      _build(field, lambda: grammars.json_schema_grammar(schema)), schema)


def _schema_value(field: str, value: Any) -> Mapping[str, Any]:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except JSON_ERRORS as error:
            raise APIError(400, f"{field} is not valid JSON: {error}", param=field) from error
    if not isinstance(value, Mapping):
        raise APIError(400, f"{field} must be a JSON schema object", param=field)
    return value


def _grammar_text(value: Any) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ValueError("a grammar must be a non-empty string")
    return llguidance.grammar_from("grammar", value)


def _build(field: str, build: Callable[[], str]) -> str:
    try:
        return build()
    except ValueError as error:
        raise APIError(400, f"{field}: {error}", param=field) from error

