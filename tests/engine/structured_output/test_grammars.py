"""The grammar builders, checked by running llguidance's matcher over strings."""

from __future__ import annotations

import json

import llguidance
import llguidance.hf
import pytest

from engine.frontend.tokenizer import load_tokenizer
from engine.structured_output import grammars
from engine.structured_output.grammars import ToolCallFormat, ToolSchema

TOOLS = [ToolSchema("get_time", {"type": "object", "properties": {"zone": {"enum": ["utc"]}},
                                 "required": ["zone"], "additionalProperties": False}),
         ToolSchema("ping", None)]
HERMES = ToolCallFormat("hermes")
CALL = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "utc"}}\n</tool_call>'
PING = '<tool_call>\n{"name": "ping", "arguments": {}}\n</tool_call>'


@pytest.fixture(scope="module")
def tokenizer():
    hf_tokenizer = load_tokenizer("tiny")
    return hf_tokenizer, llguidance.hf.from_tokenizer(hf_tokenizer)


def _accepts(tokenizer, grammar: str, text: str) -> bool:
    """Whether `grammar` accepts exactly `text` (tokenized as the model would produce it)."""
    hf_tokenizer, llg_tokenizer = tokenizer
    matcher = llguidance.LLMatcher(llg_tokenizer, grammar, log_level=0)
    token_ids = hf_tokenizer(text, add_special_tokens=False).input_ids
    return all(matcher.consume_token(token) for token in token_ids) and matcher.is_accepting()


@pytest.mark.parametrize(("text", "accepted"), [
    ('{"a": 1, "b": [true, null]}', True),
    ('{"a":1}', False),  # no flexible whitespace: the separators are those of json.dumps
    ("[1]", False),
])
def test_json_object(tokenizer, text, accepted):
    assert _accepts(tokenizer, grammars.json_object_grammar(), text) is accepted


def test_json_schema_follows_the_schema(tokenizer):
    grammar = grammars.json_schema_grammar({"type": "object", "properties": {
        "n": {"type": "integer", "maximum": 5}}, "required": ["n"],
        "additionalProperties": False})
    assert _accepts(tokenizer, grammar, json.dumps({"n": 3}))
    assert not _accepts(tokenizer, grammar, json.dumps({"n": 7}))
    assert not _accepts(tokenizer, grammar, json.dumps({"m": 1}))


def test_regex_and_choice(tokenizer):
    assert _accepts(tokenizer, grammars.regex_grammar(r"a/b\d+"), "a/b12")
    assert not _accepts(tokenizer, grammars.regex_grammar(r"a/b\d+"), "a/b")
    grammar = grammars.choice_grammar(['say "hi"', "é\n"])
    assert _accepts(tokenizer, grammar, 'say "hi"') and _accepts(tokenizer, grammar, "é\n")
    assert not _accepts(tokenizer, grammar, "say")


def test_tool_calls_in_the_hermes_format(tokenizer):
    single = grammars.tool_calls_grammar(TOOLS, HERMES, parallel=False)
    parallel = grammars.tool_calls_grammar(TOOLS, HERMES, parallel=True)
    assert _accepts(tokenizer, single, CALL) and _accepts(tokenizer, single, PING)
    assert not _accepts(tokenizer, single, CALL + "\n" + PING)
    assert _accepts(tokenizer, parallel, CALL + "\n" + PING)
    assert not _accepts(tokenizer, single, "Sure. " + CALL)
    assert not _accepts(tokenizer, single, CALL.replace("utc", "cet"))


def test_text_then_at_most_one_call(tokenizer):
    grammar = grammars.text_then_one_call_grammar(TOOLS, HERMES)
    assert _accepts(tokenizer, grammar, "Let me check.")
    assert _accepts(tokenizer, grammar, "Let me check." + CALL)
    assert not _accepts(tokenizer, grammar, "x" + CALL + "\n" + PING)
    with pytest.raises(ValueError, match="token"):
        grammars.text_then_one_call_grammar(TOOLS, ToolCallFormat("llama3_json"))


def test_tool_calls_in_the_llama3_json_format(tokenizer):
    grammar = grammars.tool_calls_grammar(TOOLS, ToolCallFormat("llama3_json"), parallel=True)
    call = '{"name": "get_time", "parameters": {"zone": "utc"}}'
    assert _accepts(tokenizer, grammar, call + "; " + '{"name": "ping", "parameters": {}}')


def test_tool_calls_or_json(tokenizer):
    grammar = grammars.tool_calls_or_json_grammar(
        TOOLS, HERMES, parallel=False, schema={"type": "array", "maxItems": 1})
    assert _accepts(tokenizer, grammar, CALL) and _accepts(tokenizer, grammar, "[1]")
    assert not _accepts(tokenizer, grammar, "[1, 2]")


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
