"""Rendering a chat conversation as prompt text with the model's chat template."""

from __future__ import annotations

from typing import Any


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
