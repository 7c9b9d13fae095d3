"""The trace schema round-trips through the writer and the reader; bad files are named."""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path

import msgspec
import pytest

from tests.tracing.builders import header, write_trace
from tracing.reader import TraceFormatError, read_trace
from tracing.records import (
    RECORD_TYPES,
    SCHEMA_VERSION,
    JobEnded,
    PinDeclined,
    PinPinned,
    PinReleased,
    Preemption,
    PrefixCacheEvent,
    RequestArrived,
    RequestFinished,
    StepDecision,
    StepSnapshot,
    TraceTruncated,
    TTLInputs,
)
from tracing.writer import TraceWriter

EQ2_INPUTS = TTLInputs(ttl_s=1.25, source="tool", tool="pytest", num_samples=140,
                       queueing_delay_s=2.5, eta=0.8, rebuild_s=0.3, benefit_s=2.3,
                       memory_price=0.45)

ONE_OF_EACH = [
    RequestArrived(step=0, time_s=0.0, request_id="a#0", job_id="a", num_prompt_tokens=20,
                   max_tokens=8, tool_name="bash"),
    RequestArrived(step=0, time_s=0.0, request_id="solo", num_prompt_tokens=5),
    StepSnapshot(step=0, time_s=0.0, running_ids=[], waiting_ids=["a#0", "solo"],
                 num_total_blocks=16, num_free_blocks=16, num_cached_free_blocks=0,
                 num_pinned_blocks=0, pinned_job_ids=[], token_budget=64, max_num_seqs=8),
    PrefixCacheEvent(step=0, time_s=0.0, request_id="a#0", job_id="a", num_prompt_tokens=20,
                     num_hit_tokens=8, num_pin_hit_tokens=4),
    StepDecision(step=0, time_s=0.0, new_ids=["a#0"], resumed_ids=[],
                 preempted=[Preemption(request_id="c", job_id="j", needed_by="b",
                                       num_computed_tokens=12)],
                 num_scheduled_tokens={"b": 1, "a#0": 12}, total_num_scheduled_tokens=13),
    RequestFinished(step=0, time_s=0.5, request_id="a#0", job_id="a", reason="length",
                    num_prompt_tokens=20, num_output_tokens=8, num_cached_tokens=8,
                    num_preemptions=1),
    PinPinned(step=0, time_s=0.5, job_id="a", request_id="a#0", num_blocks=6, ttl_s=1.25,
              inputs=EQ2_INPUTS),
    PinDeclined(step=1, time_s=0.6, job_id="b", request_id="b#0",
                inputs=TTLInputs(ttl_s=0.0, source="cold-start", tool=None, num_samples=0,
                                 queueing_delay_s=0.0, eta=1.0, rebuild_s=0.01,
                                 benefit_s=0.01)),
    PinReleased(step=2, time_s=1.0, job_id="a", request_id="a#0", num_blocks=6, ttl_s=1.25,
                held_s=0.5, reason="reused"),
    PinReleased(step=2, time_s=1.0, job_id="c", request_id="c#0", num_blocks=1, ttl_s=None,
                held_s=0.5, reason="job_end"),  # an endless TTL
    JobEnded(step=2, time_s=1.0, job_id="a", reason="job_end"),
    RequestArrived(step=3, time_s=1.0, request_id="d#1", job_id="~inferred/0/d#0",
                   num_prompt_tokens=30, job_inferred=True, inferred_from="d#0"),
    TraceTruncated(step=3, time_s=1.0, max_bytes=4096),
]


def test_every_record_type_round_trips(tmp_path: Path) -> None:
    assert {type(record) for record in ONE_OF_EACH} | {type(header())} == set(
        RECORD_TYPES.values())
    trace = read_trace(write_trace(tmp_path / "t.jsonl", ONE_OF_EACH))
    assert trace.header == header()
    assert trace.events == ONE_OF_EACH
    assert trace.truncated and not trace.incomplete_tail
    assert trace.events[4].running_ids == ["b"]


def test_lines_are_plain_json_objects_named_by_type(tmp_path: Path) -> None:
    path = write_trace(tmp_path / "t.jsonl", ONE_OF_EACH[:3])
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [line["type"] for line in lines] == [
        "header", "request_arrived", "request_arrived", "step_snapshot"]
    assert lines[0]["schema_version"] == SCHEMA_VERSION
    assert "job_id" not in lines[2]  # None fields are left out


def test_the_reader_ignores_fields_it_does_not_know(tmp_path: Path) -> None:
    path = write_trace(tmp_path / "t.jsonl", ONE_OF_EACH[:1])
    lines = path.read_text().splitlines()
    extended = json.loads(lines[1]) | {"added_in_a_later_version": [1, 2]}
    path.write_text(f"{lines[0]}\n{json.dumps(extended)}\n")
    assert read_trace(path).events == ONE_OF_EACH[:1]


@pytest.mark.parametrize(("content", "message"), [
    (b"", "empty"),
    (b'{"type":"step_snapshot"}\n', "not a trace header"),
    (b"not json\n", "not a trace header"),
])
def test_files_that_are_not_traces_are_refused(tmp_path: Path, content, message) -> None:
    path = tmp_path / "t.jsonl"
    path.write_bytes(content)
    with pytest.raises(TraceFormatError, match=message):
        read_trace(path)


