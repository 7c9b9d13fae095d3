"""The pipeline's shared pieces: a request's tool offer and one choice's output."""

from __future__ import annotations

import json

import pytest

from engine.entrypoints.openai.errors import APIError
from engine.entrypoints.openai.generation import ChoiceOutput, ForcedTool, OfferedTool, ToolOffer
from engine.entrypoints.openai.structured_outputs import (
    GrammarChecker,
    json_schema_constraint,
    offer_structured_output,
)
from engine.frontend.request_outputs import CompletionOutput
from engine.model.tokenizer import load_tokenizer
from engine.tool_calls import make_tool_parser

OPEN_SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}},
               "additionalProperties": True}
TOOL = OfferedTool("locate", OPEN_SCHEMA, strict=True, parameters_field="tools.0.input_schema")
CALL = '<tool_call>{"name": "locate", "arguments": {"city": "Paris"}}</tool_call>'


def _delta(text: str, *, finished: bool = False) -> CompletionOutput:
    return CompletionOutput(index=0, text=text, token_ids=[1],
                            finish_reason="stop" if finished else None)


@pytest.mark.parametrize(("offer", "format_parallel"), [
    (ToolOffer(), None),
    (ToolOffer((TOOL,), choice="none"), None),
    (ToolOffer((TOOL,)), True),
    (ToolOffer((TOOL,), parallel=False), False),
])
def test_an_offer_says_how_the_output_is_read(offer, format_parallel) -> None:
    call_format = offer.call_format("hermes")
    if format_parallel is None:
        assert call_format is None and not offer.enabled
        return
    assert call_format is not None and call_format.tool_names == ("locate",)
    assert call_format.parallel is format_parallel


def test_only_a_choice_other_than_auto_or_one_call_at_most_constrains() -> None:
    assert not ToolOffer((TOOL,)).may_constrain
    assert ToolOffer((TOOL,), parallel=False).may_constrain
    assert ToolOffer((TOOL,), choice="required").may_constrain
    assert ToolOffer((TOOL,), choice=ForcedTool("locate")).may_constrain
    assert not ToolOffer((TOOL,), choice="none").may_constrain


@pytest.fixture(scope="module")
def checker() -> GrammarChecker:
    return GrammarChecker(load_tokenizer("tiny"))


def test_errors_name_the_fields_the_api_named(checker) -> None:
    with pytest.raises(APIError) as raised:
        offer_structured_output(ToolOffer((TOOL,), choice="required"), None, checker, "auto")
    assert raised.value.param == "tools.0.input_schema"
    assert "tools.0.input_schema" in raised.value.message
    constraint = json_schema_constraint("output_config.format.schema", {"type": "object"},
                                        strict=False)
    offer = ToolOffer((OfferedTool("t", None, strict=False, parameters_field="x"),),
                      choice="required", choice_name="{'type': 'any'}")
    with pytest.raises(APIError) as raised:
        offer_structured_output(offer, constraint, checker, "auto")
    assert raised.value.param == "output_config.format.schema"
    assert "tool_choice {'type': 'any'}" in raised.value.message


def test_a_forced_tool_is_one_call_of_it(checker) -> None:
    locate = OfferedTool("locate", OPEN_SCHEMA, strict=False, parameters_field="x")
    other = OfferedTool("other", None, strict=False, parameters_field="y")
    spec = offer_structured_output(ToolOffer((locate, other), choice=ForcedTool("other")),
                                   None, checker, "auto")
    assert spec is not None and spec.kind == "tool_calls" and spec.param == "tools"
    assert "other" in spec.grammar and "locate" not in spec.grammar


def test_streamed_text_adds_up_to_the_whole_output_and_calls_come_at_the_end() -> None:
    text = f"Let me look. {CALL}"
    parser = ToolOffer((TOOL,)).call_format("hermes").make_parser()
    whole = ChoiceOutput(parser=parser)
    assert whole.push(_delta(text, finished=True)) == "Let me look."
    streamed = ChoiceOutput(parser=parser)
    sent = "".join(streamed.push(_delta(text[i:i + 5], finished=i + 5 >= len(text)))
                   for i in range(0, len(text), 5))
    assert sent == whole.text == streamed.text == "Let me look."
    assert streamed.tool_calls == whole.tool_calls
    (call,) = whole.tool_calls
    assert call.name == "locate" and json.loads(call.arguments) == {"city": "Paris"}
    assert whole.finish_reason == "stop" and whole.num_tokens == 1
    assert streamed.num_tokens == -(-len(text) // 5)  # one token a delta here


def test_without_a_parser_every_delta_is_sent_as_it_comes() -> None:
    output = ChoiceOutput(parser=None)
    assert output.push(_delta(CALL)) == CALL
    assert output.finish_reason is None and output.last is None
    assert output.push(_delta("", finished=True)) == ""
    assert output.tool_calls == () and output.text == CALL and output.finish_reason == "stop"


def test_a_parser_restricted_to_the_offer_reads_another_name_as_text() -> None:
    parser = ToolOffer((OfferedTool("weather", None, False, "x"),)).call_format(
        "hermes").make_parser()
    output = ChoiceOutput(parser=parser)
    output.push(_delta(CALL, finished=True))
    assert output.tool_calls == () and output.text == CALL
    assert make_tool_parser("hermes").parse(CALL).tool_calls  # a call of another tool


@pytest.mark.parametrize(("finish_reason", "stop_reason", "ends_in_calls"), [
    ("stop", None, True),  # the model ended after its call
    ("stop", "Par", False),  # a stop string ended it inside a second call
    ("length", None, False),  # so did the token limit
])
def test_an_output_cut_in_a_call_does_not_end_in_calls(finish_reason, stop_reason,
                                                       ends_in_calls) -> None:
    """What the finish and stop reasons say: chat's "tool_calls", Anthropic's "tool_use"."""
    second = '<tool_call>{"name": "locate", "arguments": {"city": "Par'
    text = CALL if stop_reason is None and finish_reason == "stop" else CALL + second
    output = ChoiceOutput(parser=ToolOffer((TOOL,)).call_format("hermes").make_parser())
    output.push(CompletionOutput(index=0, text=text, token_ids=[1],
                                 finish_reason=finish_reason, stop_reason=stop_reason))
    assert output.ends_in_calls is ends_in_calls
    assert [call.name for call in output.calls_shown] == ["locate"] * (1 if ends_in_calls
                                                                       else 2)
    assert output.text == ""

