"""Hand-built traces for the reader, summary and timeline tests."""

from __future__ import annotations

from pathlib import Path

from tracing.records import SCHEMA_VERSION, Record, TraceHeader
from tracing.writer import TraceWriter


def header(**fields: object) -> TraceHeader:
    values: dict[str, object] = {
        "schema_version": SCHEMA_VERSION, "created_unix_s": 1.7e9, "clock_origin_s": 0.0,
        "policy": "test.Policy", "num_kv_blocks": 16, "block_size": 4,
        "max_num_batched_tokens": 64, "max_num_seqs": 8, "config": {"policy": "test"},
    }
    values.update(fields)
    return TraceHeader(**values)  # type: ignore[arg-type]


def write_trace(path: Path, records: list[Record], **writer_options: object) -> Path:
    """`records` after a default header, written the way the engine writes them."""
    writer = TraceWriter(path, header(), **writer_options)  # type: ignore[arg-type]
    for record in records:
        writer.write(record)
    writer.close()
    return path
