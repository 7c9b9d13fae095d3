"""`python -m lab check-calibration`: each measured run simulated under the policy spec
given for it, and compared with what it measured on the same definitions."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from engine.executor.sim_profiles import get_sim_profile
from lab.bench.check_calibration import (
    RUN_SETS,
    GpuRun,
    GpuSetup,
    OrderCheck,
    RunCheck,
    _policy_map,
    check_run,
    gpu_runs_root,
    order_checks,
    profile_in,
    render,
)
from tracing.progress import Progress

REPO = Path(__file__).resolve().parents[3]
TINY = GpuSetup("swe24", num_jobs=2, jobs_per_s=2.0, max_turns=2, num_kv_blocks=1500)


AF226D3 = RUN_SETS["h100-af226d3"]


def test_policy_specs_default_to_the_policies_as_measured() -> None:
    defaults = _policy_map(AF226D3, [])
    assert defaults["continuum"].name == "continuum-af226d3"
    assert (defaults["continuum-fixed"].name, defaults["continuum-fixed"].options) == (
        "continuum-af226d3", (("estimator", "fixed-2s"),))
    specs = _policy_map(AF226D3, ["continuum=continuum:estimator=fixed-2s"])
    assert specs["fcfs"].name == "fcfs"
    assert (specs["continuum"].name, specs["continuum"].options) == (
        "continuum", (("estimator", "fixed-2s"),))
    with pytest.raises(ValueError, match="LABEL one of"):
        _policy_map(AF226D3, ["oracle=continuum-oracle"])
    with pytest.raises(ValueError, match="unknown scheduling policy 'nosuch'"):
        _policy_map(AF226D3, ["fcfs=nosuch"])
    # The later runs measured today's policy but for its cold start (the paper's then), its
    # price (not yet capped) and the pins a waiting prompt counted on (any other job's), and
    # had no continuum-fixed run.
    for run_set in ("h100-24b013d", "h100-d8b9e2f"):
        later = _policy_map(RUN_SETS[run_set], [])
        assert (later["continuum"].name, later["continuum"].options) == (
            "continuum-as-replayed", ())
    with pytest.raises(ValueError, match="LABEL one of continuum, fcfs"):
        _policy_map(RUN_SETS["h100-24b013d"], ["continuum-fixed=continuum"])


def test_every_shipped_run_set_has_its_files_and_profile() -> None:
    for run_set in RUN_SETS.values():
        for run in run_set.runs:
            assert (run_set.runs_dir / run.trace_file).is_file()
            assert run.agent_file is None or (run_set.runs_dir / run.agent_file).is_file()
        assert (run_set.runs_dir / "README.md").is_file()
        profile = get_sim_profile(profile_in(run_set.runs_dir, run_set.profile))
        assert profile.name == run_set.profile


def test_a_profile_fitted_on_a_set_s_runs_is_read_from_beside_them(tmp_path: Path) -> None:
    runs_dir = RUN_SETS["h100-24b013d"].runs_dir
    assert profile_in(runs_dir, "h100-llama3.1-8b-24b013d") == str(
        runs_dir / "h100-llama3.1-8b-24b013d.json")
    # A profile the engine ships, and a file given, are taken as they are.
    assert profile_in(runs_dir, "h100-llama3.1-8b-measured") == "h100-llama3.1-8b-measured"
    given = tmp_path / "h100-llama3.1-8b-24b013d.json"
    assert profile_in(runs_dir, str(given)) == str(given)


def test_the_runs_are_found_in_a_checkout_or_under_the_working_directory(
        tmp_path: Path) -> None:
    assert gpu_runs_root() == REPO / "eval" / "gpu_runs"
    missing = tmp_path / "site-packages" / "eval" / "gpu_runs"
    assert gpu_runs_root(missing, cwd=REPO) == REPO / "eval" / "gpu_runs"
    with pytest.raises(ValueError, match="run this from a checkout of the repository"):
        gpu_runs_root(missing, cwd=tmp_path)


def test_an_install_without_the_repository_says_where_the_runs_are(tmp_path: Path) -> None:
    # The packages without the measured runs (no eval/gpu_runs/), run from outside a checkout.
    site = tmp_path / "site"
    for package in ("engine", "eval", "tracing", "estimator", "continuum", "lab"):
        shutil.copytree(REPO / package, site / package,
                        ignore=shutil.ignore_patterns("gpu_runs", "gpu", "__pycache__"))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    result = subprocess.run(
        [sys.executable, "-m", "lab", "check-calibration", "--runs",
         "h100-24b013d"], cwd=elsewhere, capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONPATH": str(site)})
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    assert "eval/gpu_runs/" in result.stderr and "--runs-dir" in result.stderr


def test_a_run_is_simulated_and_compared_on_the_same_definitions(tmp_path: Path) -> None:
    runs_dir, work_dir = tmp_path / "runs", tmp_path / "work"
    runs_dir.mkdir()
    work_dir.mkdir()
    (runs_dir / "done.agent.json").write_text(json.dumps({"runs": [{"mean_jct_s": 2.0}]}))
    specs = _policy_map(AF226D3, [])
    finished = check_run(GpuRun(TINY, "fcfs", "unused", "done.agent.json"), specs["fcfs"],
                         "h100-llama3.1-8b-measured", runs_dir, work_dir)
    assert finished.measured_jct_s == 2.0 and finished.simulated_jct_s is not None
    assert finished.jct_error == pytest.approx(finished.simulated_jct_s / 2.0 - 1.0)
    # Its simulation's own trace, taken as a measured run stopped where it ends.
    shutil.copy(work_dir / "swe24-fcfs.jsonl", runs_dir / "stopped.jsonl")
    stopped = check_run(GpuRun(TINY, "fcfs", "stopped.jsonl"), specs["fcfs"],
                        "h100-llama3.1-8b-measured", runs_dir, work_dir)
    assert stopped.measured == stopped.simulated
    assert stopped.measured is not None and stopped.measured.jobs_finished == 2
    # A finished run with a cut: its mean JCT and what it had finished by the cut.
    shutil.copy(work_dir / "swe24-fcfs.jsonl", runs_dir / "done.jsonl")
    cut = check_run(GpuRun(TINY, "fcfs", "done.jsonl", "done.agent.json", cut_s=0.5),
                    specs["fcfs"], "h100-llama3.1-8b-measured", runs_dir, work_dir)
    assert cut.measured_jct_s == 2.0 and cut.measured == cut.simulated
    assert cut.measured is not None and cut.measured.by_s == 0.5
    assert cut.measured.jobs_finished < 2


def test_orders_compare_the_stopped_runs_of_a_setup() -> None:
    def stopped(policy: str, measured: int, simulated: int) -> RunCheck:
        return RunCheck("swe40", policy, policy, measured=Progress(222.0, 0, 0, measured),
                        simulated=Progress(222.0, 0, 0, simulated))

    checks = [RunCheck("swe24", "fcfs", "fcfs", 99.9, 102.2),
              stopped("fcfs", 5, 28), stopped("continuum", 10, 26)]
    orders = order_checks(checks)
    assert orders == [OrderCheck("swe40", "fcfs", "continuum", -1, 1)]
    assert not orders[0].met
    table = render(checks, orders)
    assert "| swe24 | fcfs (fcfs) | 99.9 | 102.2 | +2.3% | met |" in table
    assert "| swe40 | fcfs < continuum | fcfs > continuum | missed |" in table


def test_a_manifest_names_its_runs_and_a_bad_one_is_refused(tmp_path: Path) -> None:
    from lab.bench.check_calibration import GpuRunSet

    run = {"setup": {"name": "8b-swe-2jps", "num_jobs": 2, "jobs_per_s": 2.0, "max_turns": 2,
                     "num_kv_blocks": 256, "workload": "bfcl", "token_scale": 0.5},
           "policy": "continuum", "trace_file": "run.trace.jsonl.gz",
           "agent_file": "run.json", "cut_s": None}
    document = {"name": "paper", "profile": "p", "measured_specs": {"continuum": "continuum"},
                "runs": [run]}
    manifest = tmp_path / "manifest.json"
    manifest.write_text(json.dumps(document))
    run_set = GpuRunSet.from_manifest(manifest)
    (loaded,) = run_set.runs
    assert loaded.policy == "continuum" and loaded.agent_file == "run.json"
    assert loaded.setup.agent_flags() == ["--workload", "bfcl", "--max-turns", "2",
                                          "--num-jobs", "2", "--seed", "0",
                                          "--token-scale", "0.5"]
    manifest.write_text(json.dumps({**document, "measured_specs": {}}))
    with pytest.raises(ValueError, match="no measured spec for continuum"):
        GpuRunSet.from_manifest(manifest)
    manifest.write_text(json.dumps({**document, "runs": [{"policy": "fcfs"}]}))
    with pytest.raises(ValueError, match=r"manifest .*manifest\.json: missing field 'setup'"):
        GpuRunSet.from_manifest(manifest)
