"""Loading a model's tokenizer and rendering chat conversations with its template."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

from engine.model.directory import resolve_model_dir


def load_tokenizer(model: str) -> Any:
    """The Hugging Face tokenizer stored with `model` (`"tiny"` or a local directory)."""
    from transformers import AutoTokenizer

    directory = resolve_model_dir(model)
    try:
        return AutoTokenizer.from_pretrained(directory)
    except (OSError, ValueError) as error:
        raise ValueError(f"no usable tokenizer in {directory}: {error}") from error


def load_decoder(model: str) -> Callable[[Sequence[int]], str] | None:
    """Token ids to text with the model's `tokenizer.json`, special tokens kept (None if the
    model has none). Light enough for the engine core, which does not load `transformers`."""
    try:
        from tokenizers import Tokenizer

        path = resolve_model_dir(model) / "tokenizer.json"
        tokenizer = Tokenizer.from_file(str(path)) if path.is_file() else None
    except Exception:  # any unreadable or unknown file format: no decoder
        return None
    if tokenizer is None:
        return None
    return functools.partial(tokenizer.decode, skip_special_tokens=False)


def render_chat(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    *,
    tools: list[dict[str, Any]] | None = None,
    add_generation_prompt: bool = True,
    chat_template_kwargs: dict[str, Any] | None = None,
) -> str:
    """The conversation as prompt text, by the model's chat template (tools included).

    ValueError if the model has no chat template or the messages do not fit it.
    """
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list")
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("this model has no chat template; send a plain prompt instead")
    try:
        text = tokenizer.apply_chat_template(
            messages, tools=tools, add_generation_prompt=add_generation_prompt,
            tokenize=False, **(chat_template_kwargs or {}),
        )
    except Exception as error:  # template errors surface as many exception types
        raise ValueError(f"cannot apply the chat template: {error}") from error
    if not isinstance(text, str):
        raise ValueError("the chat template did not produce text")
    return text
