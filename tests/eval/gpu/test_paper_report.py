"""`eval/gpu/paper_report.py`: the paper's targets judged on `bench agent` reports, and the
report and figure written from a folder of them."""

import json
from pathlib import Path

import pytest

from eval.gpu import paper_report


def _write(folder: Path, load: str, policy: str, mean_jct_s: float | None, finished: int = 4,
           recomputed_tokens: int = 0) -> None:
    run = {"num_jobs": 4, "num_finished_jobs": finished, "mean_jct_s": mean_jct_s,
           "p90_jct_s": mean_jct_s, "cached_token_fraction": 0.5, "preemptions": 0,
           "recomputed_tokens": recomputed_tokens}
    (folder / f"paper-8b-swe-{load}jps-{policy}.json").write_text(
        json.dumps({"base_url": "http://x", "runs": [run]}))


def _verdicts(tmp_path: Path) -> dict[str, paper_report.Verdict]:
    groups = paper_report.read_runs([tmp_path])
    return {verdict.target: verdict for verdict in paper_report.judge(groups[("8b", "swe")])}


def test_targets_are_judged_at_the_highest_load_fcfs_finishes(tmp_path: Path) -> None:
    for load, fcfs_s, fixed_s, mine_s in (("1", 10.0, 9.0, 8.0), ("2", 20.0, 15.0, 14.0)):
        _write(tmp_path, load, "fcfs", fcfs_s)
        _write(tmp_path, load, "continuum-fixed", fixed_s)
        _write(tmp_path, load, "continuum", mine_s)
    # At 4 jobs/s fcfs leaves a job unfinished: the targets are judged at 2.
    _write(tmp_path, "4", "fcfs", 30.0, finished=3)
    _write(tmp_path, "4", "continuum", 25.0, recomputed_tokens=5_000)
    verdicts = _verdicts(tmp_path)
    by_fcfs = verdicts["mean JCT <= 0.8 x fcfs's where fcfs finishes every job"]
    assert by_fcfs.met is True and "at 2 jobs/s" in by_fcfs.detail
    by_fixed = verdicts["mean JCT <= 0.95 x continuum-fixed's where fcfs finishes every job"]
    assert by_fixed.met is True  # 14 / 15 = 0.933
    assert verdicts["not worse than fcfs at 4 jobs/s"].met is True  # more jobs finished
    assert verdicts["recomputed tokens within fcfs's bound at 4 jobs/s"].met is False


def test_a_slower_candidate_misses_and_a_missing_run_is_not_judged(tmp_path: Path) -> None:
    _write(tmp_path, "1", "fcfs", 10.0)
    _write(tmp_path, "1", "continuum", 10.5)
    verdicts = _verdicts(tmp_path)
    assert verdicts["mean JCT <= 0.8 x fcfs's where fcfs finishes every job"].met is False
    assert verdicts["not worse than fcfs at 1 jobs/s"].met is False  # 1.05x > 1.01x
    fixed = verdicts["mean JCT <= 0.95 x continuum-fixed's where fcfs finishes every job"]
    assert fixed.met is None


def test_the_report_and_figure_are_written_from_a_folder(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    runs.mkdir()
    for load in ("1", "2"):
        for policy, mean_jct_s in (("fcfs", 10.0), ("continuum-fixed", 9.0), ("continuum", 7.0)):
            _write(runs, load, policy, mean_jct_s)
    (runs / "paper-check-calibration.json").write_text("{}")  # not a replay's report
    out = tmp_path / "out"
    assert paper_report.main([str(runs), "--out", str(out)]) == 0
    (group,) = json.loads((out / "paper.json").read_text())
    assert group["judged_load"] == 2.0
    assert all(target["met"] for target in group["targets"])
    assert "| 2 | continuum | 4/4 |" in (out / "paper.md").read_text()
    pytest.importorskip("matplotlib")
    assert (out / "paper-jct.png").read_bytes().startswith(b"\x89PNG")
