"""The replicated server on a real local Ray Serve: two CPU replicas of `tiny`, agent jobs
replayed by the `bench agent` client, routing, job operations, metrics and a replica killed
mid-run."""

from __future__ import annotations

import argparse
import asyncio
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import openai
import pytest

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")

from engine.entrypoints.serve import add_arguments  # noqa: E402
from engine.replicas.ray_app import ReplicaAppSettings, build_application  # noqa: E402
from engine.replicas.routing import RouterName  # noqa: E402
from eval.arrivals import poisson_arrivals_s  # noqa: E402
from eval.metrics import JobRecord, RunMetrics  # noqa: E402
from eval.replay_client import AgentReplay, ReplaySettings  # noqa: E402
from eval.workload import AgentJobSpec, LoadOptions, TurnSpec, load_jobs  # noqa: E402
from tests.continuum.workload import TEST_DATA  # noqa: E402
from tests.engine.entrypoints.openai.conftest import start_server  # noqa: E402

APP = "continuum-test"
ENGINE_FLAGS = ["--model", "tiny", "--num-kv-blocks", "128", "--max-model-len", "1024",
                "--scheduling-policy", "continuum"]
SLICE = TEST_DATA / "minisweagent_deepseek_slice.jsonl"


def eight_jobs() -> list[AgentJobSpec]:
    jobs = load_jobs(SLICE, LoadOptions(max_jobs=4, max_turns=4, token_scale=0.05))
    # Twice each job of the slice, under other ids: 8 jobs, with the slice's shapes.
    return jobs + [AgentJobSpec(f"{job.job_id}-b", job.turns) for job in jobs]


class RayServer:
    """A local Ray with Ray Serve's proxy on a free port, and the app deployed there."""

    def __init__(self) -> None:
        ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING",
                 log_to_driver=False)
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        serve.start(http_options={"host": "127.0.0.1", "port": self.port})
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.router: RouterName | None = None
        self._runs: dict[RouterName, tuple[RunMetrics, list[JobRecord]]] = {}

    def deploy(self, router: RouterName) -> None:
        """Deploys the app with `router` (restarting the replicas) unless it is deployed."""
        if router == self.router:
            return
        parser = argparse.ArgumentParser()
        add_arguments(parser)
        settings = ReplicaAppSettings(serve_args=vars(parser.parse_args(ENGINE_FLAGS)),
                                      num_replicas=2, router=router, replica_num_cpus=0)
        serve.run(build_application(settings), name=APP, route_prefix="/")
        self.router = router
        self._wait_for_both_replicas()

    def eight_jobs_run(self, router: RouterName) -> tuple[RunMetrics, list[JobRecord]]:
        """The replay of `eight_jobs` with `router` (run once per router)."""
        if router not in self._runs:
            self.deploy(router)
            self._runs[router] = self.replay(eight_jobs())
        return self._runs[router]

    def _wait_for_both_replicas(self) -> None:
        # The ingress's router learns of the replicas shortly after the app is up; until it
        # knows both, jobs would all be placed on one.
        seen: set[str] = set()
        for _ in range(200):
            response = httpx.get(self.base_url + "/v1/models", timeout=30)
            seen.add(response.headers["x-continuum-replica"])
            if len(seen) == 2:
                return
        raise AssertionError(f"only replicas {seen} answered")

    def replay(self, jobs: list[AgentJobSpec]) -> tuple[RunMetrics, list[JobRecord]]:
        replay = AgentReplay(eight_jobs(), poisson_arrivals_s(8, 20.0),
                             ReplaySettings(base_url=self.base_url, request_timeout_s=120))
        metrics = asyncio.run(replay.run())
        return metrics, replay.records

    def stop(self) -> None:
        # Without Ray Serve's graceful shutdown, which waits out every replica's: the engine
        # core processes exit with their replica.
        ray.shutdown()