def test_another_schema_version_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_bytes(msgspec.json.encode(header(schema_version=SCHEMA_VERSION + 1)) + b"\n")
    with pytest.raises(TraceFormatError, match="schema version"):
        read_trace(path)


def test_a_bad_line_in_the_middle_is_named(tmp_path: Path) -> None:
    path = write_trace(tmp_path / "t.jsonl", ONE_OF_EACH[:2])
    lines = path.read_text().splitlines()
    path.write_text("\n".join([lines[0], '{"type":"no_such_record"}', lines[1]]) + "\n")
    with pytest.raises(TraceFormatError, match=r"t\.jsonl:2"):
        read_trace(path)
    path.write_text("\n".join([lines[0], lines[0]]) + "\n")
    with pytest.raises(TraceFormatError, match="second header"):
        read_trace(path)


def test_a_last_line_cut_short_is_dropped_and_reported(tmp_path: Path) -> None:
    path = write_trace(tmp_path / "t.jsonl", ONE_OF_EACH[:3])
    data = path.read_bytes()
    path.write_bytes(data[:-20])  # the engine died while writing the snapshot
    trace = read_trace(path)
    assert trace.events == ONE_OF_EACH[:2] and trace.incomplete_tail
    path.write_bytes(data[:-1])  # only the newline is missing
    trace = read_trace(path)
    assert trace.events == ONE_OF_EACH[:3] and not trace.incomplete_tail


def test_a_gzip_trace_reads_as_the_plain_file(tmp_path: Path) -> None:
    plain = write_trace(tmp_path / "t.jsonl", ONE_OF_EACH)
    packed = tmp_path / "t.jsonl.gz"
    packed.write_bytes(gzip.compress(plain.read_bytes()))
    assert read_trace(packed).events == read_trace(plain).events == ONE_OF_EACH
    renamed = tmp_path / "t.jsonl"  # recognised by its bytes, not its name
    renamed.write_bytes(packed.read_bytes())
    assert read_trace(renamed).events == ONE_OF_EACH


def test_a_gzip_trace_cut_short_reads_up_to_the_cut(tmp_path: Path) -> None:
    plain = write_trace(tmp_path / "t.jsonl", ONE_OF_EACH)
    packed = gzip.compress(plain.read_bytes())
    path = tmp_path / "t.jsonl.gz"
    path.write_bytes(packed[:-12])  # the stream lost its last bytes and its trailer
    trace = read_trace(path)
    assert trace.events == ONE_OF_EACH[:len(trace.events)] and trace.incomplete_tail
    path.write_bytes(packed[:10] + b"not deflate data" * 4)
    with pytest.raises(TraceFormatError, match="not a readable gzip file"):
        read_trace(path)


def test_the_size_cap_ends_the_file_with_a_truncated_record(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    writer = TraceWriter(path, header(), max_bytes=2048)
    arrivals = [RequestArrived(step=k, time_s=k * 0.1, request_id=f"r{k}", num_prompt_tokens=k)
                for k in range(100)]
    for arrival in arrivals:
        writer.write(arrival)
        writer.flush()
    assert not writer.active
    writer.close()
    assert path.stat().st_size <= 2048
    trace = read_trace(path)
    assert trace.truncated
    assert trace.events[:-1] == arrivals[: len(trace.events) - 1]
    end = trace.events[-1]
    assert isinstance(end, TraceTruncated) and end.max_bytes == 2048
    assert end.step == trace.events[-2].step + 1  # the step of the first record lost


def test_a_write_error_disables_the_writer_instead_of_raising(tmp_path: Path, caplog) -> None:
    if not os.path.exists("/dev/full"):
        pytest.skip("needs /dev/full")
    with pytest.raises(ValueError, match=r"the folder of .* does not exist"):
        TraceWriter(tmp_path / "no-such-dir" / "t.jsonl", header())
    writer = TraceWriter("/dev/full", header())  # every write fails: no space left
    assert not writer.active
    writer.write(ONE_OF_EACH[0])
    writer.flush()
    writer.close()
    assert "tracing is disabled" in caplog.text


def test_the_cap_must_leave_room_for_records(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="at least"):
        TraceWriter(tmp_path / "t.jsonl", header(), max_bytes=100)
    big_header = header(config={"model": "x" * 2000})
    with pytest.raises(ValueError, match="cannot hold the trace header"):
        TraceWriter(tmp_path / "t.jsonl", big_header, max_bytes=1024)


@pytest.mark.parametrize(("content", "refused"), [
    (b"", False),  # an empty file holds nothing to lose
    (b'{"type":"header","schema_version":1}\n', False),  # an earlier trace
    (b"api_key = 'secret'\n", True),
    (b'{"some": "json"}\n', True),
])
def test_a_trace_replaces_only_a_trace(tmp_path: Path, content: bytes, refused: bool) -> None:
    path = tmp_path / "t.jsonl"
    path.write_bytes(content)
    if refused:
        with pytest.raises(ValueError, match="is not a file the engine wrote"):
            TraceWriter(path, header())
        assert path.read_bytes() == content
    else:
        TraceWriter(path, header()).close()
        assert path.read_bytes().startswith(b'{"type":"header"')


def test_a_trace_path_that_is_a_folder_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"trace_path: .* is not a regular file"):
        TraceWriter(tmp_path, header())
