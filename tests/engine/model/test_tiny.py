"""The embedded default model's tokenizer and chat template, loaded with no network."""

from __future__ import annotations

import json
from functools import cache

import pytest
from hypothesis import given
from hypothesis import strategies as st
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from engine.model.directory import load_arch
from engine.model.tiny import TINY_MODEL_DIR


@cache
def load_tokenizer() -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(TINY_MODEL_DIR)


@pytest.fixture
def tokenizer() -> PreTrainedTokenizerBase:
    return load_tokenizer()


def test_vocabulary_matches_the_model(tokenizer: PreTrainedTokenizerBase) -> None:
    arch = load_arch("tiny")
    assert len(tokenizer) == arch.vocab_size
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.eos_token_id == arch.eos_token_ids[0]
    assert tokenizer.convert_tokens_to_ids("<|endoftext|>") in arch.eos_token_ids


@given(st.text(max_size=200))
def test_any_text_round_trips(text: str) -> None:
    tokenizer = load_tokenizer()
    token_ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(token_ids) == text
    if not any(token in text for token in tokenizer.get_added_vocab()):
        assert len(token_ids) == len(text.encode("utf-8"))  # one token per byte


def test_special_tokens_are_single_tokens(tokenizer: PreTrainedTokenizerBase) -> None:
    token_ids = tokenizer.encode("<tool_call>x</tool_call>", add_special_tokens=False)
    assert tokenizer.convert_ids_to_tokens(token_ids) == ["<tool_call>", "x", "</tool_call>"]


def test_chat_template_renders_tools_calls_and_results(
    tokenizer: PreTrainedTokenizerBase,
) -> None:
    tools = [{"type": "function", "function": {
        "name": "get_weather", "description": "Weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21C"},
    ]
    text = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True,
                                         tokenize=False)
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools")
    assert json.dumps(tools[0]["function"]) in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' \
        in text
    assert "<|im_start|>tool\n<tool_response>\nsunny, 21C\n</tool_response><|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")


def test_chat_template_without_tools(tokenizer: PreTrainedTokenizerBase) -> None:
    messages = [{"role": "user", "content": [{"type": "text", "text": "hi"}]},
                {"role": "assistant", "content": "hello"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nhello<|im_end|>\n"
