"""`continuum bench sim`'s command line: policy specs with options (`eval.policy_specs`),
drawing jobs with replacement, turn scaling, chat sessions beside the jobs, and determinism
across workers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.cli import main as cli_main
from engine.executor.roofline import SIM_PROFILES
from eval.bench.sim import ChatWorkload, host_tier_gib, run_comparison
from eval.policy_specs import policy_specs
from eval.simulator import SimSettings
from eval.workload import ChatSessionSpec, ChatTurnSpec, LoadOptions, load_jobs
from tests.continuum.workload import TEST_DATA

SLICE = TEST_DATA / "minisweagent_deepseek_slice.jsonl"
SMALL = ("--trace", str(SLICE), "--max-turns", "3", "--token-scale", "0.1",
         "--num-kv-blocks", "64", "--max-num-batched-tokens", "512")
CHAT_FIELDS = ("chat_num_sessions", "chat_num_requests", "chat_queue_p50_s",
               "chat_queue_p99_s", "chat_ttft_p50_s", "chat_ttft_p99_s")


def write_chat_trace(path: Path) -> Path:
    """Three sessions in the converted Mooncake layout: turns timed by `t_arrival_s`."""
    def turn(at_s: float, prompt: int, output: int) -> dict:
        return {"t_arrival_s": at_s, "input_tokens": prompt, "output_tokens": output,
                "tool_name": None, "tool_duration_s": None}
    sessions = [
        {"job_id": "c0", "turns": [turn(0.0, 60, 8), turn(2.0, 80, 4)]},
        {"job_id": "c1", "turns": [turn(5.0, 30, 6)]},
        {"job_id": "c2", "turns": [turn(1.0, 50, 5), turn(1.5, 70, 5), turn(9.0, 90, 3)]},
    ]
    path.write_text("".join(json.dumps(session) + "\n" for session in sessions))
    return path


def test_bad_spec_is_refused_before_the_trace_is_read(capsys: pytest.CaptureFixture) -> None:
    code = cli_main(["bench", "sim", "--trace", "/nonexistent.jsonl", "--jobs-per-s", "1",
                     "--policies", "fcfs,continuum:bogus=1"])
    assert code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: policy spec 'continuum:bogus=1'") and "trace" not in err
    with pytest.raises(SystemExit):  # the estimator is a policy option now
        cli_main(["bench", "sim", *SMALL, "--jobs-per-s", "1", "--estimator", "fixed-2s"])


def test_specs_label_the_rows_and_record_the_policy_and_options(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "sim.json"
    fixed = "continuum:estimator=fixed-2s:max_plain_wait_s=20"
    code = cli_main(["bench", "sim", *SMALL, "--first-jobs", "3", "--jobs-per-s", "5",
                     "--policies", f"fcfs,{fixed}", "--json", str(out),
                     "--plot", str(tmp_path / "sim.png")])
    assert code == 0
    report = json.loads(out.read_text())
    fcfs, continuum = report["runs"]
    assert report["policies"] == ["fcfs", fixed]
    assert (continuum["label"], continuum["policy"]) == (fixed, "continuum")
    assert continuum["policy_options"] == {"estimator": "fixed-2s", "max_plain_wait_s": "20"}
    assert (fcfs["label"], fcfs["policy"], fcfs["policy_options"]) == ("fcfs", "fcfs", {})
    assert continuum["pins_created"] > 0 and fcfs["pins_created"] == 0
    assert {"p50_queue_s", "p99_queue_s"} <= set(continuum)
    assert all(fcfs[name] is None for name in CHAT_FIELDS)
    assert f"| 5 | {fixed} |" in capsys.readouterr().out
    assert "chat" not in report and (tmp_path / "sim.png").exists()


def test_tier_rows_run_with_a_host_tier_and_report_its_hits(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "sim.json"
    code = cli_main(["bench", "sim", *SMALL, "--first-jobs", "6", "--jobs-per-s", "5",
                     "--policies", "fcfs,fcfs+tier", "--kv-offload-gib", "0.5",
                     "--json", str(out)])
    assert code == 0
    fcfs, tier = json.loads(out.read_text())["runs"]
    assert (tier["label"], tier["policy"], tier["kv_offload_gib"]) == ("fcfs+tier", "fcfs", 0.5)
    assert fcfs["kv_offload_gib"] == 0.0 and fcfs["host_hit_token_fraction"] is None
    assert tier["host_hit_token_fraction"] > 0 and tier["host_loaded_tokens"] > 0
    assert tier["cached_token_fraction"] > fcfs["cached_token_fraction"]
    assert tier["num_finished_jobs"] == 6 and tier["leaked_blocks"] == 0
    table = capsys.readouterr().out
    assert "from host tier |" in table
    assert "| 5 | fcfs |" in table and "| 5 | fcfs+tier |" in table


def test_tier_rows_default_to_the_profiles_host_memory() -> None:
    assert host_tier_gib("h100-llama3.1-8b") == pytest.approx(
        SIM_PROFILES["h100-llama3.1-8b"].host_memory_bytes / 2**30)
    assert host_tier_gib("h100-llama3.1-8b", 2.0) == 2.0
    jobs = load_jobs(SLICE, LoadOptions(max_jobs=2, max_turns=2, token_scale=0.1))
    settings = SimSettings(policy="fcfs", num_kv_blocks=64, max_num_batched_tokens=512)
    plain, tier = run_comparison(jobs, settings, policy_specs("fcfs,fcfs+tier"), [5.0])
    assert plain["kv_offload_gib"] == 0.0
    assert tier["kv_offload_gib"] == host_tier_gib("h100-llama3.1-8b")
    assert tier["host_stored_tokens"] is not None


def test_offload_size_needs_a_tier_row(capsys: pytest.CaptureFixture) -> None:
    assert cli_main(["bench", "sim", *SMALL, "--jobs-per-s", "1", "--policies", "fcfs",
                     "--kv-offload-gib", "1"]) == 2
    assert "--kv-offload-gib sizes the host tier" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli_main(["bench", "sim", *SMALL, "--jobs-per-s", "1", "--policies", "fcfs+tier",
                  "--kv-offload-gib", "0"])


def test_num_jobs_draws_with_replacement_and_repeat_turns_scales(tmp_path: Path) -> None:
    out = tmp_path / "sim.json"
    code = cli_main(["bench", "sim", *SMALL, "--first-jobs", "2", "--num-jobs", "5",
                     "--repeat-turns", "2", "--jobs-per-s", "all", "--policies", "fcfs",
                     "--json", str(out)])
    assert code == 0
    report = json.loads(out.read_text())
    run, = report["runs"]
    assert run["num_finished_jobs"] == report["workload"]["num_jobs"] == 5
    assert report["workload"]["mean_turns"] == 6
    assert run["num_turns"] == 30
    with pytest.raises(SystemExit):
        cli_main(["bench", "sim", *SMALL, "--jobs-per-s", "1", "--repeat-turns", "0"])


def test_chat_sessions_beside_the_jobs_are_reported_apart(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    chat = write_chat_trace(tmp_path / "chat.jsonl")
    out = tmp_path / "sim.json"
    code = cli_main(["bench", "sim", *SMALL, "--first-jobs", "3", "--jobs-per-s", "5",
                     "--policies", "fcfs,continuum", "--chat-trace", str(chat),
                     "--chat-sessions-per-s", "2", "--chat-sessions", "4", "--json", str(out)])
    assert code == 0
    report = json.loads(out.read_text())
    assert report["chat"]["num_sessions_in_trace"] == 3
    for run in report["runs"]:
        assert run["num_jobs"] == 3 and run["chat_num_sessions"] == 4
        assert run["num_turns"] == 9 and run["chat_num_requests"] >= 4
        assert all(run[name] is not None for name in CHAT_FIELDS)
    table = capsys.readouterr().out
    assert "chat queueing p50 / p99 (s)" in table and "chat TTFT p50 / p99 (s)" in table


@pytest.mark.parametrize(("flags", "message"), [
    (("--chat-sessions-per-s", "1"), "need --chat-workload or --chat-trace"),
    (("--chat-trace", "CHAT"), "need --chat-sessions-per-s"),
    (("--chat-workload", "mooncake"), "need --chat-sessions-per-s"),
])
def test_chat_flags_go_together(tmp_path: Path, capsys: pytest.CaptureFixture,
                                flags: tuple[str, ...], message: str) -> None:
    chat = str(write_chat_trace(tmp_path / "chat.jsonl"))
    args = [chat if flag == "CHAT" else flag for flag in flags]
    assert cli_main(["bench", "sim", *SMALL, "--jobs-per-s", "1", *args]) == 2
    assert message in capsys.readouterr().err


def test_default_chat_sessions_cover_the_jobs_arrival_window() -> None:
    session = ChatSessionSpec("s", (ChatTurnSpec(10, 2, None),))
    workload = ChatWorkload((session,), sessions_per_s=4.0)
    load = workload.load_for([0.0, 3.0, 10.0], seed=0)
    assert len(load.sessions) == len(load.arrivals_s) > 20
    assert load.arrivals_s[0] == 0.0 and max(load.arrivals_s) <= 10.0
    assert len({s.session_id for s in load.sessions}) == len(load.sessions)
    assert workload.load_for([0.0, 0.0], seed=0).arrivals_s == (0.0,)
    assert workload.load_for([0.0, 3.0, 10.0], seed=0) == load


@pytest.mark.parametrize(("num_replicas", "router"), [(1, "affinity"), (3, "affinity"),
                                                     (2, "least-loaded")])
def test_runs_are_the_same_whatever_the_workers(num_replicas: int, router: str) -> None:
    jobs = load_jobs(SLICE, LoadOptions(max_jobs=3, max_turns=3, token_scale=0.1))
    sessions = ChatSessionSpec("s", (ChatTurnSpec(30, 3, 0.2), ChatTurnSpec(5, 3, None)))
    chat = ChatWorkload((sessions,), sessions_per_s=2.0, num_sessions=3)
    settings = SimSettings(policy="fcfs", num_kv_blocks=64, max_num_batched_tokens=512,
                           num_replicas=num_replicas, router=router)
    specs = policy_specs("fcfs,continuum:estimator=fixed-2s")

    def runs(workers: int) -> list[dict]:
        return [{k: v for k, v in run.items() if k != "wall_s"} for run in run_comparison(
            jobs, settings, specs, [5.0, None], workers=workers, chat=chat)]

    assert runs(1) == runs(2)
