"""A Messages request as the chat template takes it, where its cache breakpoint falls in the
prompt (on the tiny model's tokenizer: one token a byte, so counts are characters), and the
error event of a stream that fails after it started."""

from __future__ import annotations

import json
from typing import Any

import pytest

from engine.entrypoints.openai.errors import APIError
from engine.entrypoints.openai.messages_prompt import (
    MAX_CACHE_TTL_S,
    check_messages_fields,
    prompt_cache_breakpoint,
    template_conversation,
)
from engine.entrypoints.openai.protocol_messages import MessagesRequest
from engine.entrypoints.openai.serving_messages import _event, _stream_error
from engine.frontend.chat_template import render_chat
from engine.model.tokenizer import load_tokenizer
from engine.sampling_params import CacheBreakpoint

EPHEMERAL = {"type": "ephemeral"}
WEATHER = {"name": "get_weather", "description": "Weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return load_tokenizer("tiny")


def _request(messages: list[dict[str, Any]], **fields: Any) -> MessagesRequest:
    return MessagesRequest.model_validate(
        {"model": "tiny", "max_tokens": 16, "messages": messages, **fields})


TOOL_LOOP = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": [
        {"type": "text", "text": "Let me look."},
        {"type": "tool_use", "id": "call_0-msg_1", "name": "get_weather",
         "input": {"city": "Paris"}}]},
    {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "call_0-msg_1", "content": "sunny"},
        {"type": "text", "text": "And tomorrow?"}]},
]


def test_blocks_become_chat_messages() -> None:
    conversation = template_conversation(_request(TOOL_LOOP, tools=[WEATHER],
                                                  system=[{"type": "text", "text": "Be brief."},
                                                          {"type": "text", "text": "Be kind."}]))
    assert conversation.messages == [
        {"role": "system", "content": "Be brief.\nBe kind."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Let me look.", "tool_calls": [
            {"id": "call_0-msg_1", "type": "function",
             "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "tool_call_id": "call_0-msg_1", "name": "get_weather",
         "content": "sunny"},
        {"role": "user", "content": "And tomorrow?"},
    ]
    assert conversation.tools == [{"type": "function", "function": {
        "name": "get_weather", "description": "Weather in a city",
        "parameters": WEATHER["input_schema"]}}]
    assert not conversation.continues_final and conversation.cache_control is None


def test_errors_thinking_and_a_prefill() -> None:
    messages = [
        *TOOL_LOOP[:2],
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "call_0-msg_1",
                                      "is_error": True,
                                      "content": [{"type": "text", "text": "no network"}]}]},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "hmm"},
                                          {"type": "text", "text": "The weather is"}]},
    ]
    conversation = template_conversation(_request(messages))
    assert conversation.messages[-2:] == [
        {"role": "tool", "tool_call_id": "call_0-msg_1", "name": "get_weather",
         "content": "Error: no network"},
        {"role": "assistant", "content": "The weather is"}]
    assert conversation.continues_final
    empty_prefill = template_conversation(_request([*TOOL_LOOP, {"role": "assistant",
                                                                 "content": ""}]))
    assert not empty_prefill.continues_final
    assert empty_prefill.messages[-1] == {"role": "user", "content": "And tomorrow?"}


def test_a_prefill_is_continued(tokenizer) -> None:
    conversation = template_conversation(_request([
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "My favourite is"}]))
    text = render_chat(tokenizer, conversation.messages, **conversation.render_options())
    assert text.endswith("<|im_start|>assistant\nMy favourite is")


