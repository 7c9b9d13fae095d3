"""Prompt text to token ids, cheap for texts far longer than the model takes.

A chat of megabytes is a few seconds of tokenization on a thread the server shares with every
tenant. Through a Hugging Face tokenizer's `__call__`, most of that is harmless (the Rust
encoder releases the GIL), but the rest is not: the millions of ids and attention-mask values
become Python lists and the encoding's per-token strings and offsets are freed, all with the GIL
held, about 0.4 s for 8 MB, in which no other request's tokens are streamed. `TextEncoder`
encodes with the Rust tokenizer directly and without character offsets, counts the tokens
before anything becomes a Python object, and builds the id list only for a text that fits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class EncodedText:
    """A text's token count and, when it is at most the `max_tokens` asked for, its ids."""

    num_tokens: int
    token_ids: list[int] | None


class TextEncoder:
    """Encodes prompt texts with one Hugging Face tokenizer; owns a private copy of its Rust
    tokenizer (settings that the shared one's other users change cannot race with it).

    Token ids are those of `tokenizer(text, add_special_tokens=...).input_ids`. A tokenizer
    without a Rust backend (a slow or test tokenizer) is called as it is.
    """

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._encode_batch = _rust_encode_batch(tokenizer)

    def encode(self, text: str, *, add_special_tokens: bool, max_tokens: int) -> EncodedText:
        """`text` tokenized; `token_ids` is None when it has more than `max_tokens` tokens.
        Called on the frontend's preparation threads, never on the event loop."""
        if self._encode_batch is None:
            token_ids = list(self._tokenizer(text, add_special_tokens=add_special_tokens)
                             .input_ids)
            return EncodedText(len(token_ids),
                               token_ids if len(token_ids) <= max_tokens else None)
        (encoding,) = self._encode_batch([text], add_special_tokens=add_special_tokens)
        num_tokens = len(encoding)
        return EncodedText(num_tokens, encoding.ids if num_tokens <= max_tokens else None)


def _rust_encode_batch(tokenizer: Any) -> Any:
    """The `encode_batch_fast` (or, in tokenizers before 0.21, `encode_batch`) of a private copy
    of `tokenizer`'s Rust tokenizer set up as `tokenizer.__call__` sets it (no truncation, no
    padding, special tokens split only if the tokenizer says so); None without one."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or not hasattr(backend, "to_str"):
        return None
    from tokenizers import Tokenizer

    private = Tokenizer.from_str(backend.to_str())
    private.no_truncation()
    private.no_padding()
    private.encode_special_tokens = bool(getattr(tokenizer, "split_special_tokens", False))
    return getattr(private, "encode_batch_fast", private.encode_batch)
