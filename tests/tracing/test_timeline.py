"""The timeline's job states and block-pool series, and the PNG it draws."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.tracing.builders import write_trace
from tests.tracing.test_summary import HAND_BUILT
from tracing.reader import read_trace
from tracing.records import StepSnapshot
from tracing.timeline import (
    Interval,
    job_intervals,
    plot_timeline,
    pool_axis_top,
    pool_series,
)

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


def _in_a_pool_of(num_total_blocks: int, held: list[int]) -> list:
    """HAND_BUILT's events with its snapshots over a pool of `num_total_blocks`, step i holding
    `held[i]` blocks (a fifth of them pinned) and caching as many free ones as it can."""
    records, step = [], 0
    for record in HAND_BUILT:
        if isinstance(record, StepSnapshot):
            blocks = held[step % len(held)]
            record = StepSnapshot(
                step=record.step, time_s=record.time_s, running_ids=[], waiting_ids=[],
                num_total_blocks=num_total_blocks, num_free_blocks=num_total_blocks - blocks,
                num_cached_free_blocks=min(blocks, num_total_blocks - blocks),
                num_pinned_blocks=blocks // 5,
                pinned_job_ids=[], token_budget=64, max_num_seqs=8)
            step += 1
        records.append(record)
    return records


def test_a_mostly_free_pool_is_drawn_up_to_its_busiest_step() -> None:
    def series(held: int, cached: int, total: int) -> dict[str, list[float]]:
        return {"step": [0, 1], "in_use": [0, held], "pinned": [0, 0], "cached": [0, cached],
                "free": [total, total - held - cached]}

    # 60 of 2,912 blocks held or caching at the busiest step: the axis ends at 75, not 2,912.
    assert pool_axis_top(series(40, 20, 2912)) == (75.0, 2912)
    # A busy pool keeps its whole height; an idle one a scale of a few blocks.
    assert pool_axis_top(series(1500, 0, 2912)) == (2912.0, 2912)
    assert pool_axis_top(series(0, 0, 2912)) == (8.0, 2912)
    assert pool_axis_top({key: [] for key in ("step", "in_use", "pinned", "cached",
                                              "free")}) == (8.0, 0)


@pytest.mark.parametrize("held", [[0, 12, 30, 24, 60, 18, 6], [0, 900, 2400, 2912, 1800, 300, 0]],
                         ids=["mostly-free", "busy"])
def test_the_timeline_renders_a_pool_of_2912_blocks(tmp_path: Path, held: list[int]) -> None:
    trace = read_trace(write_trace(tmp_path / "t.jsonl", _in_a_pool_of(2912, held)))
    series = pool_series(trace)
    assert {sum(step) for step in zip(series["in_use"], series["pinned"], series["cached"],
                                      series["free"], strict=True)} == {2912}
    out = tmp_path / "timeline.png"
    assert plot_timeline(trace, out) == 4
    assert out.read_bytes()[:8] == PNG_MAGIC and out.stat().st_size > 5000


def test_without_matplotlib_the_command_says_how_to_install_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from engine.cli import main as cli_main

    trace = write_trace(tmp_path / "t.jsonl", HAND_BUILT)
    monkeypatch.setitem(__import__("sys").modules, "matplotlib", None)  # as if not installed
    with pytest.raises(SystemExit, match=r"continuum-engine\[plot\]"):
        cli_main(["trace", "timeline", str(trace), "--out", str(tmp_path / "t.png")])
    assert not (tmp_path / "t.png").exists()
