"""Tools reach every model: a chat template that leaves out tool definitions, tool calls or
tool results gets them in the Hermes format, which the tool-call parser reads back."""

from __future__ import annotations

import copy
import json
import logging
from typing import Any

import pytest

from engine.frontend.chat_template import (
    TemplateToolSupport,
    render_chat,
    template_tool_support,
    tool_call_block,
    tools_system_prompt,
    with_tool_fallback,
)
from engine.model.tokenizer import load_tokenizer
from engine.tool_calls import HermesToolParser, ParsedToolCall
from tests.engine.model.real_model import require_real_model

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The time in a zone.",
    "parameters": {"type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}}}}
CALL = {"id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
CONVERSATION = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "sunny, 21C"},
]
# Renders every role's text and nothing else, and fails on a `tool` message.
PLAIN_TEMPLATE = (
    "{% for message in messages %}{% if message.role == 'tool' %}"
    "{{ raise_exception('no tool role') }}{% endif %}"
    "<{{ message.role }}>{{ message.content }}</{{ message.role }}>\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}")


@pytest.fixture(scope="module")
def smollm2() -> Any:
    return load_tokenizer(str(require_real_model()))


@pytest.fixture(scope="module")
def tiny() -> Any:
    return load_tokenizer("tiny")


def _with_template(tokenizer: Any, template: str) -> Any:
    other = copy.deepcopy(tokenizer)
    other.chat_template = template
    return other


def test_smollm2s_template_leaves_out_tools_and_calls(smollm2) -> None:
    assert template_tool_support(smollm2) == TemplateToolSupport(
        renders_tools=False, renders_tool_calls=False, renders_tool_results=True)
    assert (render_chat(smollm2, CONVERSATION[:1], tools=[WEATHER])
            != render_chat(smollm2, CONVERSATION[:1]))


def test_the_rendered_prompt_holds_every_offered_tools_name_and_schema(smollm2) -> None:
    text = render_chat(smollm2, CONVERSATION[:1], tools=[WEATHER, TIME])
    for tool in (WEATHER, TIME):
        function = tool["function"]
        assert json.dumps(function) in text
        assert function["name"] in text and json.dumps(function["parameters"]) in text
    system, user = text.split("<|im_start|>user\n")
    assert system.startswith("<|im_start|>system\n# Tools")
    assert user.startswith("Weather in Paris?")


def test_a_system_message_keeps_its_text_before_the_tools(smollm2) -> None:
    messages = [{"role": "system", "content": "Be brief."}, *CONVERSATION[:1]]
    text = render_chat(smollm2, messages, tools=[WEATHER])
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    assert text.count("<|im_start|>system") == 1


def test_calls_and_results_are_rendered_as_the_parser_reads_them(smollm2) -> None:
    text = render_chat(smollm2, CONVERSATION, tools=[WEATHER])
    assistant = text.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0]
    parsed = HermesToolParser().parse(assistant)
    assert parsed.tool_calls == (ParsedToolCall("get_weather", '{"city": "Paris"}'),)
    assert "<|im_start|>tool\n<tool_response>\nsunny, 21C\n</tool_response><|im_end|>" in text


def test_a_template_that_renders_tools_is_left_as_it_is(tiny) -> None:
    assert template_tool_support(tiny).is_complete
    expected = tiny.apply_chat_template(CONVERSATION, tools=[WEATHER],
                                        add_generation_prompt=True, tokenize=False)
    assert render_chat(tiny, CONVERSATION, tools=[WEATHER]) == expected


def test_results_a_template_cannot_render_become_one_user_message(tiny) -> None:
    plain = _with_template(tiny, PLAIN_TEMPLATE)
    assert template_tool_support(plain) == TemplateToolSupport(False, False, False)
    second = {"role": "tool", "tool_call_id": "call_2", "content": "cloudy"}
    text = render_chat(plain, [*CONVERSATION, second, {"role": "user", "content": "And?"}],
                       tools=[WEATHER])
    assert text.endswith(
        "<user><tool_response>\nsunny, 21C\n</tool_response>\n"
        "<tool_response>\ncloudy\n</tool_response></user>\n<user>And?</user>\n<assistant>")
    assert text.startswith("<system>" + tools_system_prompt([WEATHER]) + "</system>\n")
    assert f"<assistant>{tool_call_block(CALL)}</assistant>" in text


def test_calls_keep_the_assistants_text_and_arguments_sent_as_text(tiny) -> None:
    messages = [{"role": "assistant", "content": "Let me look.", "tool_calls": [
        {"id": "a", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}},
        {"id": "b", "type": "function",
         "function": {"name": "get_time", "arguments": {"zone": "cet"}}}]}]
    (rendered,), tools = with_tool_fallback(messages, None,
                                            TemplateToolSupport(True, False, True))
    assert tools is None and "tool_calls" not in rendered
    parsed = HermesToolParser().parse(rendered["content"])
    assert parsed.content == "Let me look."
    assert parsed.tool_calls == (ParsedToolCall("get_weather", '{"city": "Rome"}'),
                                 ParsedToolCall("get_time", '{"zone": "cet"}'))


def test_the_fallback_is_logged_once_per_template(tiny, caplog) -> None:
    template = PLAIN_TEMPLATE.replace("<assistant>", "<assistant turn>")
    plain = _with_template(tiny, template)
    with caplog.at_level(logging.INFO, logger="engine.frontend.chat_template"):
        render_chat(plain, CONVERSATION[:1], tools=[WEATHER])
        render_chat(_with_template(tiny, template), CONVERSATION[:1], tools=[WEATHER])
        render_chat(plain, CONVERSATION[:1])  # no tools: no fallback, no log
    (record,) = caplog.records
    assert "leaves out tool definitions, tool calls, tool results" in record.getMessage()