@pytest.fixture(scope="module")
def ray_server() -> Iterator[RayServer]:
    server = RayServer()
    yield server
    server.stop()


def test_affinity_keeps_each_job_on_one_replica_and_its_cache(ray_server: RayServer) -> None:
    metrics, records = ray_server.eight_jobs_run("affinity")
    assert metrics.failures == 0 and metrics.num_finished_jobs == 8
    for record in records:
        assert len(record.replica_ids) == 4 and len(set(record.replica_ids)) == 1, record

    single = start_server(num_kv_blocks=128, max_model_len=1024, scheduling_policy="continuum")
    try:
        replay = AgentReplay(eight_jobs(), poisson_arrivals_s(8, 20.0),
                             ReplaySettings(base_url=single.base_url))
        single_metrics = asyncio.run(replay.run())
    finally:
        single.stop()
    assert single_metrics.failures == 0
    assert metrics.cached_token_fraction >= single_metrics.cached_token_fraction > 0

    text = httpx.get(ray_server.base_url + "/metrics", timeout=60).text
    assert text.count('continuum:num_preemptions_total{model_name="tiny",replica=') == 2
    affinity = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith('continuum:routing_decisions_total{kind="affinity"'))
    assert affinity >= 8 * 3  # every later turn of every job went to its job's replica


def test_job_operations_reach_the_jobs_replica(ray_server: RayServer) -> None:
    ray_server.deploy("affinity")
    client = openai.OpenAI(base_url=ray_server.base_url + "/v1", api_key="x", max_retries=0)
    raw = client.completions.with_raw_response.create(
        model="tiny", prompt=[5] * 40, max_tokens=3, extra_body={"job_id": "ops-job"})
    replica = raw.headers["x-continuum-replica"]
    for _ in range(4):  # the other replica does not know the job: a miss would be a 404
        job = httpx.get(ray_server.base_url + "/v1/jobs/ops-job", timeout=30)
        assert job.status_code == 200 and job.json()["id"] == "ops-job"
        assert job.headers["x-continuum-replica"] == replica
        assert job.headers["x-continuum-route"] == "lookup"
    deleted = httpx.delete(ray_server.base_url + "/v1/jobs/ops-job", timeout=30)
    assert deleted.status_code == 200 and deleted.json()["deleted"] is True
    missing = httpx.get(ray_server.base_url + "/v1/jobs/never-seen", timeout=30)
    assert missing.status_code == 404 and "error" in missing.json()


def test_responses_follow_ups_reach_the_replica_holding_the_conversation(
        ray_server: RayServer) -> None:
    ray_server.deploy("affinity")
    client = openai.OpenAI(base_url=ray_server.base_url + "/v1", api_key="x", max_retries=0)
    first = client.responses.with_raw_response.create(model="tiny", input="hello there",
                                                      max_output_tokens=4)
    replica = first.headers["x-continuum-replica"]
    previous = first.parse().id
    for _ in range(3):
        stream = client.responses.with_raw_response.create(
            model="tiny", input="go on", previous_response_id=previous, max_output_tokens=4,
            stream=True)
        assert stream.headers["x-continuum-replica"] == replica
        events = list(stream.parse())
        previous = events[-1].response.id
    assert client.responses.retrieve(previous).id == previous


def test_bad_input_gets_the_single_servers_error(ray_server: RayServer) -> None:
    ray_server.deploy("affinity")
    response = httpx.post(ray_server.base_url + "/v1/chat/completions", timeout=30,
                          json={"model": "tiny", "messages": [], "max_tokens": -1})
    assert response.status_code == 400
    assert response.json()["error"]["type"] == "invalid_request_error"


