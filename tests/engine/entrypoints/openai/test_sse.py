"""SSE framing: one event is one line, whatever the text holds."""

from __future__ import annotations

import json

from engine.entrypoints.openai.serving import SSE_DONE, sse


def test_line_separators_are_escaped_so_an_event_stays_one_line():
    text = "a\u2028b\u2029c\u0085d\ne\u00c5f\u20ac"
    event = sse({"text": text})
    assert event.startswith(b"data: ") and event.endswith(b"\n\n")
    (line,) = event.decode().rstrip("\n").splitlines()  # what httpx's iter_lines splits on
    assert json.loads(line.removeprefix("data: ")) == {"text": text}
    assert b"\\u2028" in event and b"\\u2029" in event and b"\\u0085" in event


def test_done_is_its_own_event():
    assert SSE_DONE == b"data: [DONE]\n\n"
