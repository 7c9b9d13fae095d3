"""`TokenBytes`: a token's own bytes, put together the text, on a byte-level vocabulary
(the tiny model's, SmolLM2's scheme) and a SentencePiece one with byte fallback."""

from __future__ import annotations

from typing import Any

import pytest

from engine.frontend.token_bytes import TokenBytes
from engine.model.tokenizer import load_tokenizer

TEXT = "😀中 hello\nwörld"


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return load_tokenizer("tiny")


def test_byte_level_tokens_put_together_are_the_text(tokenizer) -> None:
    token_bytes = TokenBytes(tokenizer)
    token_ids = tokenizer(TEXT, add_special_tokens=False).input_ids
    assert b"".join(token_bytes(token_id) for token_id in token_ids) == TEXT.encode()
    assert "\ufffd" in tokenizer.decode(token_ids[:1])  # a part of 😀, alone
    assert token_bytes(token_ids[0]) == "😀".encode()[:len(token_bytes(token_ids[0]))]


def test_a_special_token_is_its_text(tokenizer) -> None:
    token_id = tokenizer.eos_token_id
    assert TokenBytes(tokenizer)(token_id) == tokenizer.decode([token_id]).encode()


class _SentencePiece:
    """A vocabulary without a byte-level decoder: `▁word` pieces and `<0xHH>` bytes."""

    added_tokens_decoder: dict[int, Any] = {}
    pieces = ["▁hello", "<0xF0>", "<0x9F>"]

    def convert_ids_to_tokens(self, token_id: int) -> str:
        return self.pieces[token_id]

    def decode(self, token_ids: list[int]) -> str:
        piece = self.pieces[token_ids[0]]
        return "\ufffd" if piece.startswith("<0x") else piece.replace("▁", " ")


def test_byte_fallback_pieces_are_their_byte() -> None:
    token_bytes = TokenBytes(_SentencePiece())
    assert [token_bytes(token_id) for token_id in range(3)] == [b" hello", b"\xf0", b"\x9f"]
