"""Response bodies too large to build and serialise on the event loop.

A body estimated over `LARGE_BODY_BYTES` (`is_large`) is built and encoded on a thread of the
work pool, in the tenant's turn (`work_pool.TenantWorkPool`), as JSON in pieces of about
`PIECE_BYTES` (`json_pieces`): the encoder runs on one short list, or one slice of about
`ENCODED_SLICE_BYTES` of a long list, at a time, so that the thread holds the interpreter for
short spells and the event loop keeps streaming every other client's tokens meanwhile. The
pieces go out as they are, one write at a time with the transport's flow control and at the
tenant's pace (`JSONPiecesResponse`), never joined on the event loop; a stored response's
bytes are sent the same way, as views of `PIECE_BYTES` (`byte_pieces`), neither copied,
decoded nor encoded again.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import msgspec
from starlette.background import BackgroundTask
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

# Bodies estimated under this are built and encoded on the event loop: a thread's hop would
# cost them more than it saves.
LARGE_BODY_BYTES = 256 * 1024
# A body's unit of sending: each costs the server's HTTP protocol a pass of its own.
PIECE_BYTES = 1024 * 1024
# Lists of at most this many items (choices, output items, content parts) are walked item by
# item; longer ones (logprobs) are encoded in slices of about `ENCODED_SLICE_BYTES`, each
# encoder call a spell without a switch of threads (about a millisecond).
MAX_WALKED_ITEMS = 16
ENCODED_SLICE_BYTES = 256 * 1024
# What one logprob value (a token's, or one of its alternatives') adds to a body's JSON at
# most, with its token's text, bytes and punctuation, bytes: the estimate of `is_large`.
LOGPROB_VALUE_BYTES = 48


def is_large(num_text_chars: int, num_logprob_values: int) -> bool:
    """Whether a body of about `num_text_chars` characters of text and `num_logprob_values`
    logprob values is built off the event loop."""
    return 4 * num_text_chars + LOGPROB_VALUE_BYTES * num_logprob_values > LARGE_BODY_BYTES


def json_pieces(value: Any) -> list[bytes]:
    """`value` (dicts, lists, JSON scalars and `msgspec.Raw` fragments) as compact JSON, in
    pieces of about `PIECE_BYTES` whose concatenation is the whole. For a worker thread."""
    writer = _PieceWriter()
    writer.value(value)
    return writer.finish()


def byte_pieces(data: bytes) -> list[memoryview]:
    """Views of `data`'s slices of `PIECE_BYTES` (no copy)."""
    view = memoryview(data)
    return [view[start:start + PIECE_BYTES] for start in range(0, len(data), PIECE_BYTES)]


class _PieceWriter:
    """Collects a body's JSON fragments into pieces of about `PIECE_BYTES`."""

    def __init__(self) -> None:
        self._encode = msgspec.json.Encoder().encode
        self._pieces: list[bytes] = []
        self._buffer = bytearray()

    def finish(self) -> list[bytes]:
        if self._buffer:
            self._pieces.append(bytes(self._buffer))
            self._buffer.clear()
        return self._pieces

    def _add(self, fragment: bytes) -> None:
        self._buffer += fragment
        if len(self._buffer) >= PIECE_BYTES:
            self._pieces.append(bytes(self._buffer))
            self._buffer.clear()

    def value(self, value: Any) -> None:
        if isinstance(value, dict):
            self._add(b"{")
            for index, (key, item) in enumerate(value.items()):
                self._add((b"," if index else b"") + self._encode(key) + b":")
                self.value(item)
            self._add(b"}")
        elif isinstance(value, list | tuple) and len(value) > MAX_WALKED_ITEMS:
            self._slices(value)
        elif isinstance(value, list | tuple) and value:
            self._add(b"[")
            for index, item in enumerate(value):
                if index:
                    self._add(b",")
                self.value(item)
            self._add(b"]")
        else:
            self._add(self._encode(value))

    def _slices(self, items: Sequence[Any]) -> None:
        """A long list, encoded a slice at a time: one item first, then as many as the mean
        size so far says make `ENCODED_SLICE_BYTES`."""
        self._add(b"[")
        start, size, num_bytes = 0, 1, 0
        while start < len(items):
            encoded = self._encode(items[start:start + size])
            self._add((b"," if start else b"") + encoded[1:-1])
            start += size
            num_bytes += len(encoded)
            size = max(1, ENCODED_SLICE_BYTES * start // max(1, num_bytes))
        self._add(b"]")


class JSONPiecesResponse(Response):
    """A JSON response whose body is sent as `pieces`, one ASGI message each, with its
    length declared up front; `pace(num_bytes)`, when given, is awaited before each piece
    (`work_pool.TenantWorkPool.pace_large_body`)."""

    media_type = "application/json"

    def __init__(self, pieces: Sequence[bytes | memoryview],
                 pace: Callable[[int], Awaitable[None]] | None = None, status_code: int = 200,
                 background: BackgroundTask | None = None) -> None:
        self.pieces = pieces
        self.pace = pace
        super().__init__(None, status_code, {"content-length": str(sum(map(len, pieces)))},
                         background=background)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code,
                    "headers": self.raw_headers})
        for piece in self.pieces:
            if self.pace is not None:
                await self.pace(len(piece))
            await send({"type": "http.response.body", "body": piece, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        if self.background is not None:
            await self.background()
