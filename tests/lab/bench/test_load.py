"""`python -m lab load` in reduced form against a real `continuum serve` subprocess (the
full run: see docs/benchmarks.md), its report and its refusals."""

from __future__ import annotations

import pytest

from lab.bench.load import LoadTestReport, LoadTestSettings, run_load_test
from lab.cli import main as cli_main
from lab.load_clients import DISCONNECTED, OK, LoadSettings, LoadTally
from lab.server_checks import Check, EngineEndState, MemoryFigures, markdown_figures
from lab.server_process import ServerProcess


def test_reduced_load_test_leaves_no_leaks_pins_or_errors(server: ServerProcess) -> None:
    load = LoadSettings(num_clients=120, num_requests=400, time_limit_s=300.0,
                        request_timeout_s=60.0, max_tokens=4, long_max_tokens=32,
                        job_turns=(2, 4), tool_gap_s=(0.05, 0.2), seed=7)
    report = run_load_test(server, LoadTestSettings(load=load))
    tally = report.tally
    assert report.passed, markdown_figures(report.figures(), report.checks)
    assert tally.num_sent == 400 and not tally.errors and tally.cut_at_time_limit == 0
    assert report.warmup.num_sent == 240 and not report.warmup.errors
    assert tally.peak_in_flight >= 100
    assert set(tally.sent) == {"stream_completion", "completion", "stream_chat", "chat",
                               "stream_disconnect", "give_up", "agent_turn"}
    assert tally.outcomes[OK] > 200 and tally.outcomes[DISCONNECTED] > 0
    # Every request ended one way or another, and no job was left open.
    assert sum(tally.outcomes.values()) == tally.num_sent
    assert tally.jobs["ended_by_last_step"] > 0 and tally.jobs["ended_by_delete"] > 0
    assert (tally.jobs["ended_by_last_step"] + tally.jobs["ended_by_delete"]
            + tally.jobs["cut_short"]) == tally.jobs["started"]
    assert report.pins_created is not None and sum(report.pins_created) > 0  # pins were made
    state, memory = report.end_state, report.memory
    assert state is not None and memory is not None
    assert state.total_blocks == 256 and state.leaked_blocks == 0
    assert state.num_pins == 0 and state.pinned_blocks == 0 and state.num_jobs == 0
    assert memory.growth_mib <= memory.bound_mib
    assert server.metrics()["continuum:invariant_checks_total"] > 0


def test_a_report_passes_only_if_every_check_did() -> None:
    checks = (Check("a", True, ""), Check("b", False, "why"))
    idle = EngineEndState.from_metrics({"continuum:kv_cache_total_blocks": 64.0,
                                        "continuum:kv_cache_free_blocks": 64.0}, idle=True)
    report = LoadTestReport(end_state=idle, memory=MemoryFigures(1, 1, 1, 1, 64),
                            checks=checks, tally=LoadTally(), warmup=LoadTally(),
                            pins_created=(0, 0))
    assert not report.passed
    assert "| b | FAIL | why |" in markdown_figures(report.figures(), report.checks)
    assert report.to_dict()["passed"] is False


def test_bench_load_refuses_bad_arguments_and_servers_that_do_not_start(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert cli_main(["load", "--clients", "0"]) == 2
    assert cli_main(["load", "--serve-args", "--port 8000"]) == 2
    assert capsys.readouterr().err.count("error:") == 2
    # A server that cannot start is reported with its log, and is a failure.
    assert cli_main(["load", "--serve-args=--num-kv-blocks 4 --max-model-len 4096"]) == 1
    assert "cannot start" in capsys.readouterr().err
