"""Incremental detokenization: text from a growing list of token ids, one piece at a time.

A character may span several tokens (byte-level vocabularies split UTF-8 sequences), and some
tokenizers decode a token differently at the start of a sequence than after others. So each
new piece is the difference between decoding a short window of recent tokens with and without
the new ones; a window that decodes to a trailing U+FFFD (an incomplete character) is held
back until a later token completes it or the request finishes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

_REPLACEMENT_CHAR = "\ufffd"
_NUM_CONTEXT_TOKENS = 6  # prompt tokens decoded ahead of the output, for their spacing


def make_decode_fn(
    tokenizer: Any, skip_special_tokens: bool,
    kept_special_token_ids: frozenset[int] = frozenset(),
) -> Callable[[list[int]], str]:
    """A fast `ids -> text` function: the Rust tokenizer's when there is one (the Python
    wrapper costs several times more per call), else `tokenizer.decode`.

    With `skip_special_tokens`, special tokens are left out of the text, except those in
    `kept_special_token_ids` (markup that a parser of the text reads, such as tool-call tags).
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = tokenizer.decode if backend is None else backend.decode
    dropped = special_token_ids(tokenizer) - kept_special_token_ids
    if not skip_special_tokens or not kept_special_token_ids or not dropped:
        return lambda ids: decoder(ids, skip_special_tokens=skip_special_tokens)
    return lambda ids: decoder([i for i in ids if i not in dropped], skip_special_tokens=False)


def special_token_ids(tokenizer: Any) -> frozenset[int]:
    """The ids that decoding with `skip_special_tokens` leaves out: the tokenizer's special
    tokens, and its added tokens marked special."""
    ids = set(getattr(tokenizer, "all_special_ids", ()))
    added = getattr(tokenizer, "added_tokens_decoder", {})
    ids.update(token_id for token_id, token in added.items() if getattr(token, "special", False))
    return frozenset(ids)


def detokenize_once(
    decode: Callable[[list[int]], str], prompt_token_ids: list[int], token_ids: list[int]
) -> str:
    """The text of `token_ids` at once, decoded after the same prompt context as the
    incremental detokenizer uses, so both give the same text."""
    context = list(prompt_token_ids[-_NUM_CONTEXT_TOKENS:])
    return decode(context + token_ids)[len(decode(context)) :]


class IncrementalDetokenizer:
    """Detokenizes one completion. `push` is called with each batch of new token ids and
    returns the text they completed; `flush` at the end returns whatever was held back."""

    def __init__(
        self, decode: Callable[[list[int]], str], prompt_token_ids: list[int]
    ) -> None:
        self._decode = decode
        self._ids = list(prompt_token_ids[-_NUM_CONTEXT_TOKENS:])
        self._prefix_offset = 0  # start of the decoding window
        self._read_offset = len(self._ids)  # tokens before this are already in the text

    def push(self, token_ids: list[int]) -> str:
        """Appends tokens; returns the text they completed (possibly empty)."""
        pieces = []
        for token_id in token_ids:
            self._ids.append(token_id)
            pieces.append(self._next_piece(final=False))
        return "".join(pieces)

    def flush(self) -> str:
        """The text held back at the end (an incomplete character), at the request's finish."""
        return self._next_piece(final=True) if self._read_offset < len(self._ids) else ""

    def _next_piece(self, *, final: bool) -> str:
        window = self._ids[self._prefix_offset :]
        known_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        text = self._decode(window)
        if not final and (len(text) <= len(known_text) or text.endswith(_REPLACEMENT_CHAR)):
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return text[len(known_text) :]
