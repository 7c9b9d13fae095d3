"""The bytes of one token as the vocabulary holds them: OpenAI's logprob `bytes`, from which a
client rebuilds a character that spans several tokens (decoded alone, each such token is
U+FFFD).

Byte-level vocabularies (GPT-2's scheme, Llama-3's, SmolLM2's) write each byte as one
printable character: the printable bytes of Latin-1 as themselves, the others as the code
points from 256 on, in byte order. SentencePiece vocabularies with byte fallback write a byte
as `<0xHH>`. Added tokens (the special ones) and pieces of other vocabularies are their text.
"""

from __future__ import annotations

import re
from typing import Any

from tokenizers import decoders

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _byte_level_alphabet() -> dict[str, int]:
    """The byte each character of a byte-level vocabulary stands for."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)}
    alphabet: dict[str, int] = {}
    num_moved = 0
    for byte in range(256):
        if byte in printable:
            alphabet[chr(byte)] = byte
        else:
            alphabet[chr(256 + num_moved)] = byte
            num_moved += 1
    return alphabet


class TokenBytes:
    """Token id -> its bytes for one tokenizer (a transformers fast tokenizer). Owned by the
    server's API handlers; each token's bytes are worked out once (the cache is bounded by
    the vocabulary)."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        backend = getattr(tokenizer, "backend_tokenizer", None)
        byte_level = backend is not None and isinstance(backend.decoder, decoders.ByteLevel)
        self._alphabet = _byte_level_alphabet() if byte_level else None
        self._added_ids = frozenset(getattr(tokenizer, "added_tokens_decoder", {}))
        self._bytes: dict[int, bytes] = {}

    def __call__(self, token_id: int) -> bytes:
        found = self._bytes.get(token_id)
        if found is None:
            found = self._bytes[token_id] = self._read(token_id)
        return found

    def _read(self, token_id: int) -> bytes:
        piece = (None if token_id in self._added_ids
                 else self._tokenizer.convert_ids_to_tokens(token_id))
        if isinstance(piece, str):
            if self._alphabet is not None and all(char in self._alphabet for char in piece):
                return bytes(self._alphabet[char] for char in piece)
            byte_piece = _BYTE_PIECE.fullmatch(piece)
            if byte_piece is not None:
                return bytes([int(byte_piece.group(1), 16)])
        return self._tokenizer.decode([token_id]).encode()  # an added token, or a piece
