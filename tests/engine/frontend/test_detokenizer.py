"""Incremental detokenization on the tiny model's byte-level tokenizer."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from engine.frontend.detokenizer import IncrementalDetokenizer, make_decode_fn

IM_END = 258


def detokenize(tokenizer, token_ids: list[int], *, chunk: int = 1, skip: bool = True,
               prompt: list[int] | None = None) -> list[str]:
    detokenizer = IncrementalDetokenizer(make_decode_fn(tokenizer, skip), prompt or [])
    pieces = [detokenizer.push(token_ids[i : i + chunk]) for i in range(0, len(token_ids), chunk)]
    return [*pieces, detokenizer.flush()]


def test_multibyte_characters_split_across_tokens_are_held_until_complete(tokenizer) -> None:
    token_ids = list("日本é!".encode())  # byte-level: one token per byte
    pieces = detokenize(tokenizer, token_ids)
    assert pieces[:3] == ["", "", "日"]
    assert pieces[3:6] == ["", "", "本"]
    assert pieces[6:8] == ["", "é"]
    assert "".join(pieces) == "日本é!"
    assert all("\ufffd" not in piece for piece in pieces)


def test_a_character_split_across_steps_is_emitted_once_whole(tokenizer) -> None:
    token_ids = list("a😀b".encode())  # the emoji is 4 bytes
    pieces = detokenize(tokenizer, token_ids, chunk=3)
    assert pieces == ["a", "😀b", ""]


def test_invalid_bytes_come_out_as_replacement_characters(tokenizer) -> None:
    pieces = detokenize(tokenizer, [ord("x"), 0xFF, ord("y")])
    assert "".join(pieces) == "x\ufffdy"


def test_a_trailing_incomplete_character_is_flushed_at_the_end(tokenizer) -> None:
    pieces = detokenize(tokenizer, [ord("x"), 0xE6, 0x97])
    assert pieces[:3] == ["x", "", ""]
    assert pieces[3] == "\ufffd"


def test_special_tokens_are_skipped_or_kept(tokenizer) -> None:
    token_ids = [ord("o"), ord("k"), IM_END]
    assert "".join(detokenize(tokenizer, token_ids, skip=True)) == "ok"
    assert "".join(detokenize(tokenizer, token_ids, skip=False)) == "ok<|im_end|>"


def test_prompt_context_does_not_leak_into_the_output(tokenizer) -> None:
    prompt = list("héllo wor".encode())
    pieces = detokenize(tokenizer, list("ld 日".encode()), prompt=prompt)
    assert "".join(pieces) == "ld 日"


@pytest.mark.parametrize("chunk", [1, 2, 5])
@given(text=st.text(max_size=40))
def test_concatenated_pieces_equal_the_full_decode(tokenizer, chunk: int, text: str) -> None:
    token_ids = tokenizer(text, add_special_tokens=False).input_ids
    # Special tokens kept: the text may spell one (for example "<tool_call>").
    assert "".join(detokenize(tokenizer, token_ids, chunk=chunk, skip=False)) == text


def test_kept_special_tokens_survive_skipping_the_others(tokenizer) -> None:
    text = "a<|im_start|>b<tool_call>{}</tool_call></tool_response><|im_end|>"
    token_ids = tokenizer(text, add_special_tokens=False).input_ids
    markers = frozenset(tokenizer.convert_tokens_to_ids(["<tool_call>", "</tool_call>"]))
    assert make_decode_fn(tokenizer, True, markers)(token_ids) == "ab<tool_call>{}</tool_call>"
    assert make_decode_fn(tokenizer, True)(token_ids) == "ab{}"
    assert make_decode_fn(tokenizer, False, markers)(token_ids) == text  # skipping nothing
    pieces = detokenize(tokenizer, token_ids)
    assert "".join(pieces) == "ab{}"
    incremental = IncrementalDetokenizer(make_decode_fn(tokenizer, True, markers), [])
    streamed = "".join(incremental.push([t]) for t in token_ids) + incremental.flush()
    assert streamed == "ab<tool_call>{}</tool_call>"
