"""The simulator with several engine replicas behind a router (`bench sim --replicas`): each
replica steps on its own on the shared clock, affinity keeps a job's KV where its turns run,
and the load-balancing routers scatter them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.cli import main as cli_main
from engine.replicas.routing import rendezvous_rank
from eval.cluster import replica_ids, same_replica_fraction
from eval.simulator import ChatLoad, SimSettings, Simulation
from eval.workload import AgentJobSpec, ChatSessionSpec, ChatTurnSpec, TurnSpec
from tests.continuum.workload import TEST_DATA

SLICE = TEST_DATA / "minisweagent_deepseek_slice.jsonl"
TWO = replica_ids(2)


def agent_job(job_id: str, *, first: int = 3000, appended: int = 100, output: int = 4,
              turns: int = 8, tool_s: float = 0.05) -> AgentJobSpec:
    """A job whose context is long against its turns: re-prefilling it costs more than a turn."""
    return AgentJobSpec(job_id, tuple(
        TurnSpec(first if k == 0 else appended, output,
                 None if k == turns - 1 else "tool", None if k == turns - 1 else tool_s)
        for k in range(turns)))


def ids_placed_on(replica_id: str, count: int, prefix: str = "job") -> list[str]:
    """Job ids whose rendezvous-hash replica among `TWO` is `replica_id`."""
    candidates = (f"{prefix}-{i}" for i in range(1000))
    return [key for key in candidates if rendezvous_rank(key, TWO)[0] == replica_id][:count]


def settings(policy: str = "fcfs", **overrides: object) -> SimSettings:
    values: dict = {"policy": policy, "num_kv_blocks": 800, "max_num_batched_tokens": 512,
                    "check_invariants": True, **overrides}
    return SimSettings(**values)


def test_each_replica_runs_its_jobs_as_a_single_engine_would() -> None:
    """Two groups of jobs, each hashed to one replica and kept there: every turn of every job
    (its queueing, TTFT, cached tokens, end) is what one engine serving its group alone
    measures, to the last bit; the other replica's steps in between change nothing."""
    groups = [[agent_job(job_id, first=1200, turns=5, tool_s=0.3)
               for job_id in ids_placed_on(replica_id, 3)] for replica_id in TWO]
    jobs = groups[0] + groups[1]
    arrivals = {job.job_id: 0.02 * i for i, job in enumerate(jobs)}
    # Pins filling a small pool: turns queue, pins are released under pressure.
    pressured = {"policy": "continuum-fixed", "num_kv_blocks": 200}
    both = Simulation(jobs, [arrivals[job.job_id] for job in jobs],
                      settings(num_replicas=2, **pressured))
    metrics = both.run()
    assert metrics.num_finished_jobs == 6 and metrics.leaked_blocks == 0
    assert both.routing_summary().requests_per_replica == {TWO[0]: 15, TWO[1]: 15}
    assert both.routing_summary().counts == {"placed": 6, "affinity": 24}
    records = {record.job_id: record for record in both.records}
    alone = []
    for group in groups:
        run = Simulation(group, [arrivals[job.job_id] for job in group], settings(**pressured))
        alone.append(run.run())
        for record in run.records:
            assert records[record.job_id] == record
    assert metrics.pins_created == sum(m.pins_created for m in alone) > 0
    assert metrics.pins_released == {
        reason: sum(m.pins_released.get(reason, 0) for m in alone)
        for reason in metrics.pins_released}
    assert metrics.mean_queue_s > 0


def test_with_one_replica_the_router_changes_nothing() -> None:
    jobs = [agent_job(f"job-{i}", first=800, turns=4) for i in range(5)]
    arrivals = [0.05 * i for i in range(5)]
    runs = [Simulation(jobs, arrivals, settings(router=router, num_kv_blocks=150))
            for router in ("affinity", "round-robin", "least-loaded")]
    metrics = [run.run() for run in runs]
    assert metrics[0] == metrics[1] == metrics[2]
    assert [run.routing_summary().requests_per_replica for run in runs] == [{"replica-0": 20}] * 3
    assert runs[0].routing_summary().counts == {"placed": 5, "affinity": 15}
    assert runs[1].routing_summary().counts == {"spread": 20}


