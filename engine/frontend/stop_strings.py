"""Stop strings, matched on the detokenized text as it grows."""

from __future__ import annotations

from collections.abc import Sequence


def find_stop_string(
    text: str, stop: Sequence[str], num_old_chars: int
) -> tuple[int, str] | None:
    """The earliest stop string in `text` that was not complete in its first `num_old_chars`
    characters, as (start index, stop string); None if there is none.

    Only the window that new text can complete is searched, so a stop string split across
    tokens (or steps) is found once its last character arrives.
    """
    best: tuple[int, str] | None = None
    for stop_string in stop:
        start = text.find(stop_string, max(0, num_old_chars - len(stop_string) + 1))
        if start != -1 and (best is None or start < best[0]):
            best = (start, stop_string)
    return best


def num_held_back_chars(stop: Sequence[str], include_stop_str_in_output: bool) -> int:
    """Characters at the end of unfinished text that a stream must hold back: they may be the
    start of a stop string, which would then be cut from the text."""
    if not stop or include_stop_str_in_output:
        return 0
    return max(len(stop_string) for stop_string in stop) - 1
