"""`python -m lab soak` in reduced form against a real `continuum serve` subprocess (the
full run: see docs/benchmarks.md): clean invariants, a broken one noticed, and its pieces."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from eval.workload import AgentJobSpec, LoadOptions, TurnSpec, load_jobs
from lab.bench.soak import SoakSettings, fresh_jobs, run_soak
from lab.cli import main as cli_main
from lab.server_checks import markdown_figures
from lab.server_process import ServerProcess, ServerSpec
from tests.continuum.workload import TEST_DATA
from tests.lab.bench import sabotaged_policy

SLICE = TEST_DATA / "minisweagent_deepseek_slice.jsonl"
REPO_ROOT = Path(__file__).resolve().parents[3]



def test_reduced_soak_keeps_invariants_with_no_leaks(server: ServerProcess) -> None:
    jobs = load_jobs(SLICE, LoadOptions(max_turns=4, token_scale=0.05))
    settings = SoakSettings(duration_s=15.0, warmup_s=4.0, num_lanes=8, max_tool_s=0.5,
                            request_timeout_s=60.0, sample_interval_s=0.5)
    started_s = time.monotonic()
    report = run_soak(server, jobs, settings)
    assert report.passed, markdown_figures(report.figures(), report.checks)
    assert time.monotonic() - started_s < 120.0  # the lanes stop starting jobs at 15 s
    tally = report.tally
    assert tally.jobs_completed >= 8 and tally.failed_jobs == 0
    assert tally.turns_completed >= 4 * tally.jobs_completed
    assert report.counters["invariant_checks"] > 0
    # Every step is checked, and so is every idle sweep that released a pin or forgot a job.
    assert report.counters["invariant_checks"] >= report.counters["engine_steps"]
    assert report.invariant_violations == 0 and tally.health_failures == 0
    assert tally.health_polls >= 10  # every 0.5 s, slower when the machine is busy
    state, memory = report.end_state, report.memory
    assert state is not None and state.leaked_blocks == 0 and state.num_pins == 0
    assert memory is not None and memory.growth_mib <= memory.bound_mib


def test_the_soak_reports_a_broken_invariant(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The checker is not vacuous: a policy that corrupts the running list after ten
    finished requests stops the core, and the soak says so."""
    # The engine core imports the policy by its dotted path, from wherever pytest runs.
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        [str(REPO_ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]))
    serve_args = ("--scheduling-policy", f"{sabotaged_policy.__name__}:SabotagedPolicy",
                  "--num-kv-blocks", "64", "--max-model-len", "1024",
                  "--debug-check-invariants")
    jobs = load_jobs(SLICE, LoadOptions(max_jobs=4, max_turns=4, token_scale=0.05))
    settings = SoakSettings(duration_s=8.0, warmup_s=0.0, num_lanes=4, max_tool_s=0.2,
                            sample_interval_s=0.25, idle_timeout_s=5.0)
    log_path = tmp_path / "serve.log"
    with ServerProcess(ServerSpec(serve_args=serve_args), log_path) as server:
        report = run_soak(server, jobs, settings)
    failed = {check.name for check in report.checks if not check.passed}
    assert {"no invariant violation", "no failed job"} <= failed and not report.passed
    assert report.invariant_violations == 1
    assert "AssertionError: a request runs twice" in log_path.read_text()


def test_soak_jobs_cycle_under_fresh_ids_with_capped_tools() -> None:
    job = AgentJobSpec("j", (TurnSpec(10, 2, "bash", 30.0), TurnSpec(5, 2, None, None)))
    jobs = fresh_jobs([job], max_tool_s=1.5)
    first, second = next(jobs), next(jobs)
    assert first.job_id != second.job_id and first.job_id.endswith("j")
    assert [t.tool_duration_s for t in first.turns] == [1.5, None]
    assert next(fresh_jobs([job], max_tool_s=None)).turns[0].tool_duration_s == 30.0


def test_soak_settings_are_validated() -> None:
    with pytest.raises(ValueError):
        SoakSettings(duration_s=10.0, warmup_s=10.0)


def test_bench_soak_refuses_bad_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["soak", "--trace", str(SLICE), "--duration-s", "5",
                     "--warmup-s", "9"]) == 2
    assert capsys.readouterr().err.count("error:") == 1