def test_affinity_keeps_a_jobs_turns_on_one_replica_and_round_robin_scatters_them() -> None:
    jobs = [agent_job(f"job-{i}") for i in range(8)]
    arrivals = [0.02 * i for i in range(8)]
    runs = {router: Simulation(jobs, arrivals, settings(num_replicas=2, router=router))
            for router in ("affinity", "round-robin", "least-loaded")}
    metrics = {router: run.run() for router, run in runs.items()}
    routing = {router: run.routing_summary() for router, run in runs.items()}
    for router in runs:
        assert metrics[router].num_finished_jobs == 8 and metrics[router].leaked_blocks == 0
        assert sum(routing[router].requests_per_replica.values()) == 64
    assert routing["affinity"].counts == {"placed": 8, "affinity": 56}
    assert routing["affinity"].same_replica_turn_fraction == 1.0
    assert all(len(set(turns)) == 1 for turns in runs["affinity"].placements().values())
    assert any(len(set(turns)) > 1 for turns in runs["round-robin"].placements().values())
    assert all(count > 0 for count in routing["affinity"].requests_per_replica.values())
    assert routing["round-robin"].counts == {"spread": 64}
    assert routing["round-robin"].requests_per_replica == {TWO[0]: 32, TWO[1]: 32}
    for router in ("round-robin", "least-loaded"):
        assert routing[router].same_replica_turn_fraction < 0.8
        # Scattered turns find less of their context and re-prefill the rest.
        assert (metrics[router].cached_token_fraction
                < metrics["affinity"].cached_token_fraction - 0.1)
        assert metrics[router].mean_jct_s > 1.2 * metrics["affinity"].mean_jct_s


def test_least_loaded_counts_the_requests_in_flight() -> None:
    """Replica 1 gets the short turns; once they finished, the next job goes there although
    replica 0 got no more requests."""
    long_turn, short_turn = TurnSpec(64, 200, None, None), TurnSpec(64, 1, None, None)
    jobs = [AgentJobSpec(f"j{i}", (long_turn if i % 2 == 0 else short_turn,)) for i in range(4)]
    jobs += [AgentJobSpec("late", (short_turn,)), AgentJobSpec("later", (short_turn,))]
    run = Simulation(jobs, [0.0, 0.0, 0.0, 0.0, 0.5, 100.0],
                     settings(num_replicas=2, router="least-loaded"))
    metrics = run.run()
    assert metrics.num_finished_jobs == 6
    # At 0.5 s replica 0 still runs its two long turns and replica 1 runs none.
    assert run.records[0].finished_s > 0.5 > run.records[1].finished_s
    assert run.routing_summary().requests_per_replica == {TWO[0]: 3, TWO[1]: 3}
    placements = run.placements()
    assert (placements["late"], placements["later"]) == ([TWO[1]], [TWO[0]])


def test_chat_sessions_are_routed_by_session_and_forgotten_after_their_last_turn() -> None:
    jobs = [agent_job(f"job-{i}", first=500, turns=3) for i in range(3)]
    chat = ChatLoad(tuple(ChatSessionSpec(f"chat-{i}", (ChatTurnSpec(300, 4, 0.2),
                                                        ChatTurnSpec(40, 4, 0.1),
                                                        ChatTurnSpec(40, 4, None)))
                          for i in range(4)), (0.0, 0.1, 0.2, 0.3))
    run = Simulation(jobs, [0.0, 0.05, 0.1], settings(num_replicas=2), chat)
    metrics = run.run()
    assert metrics.num_finished_jobs == 3 and metrics.chat_num_requests == 12
    assert run.routing_summary().counts == {"placed": 7, "affinity": 14}
    assert len(run.router) == 0  # every job and session ended
    # A session's later turns find its earlier ones in the cache of its replica.
    for session in run.records[3:]:
        assert all(turn.num_cached_tokens >= 288 for turn in session.turns[1:])


def test_same_replica_fraction() -> None:
    assert same_replica_fraction([["a", "a", "b"], ["b"], ["a", "a"]]) == pytest.approx(2 / 3)
    assert same_replica_fraction([["a"], []]) is None


