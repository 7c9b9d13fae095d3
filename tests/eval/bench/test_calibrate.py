"""`continuum bench calibrate`: the fit recovers the step costs a simulated run was priced
with, from its trace alone; the profile it writes drives `bench sim`."""

from __future__ import annotations

import gzip
import json
from datetime import date
from pathlib import Path

import pytest

from engine.cli import main as cli_main
from engine.executor.measured import (
    MeasuredProfile,
    read_measured_profile,
    write_measured_profile,
)
from engine.executor.roofline import SIM_PROFILES
from engine.executor.step_cost import StepCostModel
from eval.bench.calibrate import fit_step_cost, step_samples
from eval.simulator import SimSettings, Simulation
from tests.eval.test_simulator import SLICE, slice_jobs
from tracing.reader import read_trace

KNOWN = StepCostModel(step_overhead_s=0.03, prefill_token_s=2e-5, prefill_query_s=0.06,
                      decode_query_s=1.5e-3, context_token_s=1e-7, attention_pair_s=5e-9)


@pytest.fixture(scope="module")
def known_profile(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("profile") / "known.json"
    write_measured_profile(MeasuredProfile(
        "known", SIM_PROFILES["h100-llama3.1-8b"], KNOWN, date(2026, 1, 1), "test",
        "hand-written"), path)
    return path


@pytest.fixture(scope="module")
def simulated_trace(known_profile: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run priced by `KNOWN`, its trace compressed: two bursts of jobs (batches of mixed
    prefills and decodes) with the engine idle between them."""
    trace = tmp_path_factory.mktemp("trace") / "run.jsonl"
    jobs = slice_jobs(num_jobs=6, max_turns=3)
    settings = SimSettings(policy="fcfs", profile=str(known_profile), num_kv_blocks=256,
                           max_num_batched_tokens=256, trace_path=str(trace))
    Simulation(jobs, [0.0, 0.1, 0.2, 300.0, 300.1, 300.2], settings).run()
    packed = trace.with_suffix(".jsonl.gz")
    packed.write_bytes(gzip.compress(trace.read_bytes()))
    return packed


def test_the_fit_recovers_the_costs_the_run_was_priced_with(simulated_trace: Path) -> None:
    samples = step_samples(read_trace(simulated_trace), warmup_steps=0)
    assert samples.num_idle >= 2 and samples.num_unknown == 0  # idle gaps were dropped
    fitted = fit_step_cost([samples])
    assert fitted.coefficients() == pytest.approx(KNOWN.coefficients(), rel=1e-4, abs=1e-12)


def test_warmup_steps_are_left_out(simulated_trace: Path) -> None:
    trace = read_trace(simulated_trace)
    all_steps = step_samples(trace, warmup_steps=0)
    later = step_samples(trace, warmup_steps=5)
    assert later.num_warmup == 5 and later.num_steps < all_steps.num_steps


def test_the_command_writes_a_profile_that_bench_sim_takes(
    simulated_trace: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    out = tmp_path / "fitted.json"
    assert cli_main(["bench", "calibrate", "--trace", str(simulated_trace),
                     "--check", str(simulated_trace), "--name", "fitted",
                     "--engine-commit", "abc1234", "--warmup-steps", "0",
                     "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "| decode_query_s |" in printed and "held out" in printed
    profile = read_measured_profile(out)
    assert (profile.name, profile.engine_commit) == ("fitted", "abc1234")
    assert profile.command.startswith("continuum bench calibrate --trace ")
    assert [fit.used_for_fit for fit in profile.fits] == [True, False]
    assert profile.fits[0].r2 == pytest.approx(1.0) and profile.fits[0].total_error == (
        pytest.approx(0.0, abs=1e-6))
    report = tmp_path / "sim.json"
    assert cli_main(["bench", "sim", "--trace", str(SLICE), "--first-jobs", "3",
                     "--max-turns", "2", "--token-scale", "0.1", "--jobs-per-s", "1",
                     "--policies", "fcfs", "--profile", str(out), "--finished-by-s", "1000",
                     "--json", str(report)]) == 0
    printed = capsys.readouterr().out
    assert "on fitted (3 jobs)" in printed and "| jobs done by 1000 s |" in printed
    assert "| 3/3 |" in printed
    run = json.loads(report.read_text())["runs"][0]
    assert run["num_finished_by_s"] == run["num_finished_jobs"] == 3


def test_unusable_inputs_exit_with_the_reason(tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert cli_main(["bench", "calibrate", "--trace", str(empty), "--name", "x",
                     "--engine-commit", "y"]) == 2
    assert "cannot read trace" in capsys.readouterr().err
    assert cli_main(["bench", "sim", "--workload", "swe", "--first-jobs", "1",
                     "--jobs-per-s", "1", "--profile", str(empty)]) == 2
    assert "is not a measured cost profile" in capsys.readouterr().err


def test_a_trace_recorded_with_async_scheduling_is_refused(
        simulated_trace: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """There a step's snapshot is taken while the step before still runs on the device, so
    the time to the next snapshot is not the step's own."""
    header, *events = gzip.decompress(simulated_trace.read_bytes()).decode().splitlines()
    record = json.loads(header)
    record["config"] = {**record.get("config", {}), "scheduler": {"async_scheduling": True}}
    async_trace = tmp_path / "async.jsonl"
    async_trace.write_text("\n".join([json.dumps(record), *events]) + "\n")
    assert cli_main(["bench", "calibrate", "--trace", str(async_trace), "--name", "x",
                     "--engine-commit", "y"]) == 2
    assert "recorded with async scheduling" in capsys.readouterr().err
