"""The grammar builders, checked by running llguidance's matcher over strings."""

from __future__ import annotations

import json

import pytest

from engine.structured_output import grammars
from engine.structured_output.grammars import ToolCallFormat, ToolSchema
from tests.engine.structured_output.matching import accepts

TOOLS = [ToolSchema("get_time", {"type": "object", "properties": {"zone": {"enum": ["utc"]}},
                                 "required": ["zone"], "additionalProperties": False}),
         ToolSchema("ping", None)]
HERMES = ToolCallFormat("hermes")
CALL = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "utc"}}\n</tool_call>'
PING = '<tool_call>\n{"name": "ping", "arguments": {}}\n</tool_call>'


@pytest.mark.parametrize(("text", "accepted"), [
    ('{"a": 1, "b": [true, null]}', True),
    ('{"a":1}', False),  # no flexible whitespace: the separators are those of json.dumps
    ("[1]", False),
])
def test_json_object(tokenizer, text, accepted):
    assert accepts(tokenizer, grammars.json_object_grammar(), text) is accepted


def test_json_schema_follows_the_schema(tokenizer):
    grammar = grammars.json_schema_grammar({"type": "object", "properties": {
        "n": {"type": "integer", "maximum": 5}}, "required": ["n"],
        "additionalProperties": False})
    assert accepts(tokenizer, grammar, json.dumps({"n": 3}))
    assert not accepts(tokenizer, grammar, json.dumps({"n": 7}))
    assert not accepts(tokenizer, grammar, json.dumps({"m": 1}))


def test_regex_and_choice(tokenizer):
    assert accepts(tokenizer, grammars.regex_grammar(r"a/b\d+"), "a/b12")
    assert not accepts(tokenizer, grammars.regex_grammar(r"a/b\d+"), "a/b")
    grammar = grammars.choice_grammar(['say "hi"', "é\n"])
    assert accepts(tokenizer, grammar, 'say "hi"') and accepts(tokenizer, grammar, "é\n")
    assert not accepts(tokenizer, grammar, "say")


def test_tool_calls_in_the_hermes_format(tokenizer):
    single = grammars.tool_calls_grammar(TOOLS, HERMES, parallel=False)
    parallel = grammars.tool_calls_grammar(TOOLS, HERMES, parallel=True)
    assert accepts(tokenizer, single, CALL) and accepts(tokenizer, single, PING)
    assert not accepts(tokenizer, single, CALL + "\n" + PING)
    assert accepts(tokenizer, parallel, CALL + "\n" + PING)
    assert not accepts(tokenizer, single, "Sure. " + CALL)
    assert not accepts(tokenizer, single, CALL.replace("utc", "cet"))


def test_text_then_at_most_one_call(tokenizer):
    grammar = grammars.text_then_one_call_grammar(TOOLS, HERMES)
    assert accepts(tokenizer, grammar, "Let me check.")
    assert accepts(tokenizer, grammar, "Let me check." + CALL)
    assert not accepts(tokenizer, grammar, "x" + CALL + "\n" + PING)
    with pytest.raises(ValueError, match="token"):
        grammars.text_then_one_call_grammar(TOOLS, ToolCallFormat("llama3_json"))


def test_tool_calls_in_the_llama3_json_format(tokenizer):
    grammar = grammars.tool_calls_grammar(TOOLS, ToolCallFormat("llama3_json"), parallel=True)
    call = '{"name": "get_time", "parameters": {"zone": "utc"}}'
    assert accepts(tokenizer, grammar, call + "; " + '{"name": "ping", "parameters": {}}')


def test_tool_calls_or_json(tokenizer):
    grammar = grammars.tool_calls_or_json_grammar(
        TOOLS, HERMES, parallel=False, schema={"type": "array", "maxItems": 1})
    assert accepts(tokenizer, grammar, CALL) and accepts(tokenizer, grammar, "[1]")
    assert not accepts(tokenizer, grammar, "[1, 2]")


@pytest.mark.parametrize(("build", "message"), [
    (lambda: grammars.choice_grammar([]), "non-empty"),
    (lambda: grammars.regex_grammar(""), "non-empty"),
    (lambda: grammars.json_schema_grammar([1]), "object"),  # type: ignore[arg-type]
    (lambda: grammars.tool_calls_grammar([], HERMES, parallel=False), "at least one"),
    (lambda: grammars.check_grammar("start: /[a-/"), "regex"),
    (lambda: grammars.check_grammar(grammars.json_schema_grammar({"type": "nope"})), "nope"),
])
def test_bad_inputs_raise_value_error(build, message):
    with pytest.raises(ValueError, match=message):
        build()


# Integer ranges llguidance 1.9 cannot build: wholly below 64-bit integers (it crashes the
# process), wholly above them (it yields numbers outside the range); nested, or in a Lark rule.
OUT_OF_RANGE = [
    {"type": "integer", "minimum": -9223372036854775807, "maximum": -9223372036854775807},
    {"anyOf": [{"type": "integer"}], "minimum": -1e19, "exclusiveMaximum": -1e19},
    {"type": "object", "properties": {"n": {"type": ["integer", "null"], "minimum": -1e300,
                                            "maximum": -1e19}}},
    {"type": "integer", "minimum": 1e19, "maximum": 2e19},
]


@pytest.mark.parametrize("grammar", [
    *(grammars.json_schema_grammar(schema) for schema in OUT_OF_RANGE),
    'start: "n=" %json {"type": "integer", "minimum": -1e19, "maximum": -1e19}\n',
])
def test_a_range_past_64_bit_integers_is_refused_before_llguidance_reads_it(grammar,
                                                                             monkeypatch):
    def never(*_args):
        raise AssertionError("llguidance read the grammar")

    monkeypatch.setattr(grammars.llguidance.LLMatcher, "validate_grammar_with_warnings", never)
    with pytest.raises(ValueError, match="leaves no number within the range"):
        grammars.check_grammar(grammar)


def test_ranges_within_64_bit_integers_pass():
    for schema in ({"type": "integer", "minimum": -1e300, "maximum": 5},
                   {"type": "integer", "maximum": -9223372036854774784},
                   {"type": "number", "minimum": -1e19}):
        grammars.check_schema_ranges(grammars.json_schema_grammar(schema))


def test_a_regex_error_says_what_is_wrong():
    """Its first line ends in a colon; what is wrong is on its last."""
    schema = {"type": "object", "properties": {"a": {"type": "string", "pattern": "(("}}}
    with pytest.raises(ValueError) as refused:
        grammars.check_grammar(grammars.json_schema_grammar(schema))
    assert str(refused.value).endswith(": regex parse error: unclosed group")


@pytest.mark.parametrize("grammar", ["start: /" + "a" * 2000 + "[/", "start: " + "b" * 2000])
def test_a_grammar_error_is_one_short_line(grammar):
    """llguidance echoes the rule it rejects: 2,000 characters of it here, before the cap."""
    with pytest.raises(ValueError) as refused:
        grammars.check_grammar(grammar)
    message = str(refused.value)
    assert len(message) == grammars.MAX_ERROR_CHARS and message.endswith("...")
    assert "\n" not in message and message.startswith("at 1(8): ")
