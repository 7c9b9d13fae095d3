"""The trace reader: the only parser of trace files.

`read_trace` checks the header and decodes every line into its record type. A last line
cut short (the engine was killed mid-write) is dropped and reported as `incomplete_tail`;
any other bad line is a `TraceFormatError` naming it. A gzip-compressed trace (recognised
by its magic bytes, whatever its name) reads the same; a compressed stream cut short reads
up to where it ends.
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from tracing.records import SCHEMA_VERSION, Event, TraceHeader, TraceRecord, TraceTruncated


class TraceFormatError(ValueError):
    """The file is not a trace this reader understands."""


@dataclass
class Trace:
    """A decoded trace: its header and its events in file order."""

    path: Path
    header: TraceHeader
    events: list[Event] = field(default_factory=list)
    incomplete_tail: bool = False

    @property
    def truncated(self) -> bool:
        """The writer stopped at its size cap."""
        return bool(self.events) and isinstance(self.events[-1], TraceTruncated)

    def of_type(self, record_type: type[Event]) -> Iterator[Event]:
        return (event for event in self.events if isinstance(event, record_type))


_decoder = msgspec.json.Decoder(TraceRecord)


def read_trace(path: str | os.PathLike[str]) -> Trace:
    """Reads a whole trace; TraceFormatError if it is not one (OSError if unreadable)."""
    path = Path(path)
    lines = _read_bytes(path).split(b"\n")
    incomplete_tail = bool(lines[-1])  # a complete file ends with a newline
    header = _header(path, lines[0])
    trace = Trace(path=path, header=header)
    body = lines[1:-1]
    for number, line in enumerate(body, start=2):
        trace.events.append(_event(path, number, line))
    if incomplete_tail and len(lines) > 1:
        try:
            trace.events.append(_event(path, len(lines), lines[-1]))
            incomplete_tail = False  # a whole record, only the newline is missing
        except TraceFormatError:
            pass
    trace.incomplete_tail = incomplete_tail and len(lines) > 1
    return trace


def read_trace_or_exit(path: str | os.PathLike[str]) -> Trace:
    """`read_trace` for commands: an unreadable or malformed file exits with its reason."""
    try:
        return read_trace(path)
    except (OSError, TraceFormatError) as error:
        raise SystemExit(f"continuum trace: {error}") from None


_GZIP_MAGIC = b"\x1f\x8b"


def _read_bytes(path: Path) -> bytes:
    """The file's bytes, decompressed if it is gzip (every member of it, up to where a
    stream cut short ends); TraceFormatError if the compressed data is corrupt."""
    data = path.read_bytes()
    if not data.startswith(_GZIP_MAGIC):
        return data
    chunks = []
    while data:
        inflater = zlib.decompressobj(wbits=16 + zlib.MAX_WBITS)
        try:
            chunks.append(inflater.decompress(data))
        except zlib.error as error:
            raise TraceFormatError(f"{path} is not a readable gzip file: {error}") from None
        if not inflater.eof:
            break  # cut short: keep what was decompressed, as for a plain file
        data = inflater.unused_data
    return b"".join(chunks)


def _header(path: Path, line: bytes) -> TraceHeader:
    if not line:
        raise TraceFormatError(f"{path} is empty, not a trace")
    try:
        header = _decoder.decode(line)
    except msgspec.DecodeError as error:
        raise TraceFormatError(f"{path}:1 is not a trace header: {error}") from None
    if not isinstance(header, TraceHeader):
        raise TraceFormatError(f"{path}:1 is a {type(header).__name__}, not the header")
    if header.schema_version != SCHEMA_VERSION:
        raise TraceFormatError(
            f"{path} has trace schema version {header.schema_version}; this reader knows "
            f"version {SCHEMA_VERSION}"
        )
    return header


def _event(path: Path, number: int, line: bytes) -> Event:
    try:
        record = _decoder.decode(line)
    except msgspec.DecodeError as error:
        raise TraceFormatError(f"{path}:{number}: {error}") from None
    if isinstance(record, TraceHeader):
        raise TraceFormatError(f"{path}:{number}: a second header")
    return record
