"""Tools reach a model whose chat template ignores them (SmolLM2's), over Chat Completions
and the Responses API: the prompt the engine runs holds every offered tool's name and schema,
an earlier turn's tool call comes back in the format the parser reads, and a call the grammar
forces is written in that same format (`<tool_call>` blocks). The helper that
measures the tool-call rate `docs/frameworks.md` reports (`tool_call_rate.py`) reads a call.

Without the real model in the cache these tests skip (see `tests/engine/model/real_model.py`).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from engine.entrypoints.openai.serving import ServerSettings
from engine.entrypoints.openai.structured_outputs import GrammarChecker
from engine.frontend.chat_template import render_chat, template_tool_support
from engine.model.tokenizer import load_tokenizer
from engine.structured_output.grammars import ToolCallFormat
from tests.engine.entrypoints.openai.conftest import MAX_BODY_BYTES, ServerThread, start_server
from tests.engine.entrypoints.openai.tool_call_rate import PROMPTS, answer
from tests.engine.model.real_model import REAL_MODEL, require_real_model

WEATHER = {"name": "get_weather", "description": "The current weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                          "required": ["city"]}}
TIME = {"name": "get_time", "description": "The current time in a time zone.",
        "parameters": {"type": "object", "properties": {"zone": {"type": "string"}},
                       "required": ["zone"]}}
CHAT_TOOLS = [{"type": "function", "function": tool} for tool in (WEATHER, TIME)]
QUESTION = "What is the weather in Paris?"


@pytest.fixture(scope="module")
def server() -> Iterator[ServerThread]:
    checkout = require_real_model()
    server = start_server(
        model=str(checkout), max_model_len=2048, max_num_batched_tokens=512,
        settings=ServerSettings(served_model_name=REAL_MODEL,
                                max_request_body_bytes=MAX_BODY_BYTES))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return load_tokenizer(str(require_real_model()))


def _chat(server: ServerThread, messages: list[dict[str, Any]], **fields: Any) -> Any:
    return server.client().chat.completions.create(
        model=REAL_MODEL, messages=messages, max_tokens=40, temperature=0,
        extra_body={"return_token_ids": True}, **fields)


def test_a_chats_prompt_holds_every_offered_tool(server, tokenizer) -> None:
    messages = [{"role": "user", "content": QUESTION}]
    with_tools = _chat(server, messages, tools=CHAT_TOOLS, tool_choice="auto")
    without = _chat(server, messages)
    prompt = tokenizer.decode(with_tools.model_extra["prompt_token_ids"])
    for tool in (WEATHER, TIME):
        assert tool["name"] in prompt and json.dumps(tool["parameters"]) in prompt
        assert tool["name"] not in tokenizer.decode(without.model_extra["prompt_token_ids"])
    assert with_tools.usage.prompt_tokens > without.usage.prompt_tokens


def test_a_responses_turn_renders_its_tools_and_the_calls_it_sends_back(server,
                                                                        tokenizer) -> None:
    tools = [{"type": "function", **tool} for tool in (WEATHER, TIME)]
    client = server.client()
    first = client.responses.create(model=REAL_MODEL, input=QUESTION, tools=tools,
                                    tool_choice="auto", max_output_tokens=40, temperature=0)
    expected = render_chat(tokenizer, [{"role": "user", "content": QUESTION}],
                           tools=CHAT_TOOLS)
    assert first.usage.input_tokens == len(tokenizer(expected, add_special_tokens=False)
                                           .input_ids)
    # A turn that re-sends a function call and its output: the call is rendered as a Hermes
    # block, the output inside <tool_response> tags.
    conversation = [
        {"role": "user", "content": QUESTION},
        {"type": "function_call", "call_id": "call_7", "name": "get_weather",
         "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "call_7", "output": "Sunny, 21 C"}]
    second = client.responses.create(model=REAL_MODEL, input=conversation, tools=tools,
                                     max_output_tokens=40, temperature=0)
    rendered = render_chat(tokenizer, [
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_7", "type": "function",
             "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "tool_call_id": "call_7", "name": "get_weather",
         "content": "Sunny, 21 C"}], tools=CHAT_TOOLS)
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": '
            '{"city": "Paris"}}\n</tool_call><|im_end|>') in rendered
    assert "<tool_response>\nSunny, 21 C\n</tool_response>" in rendered
    assert second.usage.input_tokens == len(tokenizer(rendered, add_special_tokens=False)
                                            .input_ids)
    server.wait_idle()


def test_the_rate_helper_counts_a_valid_call_of_the_right_tool(server) -> None:
    question, tool = next((question, tool) for question, tool in PROMPTS
                          if question.startswith("Convert 100 US dollars"))
    forced = answer(server.client(), REAL_MODEL, question, tool, tool_choice="required")
    assert forced.is_valid_call and forced.is_right_tool
    assert forced.calls[0][1]["amount"] == 100


def test_the_grammar_writes_calls_as_the_fallback_teaches(tokenizer) -> None:
    assert not template_tool_support(tokenizer).renders_tools
    checker = GrammarChecker(tokenizer)
    # SmolLM2's vocabulary has no `<tool_call>` token: the grammar spells the markers out.
    assert checker.tool_call_format("auto") == ToolCallFormat("hermes", markers_are_tokens=False)
    assert checker.tool_call_format("hermes") == ToolCallFormat("hermes",
                                                                markers_are_tokens=False)
    assert checker.tool_call_format("llama3_json") == ToolCallFormat("llama3_json")
    assert GrammarChecker(load_tokenizer("tiny")).tool_call_format("auto") == ToolCallFormat(
        "hermes", markers_are_tokens=True)


@pytest.mark.parametrize(("tool_choice", "parallel"), [
    ("required", False), ("required", True),
    ({"type": "function", "function": {"name": "get_time"}}, False),
    ({"type": "function", "function": {"name": "get_time"}}, True)])
def test_a_forced_call_is_a_tool_call_block_the_parser_reads(server, tokenizer, tool_choice,
                                                             parallel) -> None:
    # With parallel calls allowed the grammar puts nothing between blocks: with a newline
    # there this model repeated its call until max_tokens.
    reply = server.client().chat.completions.create(
        model=REAL_MODEL, messages=[{"role": "user", "content": QUESTION}], tools=CHAT_TOOLS,
        tool_choice=tool_choice, parallel_tool_calls=parallel, max_tokens=96, temperature=0,
        extra_body={"return_token_ids": True})
    choice = reply.choices[0]
    text = tokenizer.decode(choice.model_extra["token_ids"], skip_special_tokens=True)
    assert text.startswith('<tool_call>\n{"name": "') and text.endswith("\n</tool_call>")
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    expected = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]
    if isinstance(tool_choice, dict):
        assert call.function.name == "get_time"
    arguments = json.loads(call.function.arguments)
    assert set(expected["parameters"]["required"]) <= set(arguments)
    assert json.loads(text.removeprefix("<tool_call>").removesuffix("</tool_call>")) == {
        "name": call.function.name, "arguments": arguments}
