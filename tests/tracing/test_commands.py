"""`continuum trace summarize|timeline|compare` through the console entry point."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from engine.cli import main
from tests.tracing.builders import write_trace
from tests.tracing.test_summary import HAND_BUILT
from tests.tracing.test_timeline import PNG_MAGIC


@pytest.fixture
def trace_path(tmp_path: Path) -> Path:
    return write_trace(tmp_path / "hand.jsonl", HAND_BUILT)


def test_summarize_prints_a_table_and_writes_json(trace_path, tmp_path, capsys) -> None:
    out = tmp_path / "summary.json"
    assert main(["trace", "summarize", str(trace_path), "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "prefix_cache.from_pins" in printed and "slowest jobs" in printed
    summary = json.loads(out.read_text())
    assert summary["preemptions"] == 1
    assert {job["job_id"] for job in summary["jobs"]} == {"a", "b", "c"}


def test_summarize_reads_a_gzip_trace(trace_path, tmp_path, capsys) -> None:
    packed = tmp_path / "hand.jsonl.gz"
    packed.write_bytes(gzip.compress(trace_path.read_bytes()))
    assert main(["trace", "summarize", str(packed)]) == 0
    gzip_output = capsys.readouterr().out.replace(str(packed), "TRACE")
    assert main(["trace", "summarize", str(trace_path)]) == 0
    assert gzip_output == capsys.readouterr().out.replace(str(trace_path), "TRACE")


def test_compare_puts_two_traces_side_by_side(trace_path, tmp_path, capsys) -> None:
    out = tmp_path / "compare.json"
    assert main(["trace", "compare", str(trace_path), str(trace_path), "--json", str(out)]) == 0
    assert "B/A" in capsys.readouterr().out
    result = json.loads(out.read_text())
    assert result["figures"]["recomputed_tokens"] == {"a": 8, "b": 8, "b_over_a": 1.0}
    assert result["a"]["num_jobs"] == result["b"]["num_jobs"] == 3


def test_timeline_writes_the_png(trace_path, tmp_path, capsys) -> None:
    out = tmp_path / "t.png"
    assert main(["trace", "timeline", str(trace_path), "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == PNG_MAGIC
    assert "4 jobs" in capsys.readouterr().out


def test_a_file_that_is_not_a_trace_exits_with_its_reason(tmp_path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"job_id": "x"}\n')
    with pytest.raises(SystemExit, match="not a trace header"):
        main(["trace", "summarize", str(bad)])
    with pytest.raises(SystemExit, match="No such file"):
        main(["trace", "compare", str(bad) + ".missing", str(bad)])
