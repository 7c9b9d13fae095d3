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

# The methods between a fast tokenizer's `__call__` and its Rust tokenizer (transformers 4.x
# and 5.x). A class that overrides one of them changes the text or the ids on the way (Code
# Llama's `<FILL_ME>` infilling, for one), so its calls are not bypassed.
_ENCODING_PATH = ("__call__", "_call_one", "encode_plus", "_encode_plus", "_batch_encode_plus")


@dataclass(frozen=True)
class EncodedText:
    """A text's token count and, when it is at most the `max_tokens` asked for, its ids."""

    num_tokens: int
    token_ids: list[int] | None


class TextEncoder:
    """Encodes prompt texts with one Hugging Face tokenizer (shared, not owned: it reads the
    tokenizer's current vocabulary and settings at each call).

    Token ids are those of `tokenizer(text, add_special_tokens=...).input_ids`. A tokenizer
    without a Rust backend (a slow or test tokenizer), one whose class changes the encoding
    path, and a Rust backend set to truncate or pad (which `__call__` would turn off) are
    called as they are.
    """

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._backend = _bypassable_backend(tokenizer)

    def encode(self, text: str, *, add_special_tokens: bool, max_tokens: int) -> EncodedText:
        """`text` tokenized; `token_ids` is None when it has more than `max_tokens` tokens.
        Called on the frontend's preparation threads or in its body-parsing children, never
        on the event loop."""
        encode_batch = self._rust_encode_batch()
        if encode_batch is None:
            token_ids = list(self._tokenizer(text, add_special_tokens=add_special_tokens)
                             .input_ids)
            return EncodedText(len(token_ids),
                               token_ids if len(token_ids) <= max_tokens else None)
        (encoding,) = encode_batch([text], add_special_tokens=add_special_tokens)
        num_tokens = len(encoding)
        return EncodedText(num_tokens, encoding.ids if num_tokens <= max_tokens else None)

    def _rust_encode_batch(self) -> Any:
        """The backend's `encode_batch_fast` (`encode_batch` before tokenizers 0.21: both
        release the GIL; the first skips character offsets) while its settings are those
        `__call__` encodes with; else None."""
        backend = self._backend
        if backend is None or backend.truncation is not None or backend.padding is not None:
            return None
        split_special_tokens = bool(getattr(self._tokenizer, "split_special_tokens", False))
        if backend.encode_special_tokens != split_special_tokens:
            return None
        return getattr(backend, "encode_batch_fast", backend.encode_batch)


def _bypassable_backend(tokenizer: Any) -> Any:
    """`tokenizer`'s Rust tokenizer if its class encodes through transformers' fast-tokenizer
    path unchanged; else None."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    try:
        from transformers import PreTrainedTokenizerFast
    except ImportError:
        return None
    if not isinstance(tokenizer, PreTrainedTokenizerFast):
        return None
    for name in _ENCODING_PATH:
        if getattr(type(tokenizer), name, None) is not getattr(PreTrainedTokenizerFast, name,
                                                              None):
            return None
    return backend
