"""Chat streams against a live server: the role arrives with the first token, streamed content
adds up to the unstreamed content of the same seed (with and without tools, with and without a
tool call), and special tokens stay out of the content but for the tool-call markers."""

from __future__ import annotations

import json
from typing import Any

import pytest

from engine.frontend.detokenizer import special_token_ids
from engine.tool_calls import TOOL_CALL_MARKERS
from tests.engine.entrypoints.openai.conftest import ServerThread

MESSAGES = [{"role": "user", "content": "What is in this directory?"}]
TOOLS = [{"type": "function", "function": {
    "name": "bash", "description": "run a command",
    "parameters": {"type": "object", "properties": {"command": {"type": "string"}}}}}]
SEEDS = [1, 2, 3, 4, 5, 6]


def _whole_and_streamed(server: ServerThread, **kwargs: Any) -> tuple[Any, list[Any]]:
    client = server.client()
    whole = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    return whole, chunks


def _choice_chunks(chunks: list[Any], index: int) -> list[Any]:
    return [c.choices[0] for c in chunks if c.choices and c.choices[0].index == index]


def test_each_choice_gets_its_role_with_its_first_token(server):
    chunks = list(server.client().chat.completions.create(
        model="tiny", messages=MESSAGES, n=2, seed=11, max_tokens=6, logprobs=True,
        stream=True, extra_body={"return_token_ids": True, "ignore_eos": True}))
    assert chunks[0].model_extra["prompt_token_ids"]
    for index in (0, 1):
        choice_chunks = _choice_chunks(chunks, index)
        first, rest = choice_chunks[0], choice_chunks[1:]
        assert first.delta.role == "assistant"
        # The token the role waited for comes in the same chunk.
        assert len(first.model_extra["token_ids"]) >= 1
        assert len(first.logprobs.content) == len(first.model_extra["token_ids"])
        assert all(chunk.delta.role is None for chunk in rest)
        assert sum(len(chunk.model_extra["token_ids"]) for chunk in choice_chunks) == 6


def test_a_stream_sends_nothing_before_its_first_token(server):
    """No chunk without a token: every chunk before the last of each choice carries one."""
    chunks = list(server.client().chat.completions.create(
        model="tiny", messages=MESSAGES, seed=5, max_tokens=5, stream=True,
        extra_body={"return_token_ids": True, "ignore_eos": True}))
    choice_chunks = _choice_chunks(chunks, 0)
    assert choice_chunks[0].delta.role == "assistant"
    assert all(chunk.model_extra["token_ids"] for chunk in choice_chunks)


@pytest.mark.parametrize("tools", [None, TOOLS], ids=["no-tools", "tools"])
@pytest.mark.parametrize("seed", SEEDS)
def test_streamed_content_adds_up_to_the_whole_content(server, seed, tools):
    kwargs: dict[str, Any] = {"model": "tiny", "messages": MESSAGES, "seed": seed,
                              "max_tokens": 48, "extra_body": {"return_token_ids": True}}
    if tools is not None:
        kwargs["tools"] = tools
    whole, chunks = _whole_and_streamed(server, **kwargs)
    (choice,) = whole.choices
    tokens = [t for c in _choice_chunks(chunks, 0) for t in c.model_extra["token_ids"]]
    assert tokens == choice.model_extra["token_ids"]  # the same seed, the same completion
    streamed = "".join(c.delta.content or "" for c in _choice_chunks(chunks, 0))
    assert streamed == (choice.message.content or "")
    streamed_calls = [call for c in _choice_chunks(chunks, 0) for call in c.delta.tool_calls or ()]
    assert [(c.function.name, c.function.arguments) for c in streamed_calls] == [
        (c.function.name, c.function.arguments) for c in choice.message.tool_calls or ()]


def _special_texts(server: ServerThread) -> set[str]:
    tokenizer = server.engine.tokenizer
    return {tokenizer.decode([token_id]) for token_id in special_token_ids(tokenizer)}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_with_tools_the_content_holds_no_special_token_but_the_markers(server, stream):
    forbidden = _special_texts(server) - set(TOOL_CALL_MARKERS)
    special_ids = special_token_ids(server.engine.tokenizer)
    marker_ids = server.engine.processor.special_token_ids(TOOL_CALL_MARKERS)
    num_forbidden_generated = 0
    for seed in SEEDS:
        kwargs: dict[str, Any] = {
            "model": "tiny", "messages": MESSAGES, "tools": TOOLS, "seed": seed,
            "max_tokens": 64, "extra_body": {"return_token_ids": True, "ignore_eos": True}}
        if stream:
            chunks = _choice_chunks(list(server.client().chat.completions.create(
                stream=True, **kwargs)), 0)
            content = "".join(chunk.delta.content or "" for chunk in chunks)
            token_ids = [t for chunk in chunks for t in chunk.model_extra["token_ids"]]
        else:
            (choice,) = server.client().chat.completions.create(**kwargs).choices
            content = choice.message.content or ""
            token_ids = choice.model_extra["token_ids"]
        num_forbidden_generated += sum(t in special_ids - marker_ids for t in token_ids)
        assert not [text for text in forbidden if text in content], (seed, content)
    assert num_forbidden_generated > 0  # the model did generate them: they were left out


def test_with_tools_skip_special_tokens_false_keeps_them_all(server):
    special_ids = special_token_ids(server.engine.tokenizer)
    forbidden = _special_texts(server) - set(TOOL_CALL_MARKERS)
    kept = 0
    for seed in SEEDS:
        (choice,) = server.client().chat.completions.create(
            model="tiny", messages=MESSAGES, tools=TOOLS, seed=seed, max_tokens=64,
            extra_body={"return_token_ids": True, "ignore_eos": True,
                        "skip_special_tokens": False}).choices
        if any(t in special_ids for t in choice.model_extra["token_ids"]):
            kept += any(text in (choice.message.content or "") for text in forbidden)
    assert kept > 0


# The scripted server: every turn answers 'Let me look.\n<tool_call>...</tool_call>'.
SCRIPTED_CASES = {
    "tool-call": {"tools": TOOLS},
    "tool-not-offered": {"tools": [{"type": "function", "function": {"name": "python"}}]},
    "tool-choice-none": {"tools": TOOLS, "tool_choice": "none"},
    "no-tools": {},
}


@pytest.mark.parametrize("case", list(SCRIPTED_CASES))
def test_scripted_stream_adds_up_to_the_whole_response(scripted_server, case):
    whole, chunks = _whole_and_streamed(
        scripted_server, model="scripted", messages=MESSAGES, max_tokens=200,
        **SCRIPTED_CASES[case])
    (choice,) = whole.choices
    choice_chunks = _choice_chunks(chunks, 0)
    streamed = "".join(chunk.delta.content or "" for chunk in choice_chunks)
    assert streamed == (choice.message.content or "")
    calls = [call for chunk in choice_chunks for call in chunk.delta.tool_calls or ()]
    expected = choice.message.tool_calls or []
    assert [json.loads(c.function.arguments) for c in calls] == [
        json.loads(c.function.arguments) for c in expected]
    assert choice_chunks[-1].finish_reason == choice.finish_reason
    if case == "tool-call":
        # The line break before the call is not content, streamed or not.
        assert choice.message.content == "Let me look."
        assert choice.finish_reason == "tool_calls"
    else:
        assert "<|im_end|>" not in streamed
