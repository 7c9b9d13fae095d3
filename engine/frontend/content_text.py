"""Where the client's own text lies in a rendered conversation, so that it is encoded as
text: a `<|im_end|>` or `<tool_call>` in a user message or a tool's output (a web page an
agent fetched, say) must not become the control token that ends a turn or calls a tool,
while the chat template's own markers around it stay control tokens.

The texts are those of user, system, developer and tool messages (a string content, or the
`text` of its parts); the assistant's are the model's own and stay as the template renders
them. Only texts that hold a special token's text are looked for, in message order, in the
rendered prompt: as they are, else stripped of surrounding whitespace (templates trim). A
text the template changed beyond that is not found and is encoded with the rest.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

_CLIENT_ROLES = frozenset({"user", "system", "developer", "tool"})


def special_text_pattern(special_texts: Iterable[str]) -> re.Pattern[str] | None:
    """A pattern matching any of the special tokens' texts (None without any)."""
    texts = sorted({text for text in special_texts if text}, key=len, reverse=True)
    return re.compile("|".join(map(re.escape, texts))) if texts else None


def client_texts(messages: Iterable[dict[str, Any]]) -> list[str]:
    """The client's texts in the messages, in order (see the module docstring)."""
    texts: list[str] = []
    for message in messages:
        if not isinstance(message, dict) or message.get("role") not in _CLIENT_ROLES:
            continue
        content = message.get("content")
        if isinstance(content, str):
            texts.append(content)
        elif isinstance(content, list):
            texts.extend(part["text"] for part in content
                         if isinstance(part, dict) and isinstance(part.get("text"), str))
    return texts


def special_content_spans(rendered: str, texts: Iterable[str],
                          pattern: re.Pattern[str] | None) -> list[tuple[int, int]]:
    """The (start, end) spans of `rendered`, in order and apart, that hold those of `texts`
    which contain a special token's text (`pattern`)."""
    if pattern is None:
        return []
    spans: list[tuple[int, int]] = []
    cursor = 0
    for text in texts:
        if not pattern.search(text):
            continue
        for candidate in (text, text.strip()):
            start = rendered.find(candidate, cursor) if candidate else -1
            if start >= 0:
                cursor = start + len(candidate)
                spans.append((start, cursor))
                break
    return spans