def test_bad_replica_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="num_replicas must be >= 1"):
        SimSettings(policy="fcfs", num_replicas=0)
    with pytest.raises(ValueError, match="unknown router 'random'"):
        SimSettings(policy="fcfs", router="random")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="load_factor must be >= 1"):
        SimSettings(policy="fcfs", route_load_factor=0.5)
    assert replica_ids(12)[:2] == ["replica-00", "replica-01"]


def test_the_load_bound_flags_reach_the_affinity_router() -> None:
    """A job whose replica holds more requests than the bound moves; with a bound no load
    reaches, every turn stays on its job's replica."""
    jobs = [agent_job(f"job-{i}", first=400, turns=4, output=40) for i in range(12)]
    arrivals = [0.0] * len(jobs)
    tight = Simulation(jobs, arrivals, settings(num_replicas=2, route_load_factor=1.0,
                                                route_min_move_load=2))
    loose = Simulation(jobs, arrivals, settings(num_replicas=2, route_load_factor=100.0,
                                                route_min_move_load=1000))
    for run in (tight, loose):
        assert run.run().num_finished_jobs == len(jobs)
    assert tight.routing_summary().counts.get("moved", 0) > 0
    assert tight.routing_summary().same_replica_turn_fraction < 1.0
    assert loose.routing_summary().counts == {"placed": 12, "affinity": 36}


def test_each_replica_writes_its_own_trace(tmp_path: Path) -> None:
    jobs = [agent_job(f"job-{i}", first=200, turns=2) for i in range(4)]
    path = tmp_path / "sim.jsonl"
    one = SimSettings(policy="fcfs", trace_path=str(path))
    assert one.replica_trace_path("replica-0") == str(path)
    Simulation(jobs, [0.0] * 4, settings(num_replicas=2, router="round-robin",
                                         trace_path=str(path))).run()
    written = sorted(p.name for p in tmp_path.iterdir())
    assert written == ["sim.replica-0.jsonl", "sim.replica-1.jsonl"]
    assert all((tmp_path / name).stat().st_size > 0 for name in written)


def test_bench_sim_reports_the_routing_of_each_run(tmp_path: Path,
                                                   capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "sim.json"
    code = cli_main(["bench", "sim", "--trace", str(SLICE), "--first-jobs", "4",
                     "--max-turns", "3", "--token-scale", "0.1", "--num-kv-blocks", "64",
                     "--max-num-batched-tokens", "512", "--policies", "fcfs,continuum",
                     "--jobs-per-s", "5", "--replicas", "3", "--router", "round-robin",
                     "--json", str(out)])
    assert code == 0
    report = json.loads(out.read_text())
    assert (report["settings"]["num_replicas"], report["settings"]["router"]) == (
        3, "round-robin")
    for run in report["runs"]:
        assert (run["replicas"], run["router"]) == (3, "round-robin")
        assert run["routing_counts"] == {"spread": run["num_turns"]}
        assert list(run["requests_per_replica"]) == replica_ids(3)
        assert run["num_finished_jobs"] == 4 and run["leaked_blocks"] == 0
    printed = capsys.readouterr().out
    assert "on 3 x h100-llama3.1-8b, router round-robin (4 jobs)" in printed
    assert "Routing (round-robin):" in printed and "| 5 | continuum | 0 | 0 | 0 | 0 |" in printed


@pytest.mark.parametrize("flags", [["--replicas", "0"], ["--router", "random"],
                                   ["--route-load-factor", "0"]])
def test_bench_sim_refuses_bad_replica_flags(flags: list[str],
                                             capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit):
        cli_main(["bench", "sim", "--trace", str(SLICE), "--jobs-per-s", "1", *flags])
    assert flags[0] in capsys.readouterr().err


@pytest.mark.parametrize(("flags", "message"), [
    (["--router", "round-robin", "--route-min-move-load", "4"], "affinity router only"),
    (["--route-load-factor", "0.5"], "load_factor must be >= 1"),
    (["--route-min-move-load", "-1"], "min_move_load must be >= 0"),
])
def test_bench_sim_refuses_a_bad_load_bound(flags: list[str], message: str,
                                            capsys: pytest.CaptureFixture) -> None:
    code = cli_main(["bench", "sim", "--trace", str(SLICE), "--jobs-per-s", "1",
                     "--replicas", "2", *flags])
    assert code == 2 and message in capsys.readouterr().err
