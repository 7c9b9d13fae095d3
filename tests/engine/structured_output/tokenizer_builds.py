"""Counting the grammar tokenizers a test's code builds, and on which threads."""

from __future__ import annotations

import threading
from typing import Any

import llguidance


class CountingTokenizers:
    """Stands in for `llguidance.LLTokenizer` (a test monkeypatches it in): builds the real
    one, and records each build's EOS and thread name in `builds`."""

    def __init__(self) -> None:
        self.real = llguidance.LLTokenizer
        self.builds: list[tuple[Any, str]] = []

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.builds.append((kwargs.get("eos_token"), threading.current_thread().name))
        return self.real(*args, **kwargs)
