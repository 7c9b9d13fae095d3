"""`continuum trace summarize|timeline|compare` through the console entry point."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

import pytest

from engine.cli import main
from tests.tracing.builders import write_trace
from tests.tracing.test_summary import HAND_BUILT
from tests.tracing.test_timeline import PNG_MAGIC
from tracing.stdout import PIPE_CLOSED_STATUS

REPO = Path(__file__).resolve().parents[2]


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


@pytest.mark.parametrize("command", [["summarize"], ["compare", "TRACE"]])
def test_a_reader_that_closes_the_pipe_ends_the_command_quietly(
        trace_path: Path, command: list[str]) -> None:
    # `continuum trace summarize FILE | head`: the reader is gone before the table is written.
    argv = [word if word != "TRACE" else str(trace_path) for word in command]
    process = subprocess.Popen(
        [sys.executable, "-m", "engine.cli", "trace", argv[0], str(trace_path), *argv[1:]],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=REPO)
    assert process.stdout is not None and process.stderr is not None
    process.stdout.close()
    stderr = process.stderr.read().decode()
    assert process.wait(timeout=60) == PIPE_CLOSED_STATUS
    assert stderr == ""


def test_head_reads_the_summary_s_first_lines(trace_path: Path) -> None:
    result = subprocess.run(
        f"{sys.executable} -m engine.cli trace summarize {trace_path} | head -n 2",
        shell=True, capture_output=True, text=True, timeout=60, check=True, cwd=REPO)
    assert len(result.stdout.splitlines()) == 2
    assert "Traceback" not in result.stderr and "BrokenPipe" not in result.stderr
