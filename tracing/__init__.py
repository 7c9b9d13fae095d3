"""Scheduler trace records, the JSONL writer and reader, and trace analysis.

Imports only the standard library and msgspec (matplotlib in `timeline`, when drawing).
"""

from tracing.reader import Trace, TraceFormatError, read_trace
from tracing.records import SCHEMA_VERSION, TraceRecord
from tracing.writer import TraceWriter

__all__ = ["SCHEMA_VERSION", "Trace", "TraceFormatError", "TraceRecord", "TraceWriter",
           "read_trace"]