@pytest.mark.parametrize(("messages", "fields", "match"), [
    ([{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "x"}]}],
     {"tools": [WEATHER]}, "answers no tool_use"),
    (TOOL_LOOP, {}, "blocks must define tools"),
    ([TOOL_LOOP[0], {**TOOL_LOOP[1], "content": [*TOOL_LOOP[1]["content"],
                                                 TOOL_LOOP[1]["content"][1]]}, TOOL_LOOP[2]],
     {"tools": [WEATHER]}, "messages.1.content.2: `tool_use` ids must be unique"),
    ([*TOOL_LOOP[:2], {"role": "user", "content": TOOL_LOOP[2]["content"][::-1]}],
     {"tools": [WEATHER]}, "messages.2: tool_result blocks must come first"),
    ([{"role": "user", "content": [{"type": "text", "text": ""}]}], {},
     "messages.0.content.0: text content blocks must be non-empty"),
    ([{"role": "user", "content": " \n"}], {},
     "messages.0.content.0: text content blocks must contain non-whitespace text"),
    ([{"role": "user", "content": "Hi"}], {"system": [{"type": "text", "text": ""}]},
     "system.0: text content blocks must be non-empty"),
    ([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "My answer: "}], {},
     "final assistant content cannot end with trailing whitespace"),
    ([{"role": "user", "content": [
        {"type": "text", "text": "a", "cache_control": EPHEMERAL},
        {"type": "text", "text": "b", "cache_control": {"type": "ephemeral", "ttl": "1h"}}]}],
     {}, "ttl '1h' must come before"),
    ([{"role": "user", "content": [{"type": "tool_use", "id": "x", "name": "get_weather",
                                    "input": {}}]}], {}, "a user message cannot hold tool_use"),
    (TOOL_LOOP[:2], {"tools": [WEATHER]}, "the last message may be an assistant's only"),
    (TOOL_LOOP, {"tools": [WEATHER, WEATHER]}, "more than once"),
    (TOOL_LOOP, {"tool_choice": {"type": "any"}}, "tool_choice 'any' needs tools"),
    (TOOL_LOOP, {"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "other"}},
     "not among the tools"),
    ([{"role": "user", "content": [{"type": "text", "text": str(i), "cache_control": EPHEMERAL}
                                   for i in range(5)]}], {}, "over the limit of 4"),
])
def test_requests_the_api_refuses(messages, fields, match) -> None:
    with pytest.raises(APIError, match=match) as raised:
        body = _request(messages, **fields)
        check_messages_fields(body)
        template_conversation(body)
    assert raised.value.status_code == 400


def test_a_blank_text_block_beside_other_text_is_taken() -> None:
    check_messages_fields(_request([{"role": "user", "content": [
        {"type": "text", "text": " "}, {"type": "text", "text": "Hi"}]}]))


def _breakpoint(tokenizer: Any, body: MessagesRequest, **options: Any
                ) -> tuple[CacheBreakpoint | None, str]:
    conversation = template_conversation(body)
    text = render_chat(tokenizer, conversation.messages, tools=conversation.tools,
                       **conversation.render_options())
    token_ids = tokenizer.encode(text, add_special_tokens=False)
    return prompt_cache_breakpoint(tokenizer, conversation, token_ids, **options), text


def _num_tokens(tokenizer: Any, text: str) -> int:
    return len(tokenizer.encode(text, add_special_tokens=False))


def test_a_breakpoint_on_a_message_block_covers_the_prompt_up_to_its_text(tokenizer) -> None:
    messages = [*TOOL_LOOP[:2], {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "call_0-msg_1", "content": "sunny",
         "cache_control": {"type": "ephemeral", "ttl": "1h"}},
        {"type": "text", "text": "And tomorrow?"}]}]
    found, text = _breakpoint(tokenizer, _request(messages, tools=[WEATHER]))
    # The tool message whole, its closing tags and end of turn included: the conversation
    # cut there renders them too.
    end = text.index("<|im_start|>user", text.index("sunny"))
    assert found == CacheBreakpoint(num_prompt_tokens=_num_tokens(tokenizer, text[:end]),
                                    ttl_s=3600.0)


def test_a_breakpoint_on_the_system_prompt_or_a_tool_covers_all_before_the_first_message(
        tokenizer) -> None:
    system = [{"type": "text", "text": "Be brief.", "cache_control": EPHEMERAL}]
    tool = {**WEATHER, "cache_control": EPHEMERAL}
    for fields in ({"system": system, "tools": [WEATHER]}, {"system": "Be brief.",
                                                            "tools": [tool]}):
        found, text = _breakpoint(tokenizer, _request(TOOL_LOOP, **fields))
        end = text.index("Weather in Paris?")  # the first message's text, after its role
        assert found == CacheBreakpoint(num_prompt_tokens=_num_tokens(tokenizer, text[:end]),
                                        ttl_s=300.0)