def test_a_killed_replica_leaves_the_other_replicas_jobs_complete(
        ray_server: RayServer) -> None:
    """Kills a replica while a streamed turn and a long unstreamed completion are on it: the
    jobs that never ran there complete, the completion (no output yet) is retried on the other
    replica, and the streams cut off end with an error."""
    ray_server.deploy("affinity")
    jobs = [AgentJobSpec(f"kill-{index}", tuple(TurnSpec(24, 6, "bash", 0.3)
                                                for _ in range(4)))
            for index in range(8)]
    replay = AgentReplay(jobs, [0.0] * len(jobs),
                         ReplaySettings(base_url=ray_server.base_url, request_timeout_s=120))
    result: list[RunMetrics] = []
    runner = threading.Thread(target=lambda: result.append(asyncio.run(replay.run())))
    runner.start()
    victim, before_kill, long_request = _kill_a_replica_after_some_turns(
        replay, ray_server.base_url)
    runner.join(timeout=240)
    long_request.join(timeout=240)
    assert not runner.is_alive() and result
    assert any(victim in touched for touched in before_kill)
    assert any(victim not in touched for touched in before_kill)
    for job, touched in zip(replay.records, before_kill, strict=True):
        if victim not in touched:
            assert job.error is None and job.finished_s is not None, job
    rerouted = [job for job, touched in zip(replay.records, before_kill, strict=True)
                if victim in touched and job.error is None]
    for job in rerouted:  # finished elsewhere, after its replica died
        assert job.replica_ids[-1] != victim
    retried = long_request.response
    assert retried is not None and retried.status_code == 200, retried
    assert retried.headers["x-continuum-replica"] != victim
    assert retried.headers["x-continuum-route"] == "rerouted"
    assert retried.json()["usage"]["completion_tokens"] == LONG_OUTPUT_TOKENS
    text = httpx.get(ray_server.base_url + "/metrics", timeout=60).text
    assert "continuum:replica_retries_total 1.0" in text


def test_round_robin_scatters_jobs_and_loses_their_cache(ray_server: RayServer) -> None:
    affinity_metrics, _ = ray_server.eight_jobs_run("affinity")
    metrics, records = ray_server.eight_jobs_run("round-robin")
    assert metrics.failures == 0
    assert any(len(set(record.replica_ids)) > 1 for record in records)
    assert metrics.cached_token_fraction < affinity_metrics.cached_token_fraction


LONG_OUTPUT_TOKENS = 600


class LongCompletion(threading.Thread):
    """An unstreamed completion of `LONG_OUTPUT_TOKENS` tokens, a turn of job `job_id`."""

    def __init__(self, base_url: str, job_id: str) -> None:
        super().__init__()
        self.base_url = base_url
        self.job_id = job_id
        self.response: httpx.Response | None = None

    def run(self) -> None:
        self.response = httpx.post(self.base_url + "/v1/completions", timeout=240, json={
            "model": "tiny", "prompt": [9] * 24, "max_tokens": LONG_OUTPUT_TOKENS,
            "ignore_eos": True, "job_id": self.job_id})


def _kill_a_replica_after_some_turns(
        replay: AgentReplay, base_url: str) -> tuple[str, list[set[str]], LongCompletion]:
    """Once every job has had a turn answered, sends a long completion for the first job and
    kills the replica that answered that job (Ray Serve restarts it under a new id) while the
    completion runs there; returns the replica's id, by job the replicas that had answered
    its turns by then, and the completion."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        started = list(replay.started)
        if len(started) == len(replay.jobs) and all(r.replica_ids for r in started):
            victim = started[0].replica_ids[0]
            touched = {record.job_id: set(record.replica_ids) for record in started}
            long_request = LongCompletion(base_url, started[0].job_id)
            long_request.start()
            time.sleep(0.5)
            actor = ray.get_actor(f"SERVE_REPLICA::{APP}#EngineReplica#{victim}",
                                  namespace="serve")
            ray.kill(actor, no_restart=False)
            return victim, [touched[job.job_id] for job in replay.jobs], long_request
        time.sleep(0.02)
    raise AssertionError("the replay did not get going")
