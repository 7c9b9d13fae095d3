"""Tool calls in a streamed completion: content sent as it comes, calls held back until the
completion ends (parsed by `engine.tool_calls`)."""

from __future__ import annotations

from engine.tool_calls import HERMES_START, PYTHON_TAG, ParsedOutput, ToolParser


class StreamingToolCallSplitter:
    """Splits one streamed completion into content deltas and, at its end, tool calls.

    `push(delta)` returns the content that can be sent now: everything before the point where
    a tool call may begin, except trailing whitespace (parsing drops it before a call), is sent;
    the rest is held back. `finish(cut=...)` parses the whole text (`cut`: it was cut off by
    its token limit or a stop string): it returns the content still to send and the parsed
    output (held-back text that turns out not to be a call is sent as content), so that the
    content sent adds up to the parsed content.
    """

    def __init__(self, parser: ToolParser) -> None:
        self._parser = parser
        self._text = ""
        self._num_sent_chars = 0
        self._call_start: int | None = None

    def push(self, delta: str) -> str:
        self._text += delta
        if self._call_start is None:
            start = self._parser.may_start_call(self._text)
            if start is not None and self._is_definite(start):
                self._call_start = start
            limit = len(self._text) if start is None else start
        else:
            limit = self._call_start
        return self._send_until(self._before_trailing_space(limit))

    def finish(self, *, cut: bool = False) -> tuple[str, ParsedOutput]:
        parsed = self._parser.parse(self._text, cut=cut)
        remaining = (parsed.content or "")[self._num_sent_chars:]
        self._num_sent_chars = len(self._text)
        return remaining, parsed

    def _is_definite(self, start: int) -> bool:
        """Whether the text from `start` certainly begins a call (not just a partial marker)."""
        tail = self._text[start:].lstrip()
        return tail.startswith(("{", HERMES_START, PYTHON_TAG))

    def _before_trailing_space(self, limit: int) -> int:
        """`limit` moved back over the whitespace that ends the text before it (not past what
        was sent, which never ends in whitespace that a call could follow)."""
        while limit > self._num_sent_chars and self._text[limit - 1].isspace():
            limit -= 1
        return limit

    def _send_until(self, limit: int) -> str:
        if limit <= self._num_sent_chars:
            return ""
        chunk = self._text[self._num_sent_chars:limit]
        self._num_sent_chars = limit
        return chunk