def test_a_breakpoint_on_a_tool_use_covers_its_message(tokenizer) -> None:
    assistant = {"role": "assistant", "content": [
        TOOL_LOOP[1]["content"][0], {**TOOL_LOOP[1]["content"][1], "cache_control": EPHEMERAL}]}
    found, text = _breakpoint(tokenizer, _request([TOOL_LOOP[0], assistant, TOOL_LOOP[2]],
                                                  tools=[WEATHER]))
    end = text.index("sunny")  # the tool message's text, after its role and tags
    assert found is not None and found.num_prompt_tokens == _num_tokens(tokenizer, text[:end])
    assert text[:end].endswith("</tool_call><|im_end|>\n<|im_start|>tool\n<tool_response>\n")


def test_the_last_breakpoint_wins_and_a_ttl_past_the_cap_is_clamped(tokenizer) -> None:
    messages = [{"role": "user", "content": [
        {"type": "text", "text": "First.", "cache_control": {"type": "ephemeral", "ttl": "1h"}},
        {"type": "text", "text": "Second.", "cache_control": {"type": "ephemeral", "ttl": "1h"}},
        {"type": "text", "text": "Third."}]}]
    found, text = _breakpoint(tokenizer, _request(messages), max_ttl_s=600.0)
    end = text.index("Second.") + len("Second.")
    assert found == CacheBreakpoint(num_prompt_tokens=_num_tokens(tokenizer, text[:end]),
                                    ttl_s=600.0)
    assert MAX_CACHE_TTL_S == 3600.0
    assert _breakpoint(tokenizer, _request(messages))[0].ttl_s == 3600.0


def test_a_breakpoint_after_the_last_message_covers_the_whole_prompt(tokenizer) -> None:
    messages = [{"role": "user", "content": "Name a colour."},
                {"role": "assistant", "content": [
                    {"type": "thinking", "thinking": "...", "cache_control": EPHEMERAL},
                    {"type": "text", "text": "Blue"}]}]
    found, text = _breakpoint(tokenizer, _request(messages))
    assert found == CacheBreakpoint(num_prompt_tokens=_num_tokens(tokenizer, text),
                                    ttl_s=300.0)
    assert template_conversation(_request(messages[:1])).cache_control is None


def test_a_top_level_breakpoint_is_the_last_blocks(tokenizer) -> None:
    on_block = [*TOOL_LOOP[:2], {"role": "user", "content": [
        TOOL_LOOP[2]["content"][0], {**TOOL_LOOP[2]["content"][1], "cache_control": EPHEMERAL}]}]
    top_level, _ = _breakpoint(tokenizer, _request(TOOL_LOOP, tools=[WEATHER],
                                                   cache_control=EPHEMERAL))
    assert top_level == _breakpoint(tokenizer, _request(on_block, tools=[WEATHER]))[0]
    assert top_level is not None


@pytest.mark.parametrize(("error", "error_type"), [
    (ValueError("the core refused it"), "invalid_request_error"),
    (RuntimeError("boom"), "api_error"),
])
def test_a_failure_after_the_stream_started_is_an_error_event(error, error_type) -> None:
    chunk = _event("error", **_stream_error(error, "req-1"))
    name, data = chunk.decode().strip().split("\n")
    assert name == "event: error"
    body = json.loads(data.removeprefix("data: "))
    assert body["type"] == "error" and body["request_id"] == "req-1"
    assert body["error"]["type"] == error_type and body["error"]["message"]


def test_client_text_cannot_move_a_breakpoint_nor_lose_a_character(tokenizer) -> None:
    # U+10FFFE once marked breakpoints in the rendered text: a client's was stripped and, set
    # early, moved the breakpoint. Nothing is marked in the text now.
    messages = [{"role": "user", "content": [
        {"type": "text", "text": "\U0010fffeFirst."},
        {"type": "text", "text": "Second.", "cache_control": {"type": "ephemeral"}},
        {"type": "text", "text": "Third."}]}]
    conversation = template_conversation(_request(messages))
    assert conversation.messages[-1]["content"] == "\U0010fffeFirst.\nSecond.\nThird."
    found, text = _breakpoint(tokenizer, _request(messages))
    end = text.index("Second.") + len("Second.")
    assert found is not None
    assert found.num_prompt_tokens == _num_tokens(tokenizer, text[:end])


def test_consecutive_user_messages_are_one_turn() -> None:
    conversation = template_conversation(_request([
        {"role": "user", "content": "First."}, {"role": "user", "content": "Second."}]))
    assert conversation.messages == [{"role": "user", "content": "First.\nSecond."}]
