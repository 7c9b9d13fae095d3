"""`scripts/policy_targets_report.py` judges issue 36's targets on `bench sim` JSONs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
EXTRA = "continuum:rebuild_cost=prefill-times-running"


def _run(label: str, jobs_per_s: float, mean_jct_s: float | None,
         recomputed_tokens: int | None) -> dict:
    run = {"label": label, "policy": label.split(":")[0], "jobs_per_s": jobs_per_s,
           "mean_jct_s": mean_jct_s, "preemptions": 0}
    if recomputed_tokens is not None:
        run["recomputed_tokens"] = recomputed_tokens
    return run


def _write_report(path: Path, workload: str, seed: int, runs: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({
        "trace": workload, "profile": "h100-llama3.1-8b", "policies": [],
        "settings": {"seed": seed, "max_num_batched_tokens": 2048},
        "workload": {"num_jobs": 300}, "runs": runs}))


def _ladder(jobs_per_s: float, *, fcfs: float, fixed: float, continuum: float, oracle: float,
            fcfs_recomputed: int | None, recomputed: int | None) -> list[dict]:
    return [_run("fcfs", jobs_per_s, fcfs, fcfs_recomputed),
            _run("job-fcfs", jobs_per_s, fcfs, fcfs_recomputed),
            _run("continuum-fixed", jobs_per_s, fixed, 0 if recomputed is not None else None),
            _run("continuum", jobs_per_s, continuum, recomputed),
            _run("continuum-oracle", jobs_per_s, oracle, 0 if recomputed is not None else None)]


def _report(*args: str) -> str:
    result = subprocess.run([sys.executable, "scripts/policy_targets_report.py", *args],
                            cwd=REPO, capture_output=True, text=True, check=True)
    return result.stdout


def _row(report: str, target: str, candidate: str, cell: str) -> str:
    """The row of `cell` ("set | profile | workload | ...") in the table of `target`."""
    section = report.split(f"## {target}: {candidate},", 1)[1].split("\n## ", 1)[0]
    (row,) = [line for line in section.splitlines() if line.startswith(f"| {cell} |")]
    return row


def test_every_target_is_met_or_missed_with_its_figures(tmp_path: Path) -> None:
    _write_report(tmp_path / "heldout" / "swe-seed0.json", "swe", 0, [
        # Met everywhere, each near its bound.
        *_ladder(1.25, fcfs=100.0, fixed=98.5, continuum=100.4, oracle=91.5,
                 fcfs_recomputed=500, recomputed=1_400),
        # Missed everywhere.
        *_ladder(2.0, fcfs=200.0, fixed=150.0, continuum=203.0, oracle=180.0,
                 fcfs_recomputed=10_000, recomputed=12_001),
        _run(EXTRA, 2.0, 150.0, 9_000),
    ])
    report = _report(str(tmp_path))
    cell = "held-out | h100-llama3.1-8b | swe | 300 | 0"
    assert _row(report, "oracle", "continuum", f"{cell} | 1.25").endswith(
        "| 100.4 | 91.5 | 1.097x (bound 1.1x) | met |")
    assert _row(report, "oracle", "continuum", f"{cell} | 2").endswith(
        "| 203.0 | 180.0 | 1.128x (bound 1.1x) | **MISSED** |")
    assert _row(report, "fixed", "continuum", f"{cell} | 1.25").endswith("| met |")
    assert _row(report, "fixed", "continuum", f"{cell} | 2").endswith(
        "| 203.0 | 150.0 | 1.353x (bound 1.02x) | **MISSED** |")
    assert _row(report, "fcfs", "continuum", f"{cell} | 1.25").endswith(
        "| 1.004x (bound 1.01x) | met |")
    assert _row(report, "fcfs", "continuum", f"{cell} | 2").endswith(
        "| 1.015x (bound 1.01x) | **MISSED** |")
    # The bound is fcfs + 1,000 for few recomputed tokens, 1.2 x fcfs for many.
    assert _row(report, "recompute", "continuum", f"{cell} | 1.25").endswith(
        "| 1,400 | 500 | bound 1,500, -100 | met |")
    assert _row(report, "recompute", "continuum", f"{cell} | 2").endswith(
        "| 12,001 | 10,000 | bound 12,000, +1 | **MISSED** |")
    # A spec beyond the ladder is judged too; its missing cell is not judged.
    assert _row(report, "fixed", EXTRA, f"{cell} | 2").endswith("| 1.000x (bound 1.02x) | met |")
    assert _row(report, "fixed", EXTRA, f"{cell} | 1.25").endswith(
        f"| n/a | 98.5 | no {EXTRA} run | n/a |")
    assert "| held-out | continuum | oracle | 1/2 | 0 | h100-llama3.1-8b swe s0 @2 |" in report
    assert f"| held-out | {EXTRA} | fixed | 1/1 | 1 | - |" in report
    every_run = report.split("## Every run")[1]
    assert "| 203.0 / 12,001 |" in every_run


def test_tuning_runs_are_reported_apart_and_old_jsons_are_not_judged(tmp_path: Path) -> None:
    _write_report(tmp_path / "tuning" / "p" / "swe-seed1.json", "swe", 1, _ladder(
        1.5, fcfs=50.0, fixed=40.0, continuum=40.0, oracle=40.0, fcfs_recomputed=0,
        recomputed=0))
    # Written before `recomputed_tokens` existed.
    _write_report(tmp_path / "heldout" / "p" / "bfcl-seed2.json", "bfcl", 2, _ladder(
        2.5, fcfs=50.0, fixed=40.0, continuum=40.0, oracle=40.0, fcfs_recomputed=None,
        recomputed=None))
    (tmp_path / "heldout" / "p" / "status.json").write_text("not json")
    report = _report(str(tmp_path), "--candidate", "continuum")
    summary = report.split("## Summary")[1].split("\n## ")[0]
    assert "| held-out | continuum | recompute | 0/0 | 1 | - |" in summary
    assert "| tuning | continuum | recompute | 1/1 | 0 | - |" in summary
    assert summary.index("| held-out |") < summary.index("| tuning |")
    assert _row(report, "recompute", "continuum",
                "held-out | h100-llama3.1-8b | bfcl | 300 | 2 | 2.5").endswith("| n/a | n/a |")
    assert "skipped" in report and "status.json" in report


def test_a_variant_judges_the_ladder_run_with_its_options(tmp_path: Path) -> None:
    # The plain ladder: continuum misses the oracle bound (120 against 100). Run with the
    # variant's option, continuum and its oracle both change, and it is within the bound.
    variant = "prefill_fit=under-load"
    runs = _ladder(2.0, fcfs=200.0, fixed=120.0, continuum=120.0, oracle=100.0,
                   fcfs_recomputed=0, recomputed=0)
    runs += [_run(f"continuum:{variant}", 2.0, 115.0, 0),
             _run(f"continuum-oracle:{variant}", 2.0, 110.0, 0)]
    _write_report(tmp_path / "heldout" / "swe-seed0.json", "swe", 0, runs)
    cell = "held-out | h100-llama3.1-8b | swe | 300 | 0 | 2"
    plain = _report(str(tmp_path), "--candidate", "continuum")
    assert _row(plain, "oracle", "continuum", cell).endswith(
        "| 120.0 | 100.0 | 1.200x (bound 1.1x) | **MISSED** |")
    varied = _report(str(tmp_path), "--candidate", "continuum", "--variant", variant)
    assert f"The ladder with `{variant}`" in varied
    assert _row(varied, "oracle", "continuum", cell).endswith(
        "| 115.0 | 110.0 | 1.045x (bound 1.1x) | met |")
    assert _row(varied, "fcfs", "continuum", cell).endswith(
        "| 115.0 | 200.0 | 0.575x (bound 1.01x) | met |")
    # No continuum-fixed run with the option: not judged against the plain one.
    assert "no continuum-fixed run" in _row(varied, "fixed", "continuum", cell)
    # Unless told that its own run stands for it (the fixed rule does not use the option).
    standing = _report(str(tmp_path), "--candidate", "continuum", "--variant", variant,
                       "--stand-in", "continuum-fixed=continuum-fixed")
    assert "`continuum-fixed` is the run labelled `continuum-fixed`." in standing
    assert _row(standing, "fixed", "continuum", cell).endswith(
        "| 115.0 | 120.0 | 0.958x (bound 1.02x) | met |")
    assert _row(standing, "oracle", "continuum", cell).endswith("| 115.0 | 110.0 | 1.045x "
                                                                "(bound 1.1x) | met |")


def test_a_stand_in_must_name_a_ladder_policy_and_a_label(tmp_path: Path) -> None:
    for bad in ("fcfs=fcfs", "continuum-fixed", "nonsense=continuum"):
        result = subprocess.run([sys.executable, "scripts/policy_targets_report.py",
                                 str(tmp_path), "--stand-in", bad],
                                cwd=REPO, capture_output=True, text=True, check=False)
        assert result.returncode == 2 and "NAME=LABEL" in result.stderr


def test_no_runs_still_exits_0(tmp_path: Path) -> None:
    assert "No bench sim runs found." in _report(str(tmp_path))


def test_the_grid_script_runs_the_ladder_per_profile_workload_and_seed() -> None:
    result = subprocess.run(
        ["bash", "scripts/policy_targets.sh", "--dry-run", "--quick", "--tuning",
         "--profiles", "h100-llama3.1-8b,calibrated.json", "--workloads", "swe,bfcl",
         "--loads", "swe=1,2", "--policy", EXTRA, "--out", "OUT"],
        cwd=REPO, capture_output=True, text=True, check=True,
        env={"PATH": "/usr/bin:/bin", "PYTHON": "python3"})
    commands = result.stdout.splitlines()
    assert len(commands) == 2 * (2 + 1)  # per profile: swe and bfcl at seed 0, the tuning run
    first = commands[0]
    assert first.startswith("python3 -m engine.cli bench sim --workload swe --max-turns 12 "
                            "--seed 0 --jobs-per-s 1,2 --profile h100-llama3.1-8b ")
    assert ("--num-jobs 30 --max-num-batched-tokens 2048 --policies fcfs,job-fcfs,"
            "continuum-fixed,continuum,continuum-oracle,infercept,autellix "
            f"--policy {EXTRA} --workers 2 --json OUT/heldout/h100-llama3.1-8b/swe-seed0.json"
            ) in first
    assert "--jobs-per-s 2,2.5,3 --profile calibrated.json" in commands[4]
    assert commands[5].endswith("--json OUT/tuning/calibrated/swe-seed1.json")
    assert "--first-jobs 99 --seed 1" in commands[5]
