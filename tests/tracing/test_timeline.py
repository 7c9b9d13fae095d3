"""The timeline's job states and block-pool series, and the PNG it draws."""

from __future__ import annotations

from pathlib import Path

from tests.tracing.builders import write_trace
from tests.tracing.test_summary import HAND_BUILT
from tracing.reader import read_trace
from tracing.timeline import Interval, job_intervals, plot_timeline, pool_series

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_job_states_follow_the_events(tmp_path: Path) -> None:
    intervals = job_intervals(read_trace(write_trace(tmp_path / "t.jsonl", HAND_BUILT)))
    assert list(intervals) == ["a", "solo", "b", "c"]
    assert intervals["a"] == [
        Interval("running", 0.0, 1.0),
        Interval("in_tool", 1.0, 2.0),
        Interval("pinned", 1.0, 2.5),
        Interval("waiting", 2.0, 2.5),
        Interval("running", 2.5, 3.0),  # its last turn: no tool after it
    ]
    assert intervals["b"] == [
        Interval("running", 0.5, 1.0),
        Interval("waiting", 1.0, 1.5),  # preempted
        Interval("running", 1.5, 3.0),
    ]
    assert intervals["c"][-1] == Interval("waiting", 2.8, 3.0)  # open at the end


def test_pool_series_split_the_pool(tmp_path: Path) -> None:
    series = pool_series(read_trace(write_trace(tmp_path / "t.jsonl", HAND_BUILT)))
    assert series["step"] == [0, 1, 2, 3, 4, 5, 6]
    assert series["free"] == [16] * 7 and series["in_use"] == [0] * 7


def test_the_timeline_is_written_as_a_png(tmp_path: Path) -> None:
    out = tmp_path / "timeline.png"
    shown = plot_timeline(read_trace(write_trace(tmp_path / "t.jsonl", HAND_BUILT)), out,
                          max_jobs=3)
    assert shown == 3
    assert out.read_bytes()[:8] == PNG_MAGIC and out.stat().st_size > 5000
