"""Running llguidance's matcher over a string, as the model would produce it."""

from __future__ import annotations

from typing import Any

import llguidance


def accepts(tokenizer: tuple[Any, Any], grammar: str, text: str) -> bool:
    """Whether `grammar` accepts exactly `text` (tokenized as the model would produce it);
    `tokenizer` is the (Hugging Face, llguidance) pair of the `tokenizer` fixture."""
    hf_tokenizer, llg_tokenizer = tokenizer
    matcher = llguidance.LLMatcher(llg_tokenizer, grammar, log_level=0)
    token_ids = hf_tokenizer(text, add_special_tokens=False).input_ids
    return all(matcher.consume_token(token) for token in token_ids) and matcher.is_accepting()
