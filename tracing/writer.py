"""The buffered JSONL trace writer: records are encoded into memory and written once per step.

A write error disables the writer (logged once) instead of raising: a trace must never stop
the engine. With `max_bytes`, the file ends with a `truncated` record before it would pass
the cap, and nothing more is written.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import msgspec

from tracing.files import check_replaceable
from tracing.records import Record, TraceHeader, TraceTruncated

logger = logging.getLogger(__name__)

_TRUNCATION_RESERVE_BYTES = 128  # room kept for the `truncated` record
MIN_MAX_BYTES = 1024
# How every trace file begins (its header record): the only file a trace replaces.
TRACE_FILE_PREFIX = b'{"type":"header"'


class TraceWriter:
    """Owns one trace file, opened (truncated) at construction with `header` as its first
    line; ValueError if it cannot be created, or if it would replace a file that is not a
    trace (`tracing.files.check_replaceable`).

    Single-threaded: the scheduler calls `write` for each record and `flush` at the end of
    every step; `close` once at shutdown. `active` is False after a write error, the size cap
    or `close`, and every later call does nothing.
    """

    def __init__(self, path: str | os.PathLike[str], header: TraceHeader,
                 *, max_bytes: int | None = None) -> None:
        if max_bytes is not None and max_bytes < MIN_MAX_BYTES:
            raise ValueError(f"trace max_bytes must be at least {MIN_MAX_BYTES}: {max_bytes}")
        self.path = Path(path)
        self.max_bytes = max_bytes
        self._encoder = msgspec.json.Encoder()
        self._buffer = bytearray()
        self._num_bytes_written = 0
        self._last_event: tuple[int, float] = (0, header.clock_origin_s)
        check_replaceable(self.path, setting="trace_path", own_prefixes=(TRACE_FILE_PREFIX,),
                          devices=True)
        try:
            self._fd: int | None = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC,
                                           0o644)
        except OSError as error:
            raise ValueError(f"cannot open the trace file {self.path}: {error}") from error
        self.active = True
        first_line = self._encoder.encode(header) + b"\n"
        if max_bytes is not None and len(first_line) + _TRUNCATION_RESERVE_BYTES > max_bytes:
            os.close(self._fd)
            raise ValueError(f"trace max_bytes {max_bytes} cannot hold the trace header "
                             f"({len(first_line)} bytes) and the final record")
        self._write_all(first_line)

    def write(self, record: Record) -> None:
        """Appends one record to the step's buffer (as one line)."""
        if not self.active:
            return
        self._encoder.encode_into(record, self._buffer, len(self._buffer))
        self._buffer += b"\n"
        step = getattr(record, "step", None)
        if step is not None:
            self._last_event = (step, record.time_s)  # type: ignore[attr-defined]

    def flush(self) -> None:
        """Writes the buffered records with one system call (fewer at the size cap)."""
        if not self.active or not self._buffer:
            return
        data = self._buffer
        if self.max_bytes is not None:
            room = self.max_bytes - _TRUNCATION_RESERVE_BYTES - self._num_bytes_written
            if len(data) > room:
                self._truncate(data, room)
                return
        self._write_all(data)
        self._buffer = bytearray()

    def close(self) -> None:
        """Flushes and closes the file."""
        self.flush()
        self.active = False
        self._buffer = bytearray()
        if self._fd is not None:
            fd, self._fd = self._fd, None
            try:
                os.close(fd)
            except OSError as error:
                logger.error("closing the trace file %s failed: %s", self.path, error)

    def _truncate(self, data: bytearray, room: int) -> None:
        self._buffer = bytearray()
        whole_lines = data.rfind(b"\n", 0, max(0, room)) + 1
        step, time_s = self._last_event
        end = self._encoder.encode(TraceTruncated(step=step, time_s=time_s,
                                                  max_bytes=self.max_bytes or 0))
        self._write_all(data[:whole_lines] + end + b"\n")
        if self.active:
            logger.warning("the trace %s reached its cap of %d bytes; tracing stops",
                           self.path, self.max_bytes)
        self.close()

    def _write_all(self, data: bytes | bytearray) -> None:
        view = memoryview(data)
        try:
            while view:
                written = os.write(self._fd, view)  # type: ignore[arg-type]
                self._num_bytes_written += written
                view = view[written:]
        except OSError as error:
            logger.error("writing the trace %s failed, tracing is disabled: %s",
                         self.path, error)
            self.active = False
            self._buffer = bytearray()
