"""The replicated server on a real local Ray Serve: two CPU replicas of `tiny`, agent jobs
replayed by the `bench agent` client, routing, job operations, metrics and a replica killed
mid-run."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import json
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
from starlette.responses import Response

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")

from engine.cli import main as cli_main  # noqa: E402
from engine.entrypoints.openai.json_body import (  # noqa: E402
    INLINE_PARSE_BYTES,
    ChildAnswerTimeout,
)
from engine.entrypoints.openai.work_pool import TenantWorkPool  # noqa: E402
from engine.entrypoints.server_args import add_arguments  # noqa: E402
from engine.replicas.asgi import ProxiedRequest  # noqa: E402
from engine.replicas.ray_app import (  # noqa: E402
    Ingress,
    ReplicaAppSettings,
    build_application,
    stop_application,
)
from engine.replicas.routing import Route, RouterName, rendezvous_rank  # noqa: E402
from engine.replicas.routing_key import job_key  # noqa: E402
from eval.replay_client import AgentReplay, ReplaySettings  # noqa: E402
from eval.replay_metrics import RunMetrics  # noqa: E402
from eval.workload import AgentJobSpec, TurnSpec  # noqa: E402
from tests.continuum.workload import TEST_DATA  # noqa: E402
from tests.engine.entrypoints.openai.conftest import start_server  # noqa: E402

APP = "continuum-test"
ENGINE_FLAGS = ["--model", "tiny", "--num-kv-blocks", "128", "--max-model-len", "1024",
                "--scheduling-policy", "continuum"]
SLICE = TEST_DATA / "minisweagent_deepseek_slice.jsonl"
# The round-robin deployment, which the last four tests share (deployments take most of this
# file's time): one tenant (the key's) whose body bytes in flight are two bodies of the
# largest size; a refusal sent again within 3 s of the previous is answered 3 s late. A drain
# ends at once: the last test stops the application.
KEY_AND_BUDGET_FLAGS = ("--api-key", "secret", "--max-request-body-bytes", "65536",
                        "--max-body-bytes-in-flight", "131072", "--retry-after-s", "3",
                        "--shutdown-timeout-s", "0")
FLAGS_OF_ROUTER: dict[RouterName, tuple[str, ...]] = {
    "affinity": (), "round-robin": KEY_AND_BUDGET_FLAGS}


def bench_agent(base_url: str, tmp_path: Path, api_key: str = "EMPTY"
                ) -> tuple[dict[str, Any], str]:
    """`continuum bench agent` with the first 8 jobs of the slice (4 turns each): the run's
    figures from its JSON, and what it printed."""
    out = tmp_path / f"agent-{time.monotonic_ns()}.json"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        code = cli_main(["bench", "agent", "--base-url", base_url, "--trace", str(SLICE),
                         "--first-jobs", "8", "--max-turns", "4", "--token-scale", "0.05",
                         "--jobs-per-s", "20", "--api-key", api_key, "--no-progress",
                         "--json", str(out)])
    assert code == 0, printed.getvalue()
    run, = json.loads(out.read_text())["runs"]
    return run, printed.getvalue()


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
        self.deployed: RouterName | None = None
        self.replica_ids: set[str] = set()
        self._runs: dict[RouterName, tuple[dict[str, Any], str]] = {}

    def deploy(self, router: RouterName) -> None:
        """Deploys the app with `router` and its `FLAGS_OF_ROUTER` unless it is deployed so.
        A deployed app is deleted first: Ray Serve's update would replace its replicas one
        at a time, which takes about 10 s longer here."""
        if router == self.deployed:
            return
        if self.deployed is not None:
            serve.delete(APP)
            self.deployed = None
        parser = argparse.ArgumentParser()
        add_arguments(parser)
        settings = ReplicaAppSettings(
            serve_args=vars(parser.parse_args([*ENGINE_FLAGS, *FLAGS_OF_ROUTER[router]])),
            num_replicas=2, router=router, replica_num_cpus=0)
        serve.run(build_application(settings), name=APP, route_prefix="/")
        self.deployed = router
        self._wait_for_both_replicas(self.api_key)

    @property
    def api_key(self) -> str:
        """The deployed app's API key ("EMPTY" when it has none, as clients send then)."""
        flags = () if self.deployed is None else FLAGS_OF_ROUTER[self.deployed]
        return flags[flags.index("--api-key") + 1] if "--api-key" in flags else "EMPTY"

    def bench_agent_run(self, router: RouterName, tmp_path: Path) -> tuple[dict[str, Any], str]:
        """`bench_agent` against the app with `router` (run once per router)."""
        if router not in self._runs:
            self.deploy(router)
            self._runs[router] = bench_agent(self.base_url, tmp_path, self.api_key)
        return self._runs[router]

    def _wait_for_both_replicas(self, api_key: str) -> None:
        # The ingress's router learns of the replicas shortly after the app is up; until it
        # knows both, jobs would all be placed on one.
        seen: set[str] = set()
        for _ in range(200):
            response = httpx.get(self.base_url + "/v1/models", timeout=30,
                                 headers={"Authorization": f"Bearer {api_key}"})
            seen.add(response.headers["x-continuum-replica"])
            if len(seen) == 2:
                self.replica_ids = seen
                return
        raise AssertionError(f"only replicas {seen} answered")

    def stop(self) -> None:
        # Without Ray Serve's graceful shutdown, which waits out every replica's: the engine
        # core processes exit with their replica.
        ray.shutdown()


@pytest.fixture(scope="module")
def ray_server() -> Iterator[RayServer]:
    server = RayServer()
    yield server
    server.stop()


class DeadChildren:
    """A body parser whose children die (or do not answer) at every body: it raises `error`;
    records the bodies it was given."""

    def __init__(self, error: Exception) -> None:
        self.error = error
        self.bodies: list[bytes] = []

    def summary(self, body: bytes, summarize: Callable[[bytes], Any]) -> Any:
        self.bodies.append(body)
        raise self.error

    def shutdown(self) -> None:
        pass


@pytest.mark.parametrize("error", [BrokenProcessPool("a child died"),
                                   ChildAnswerTimeout("no answer")])
def test_which_bodies_are_routed_in_a_child_and_without_one_when_it_died(error) -> None:
    """Without Ray: a generation body over `INLINE_PARSE_BYTES` goes to the ingress's parsing
    child; when the children die, a Responses request is asked of each replica in turn (it
    may follow a response only one replica stores) and any other is load-balanced. A body of
    `INLINE_PARSE_BYTES` is routed inline."""
    # The class itself, under Ray Serve's ASGI wrapper (whose `__del__` is a coroutine).
    unwrapped = next(cls for cls in Ingress.__mro__ if "_generation_route" in vars(cls))
    ingress = unwrapped.__new__(unwrapped)
    ingress._work_pool, ingress._body_parser = TenantWorkPool(2), DeadChildren(error)
    ingress._responses, ingress._routes_unread = OrderedDict(), 0

    async def route(path: str, body: bytes) -> Route | None:
        return await ingress._generation_route(
            ProxiedRequest("POST", path, b"", (), body), None)

    def prompt_of(num_bytes: int, opening: bytes = b'{"prompt": "') -> bytes:
        return opening + b"x" * (num_bytes - len(opening) - 2) + b'"}'

    large, inline = prompt_of(INLINE_PARSE_BYTES + 1), prompt_of(INLINE_PARSE_BYTES)
    nested = b'{"input": ' + b"[" * 900 + b"]" * 900 + b', "user": "' + b"x" * 70_000 + b'"}'
    try:
        assert asyncio.run(route("/v1/responses", nested)) is None
        assert asyncio.run(route("/v1/completions", large)) == Route(None)
        assert ingress._body_parser.bodies == [nested, large]
        assert ingress._routes_unread == 2
        assert asyncio.run(route("/v1/completions", inline)).key is not None
        assert ingress._body_parser.bodies == [nested, large]
    finally:
        ingress._work_pool.shutdown()


def test_requests_asked_of_each_replica_start_at_the_next_replica_each_time() -> None:
    """Without Ray: a request that any replica serves (a Responses body whose route could
    not be read) goes to the first replica asked; the next such request starts at the next
    replica, so that they spread out. One that names something unknown is asked of all."""
    unwrapped = next(cls for cls in Ingress.__mro__ if "_ask_each_replica" in vars(cls))
    ingress = unwrapped.__new__(unwrapped)
    ingress._num_replicas, ingress._first_replica_asked = 3, 0
    asked: list[int | None] = []
    unknown_on: set[int] = set()

    async def send(request: ProxiedRequest, route: Route) -> Response:
        asked.append(route.replica_index)
        index = (route.replica_index or 0) % 3
        return Response(status_code=404 if index in unknown_on else 200)

    ingress._send = send
    request = ProxiedRequest("POST", "/v1/responses", b"", (), b"{}")
    for _ in range(4):
        assert asyncio.run(ingress._ask_each_replica(request)).status_code == 200
    assert [index % 3 for index in asked] == [0, 1, 2, 0]
    asked.clear()
    unknown_on.update({1, 2})
    assert asyncio.run(ingress._ask_each_replica(request)).status_code == 200
    assert [index % 3 for index in asked] == [1, 2, 0]


def test_affinity_keeps_each_job_on_one_replica_and_its_cache(
        ray_server: RayServer, tmp_path: Path) -> None:
    run, printed = ray_server.bench_agent_run("affinity", tmp_path)
    assert run["failures"] == 0 and run["num_finished_jobs"] == 8
    assert "jobs on one replica 8/8" in printed

    single = start_server(num_kv_blocks=128, max_model_len=1024, scheduling_policy="continuum")
    try:
        single_run, single_printed = bench_agent(single.base_url, tmp_path)
    finally:
        single.stop()
    assert single_run["failures"] == 0 and "replica" not in single_printed
    assert run["cached_token_fraction"] >= single_run["cached_token_fraction"] > 0

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
    # A follow-up over INLINE_PARSE_BYTES: its route read in the ingress's parsing child.
    padded = json.dumps({"model": "tiny", "input": "go on", "max_output_tokens": 4,
                         "previous_response_id": previous})
    padded = padded[:-1] + " " * INLINE_PARSE_BYTES + "}"
    large = httpx.post(ray_server.base_url + "/v1/responses", content=padded, timeout=60,
                       headers={"Content-Type": "application/json"})
    assert large.status_code == 200, large.text
    assert large.headers["x-continuum-replica"] == replica
    assert large.headers["x-continuum-route"] == "affinity"  # not each replica in turn
    assert _ingress_sample(ray_server.base_url, {}, "continuum:ingress_routes_unread_total") == 0
    previous = large.json()["id"]
    assert client.responses.retrieve(previous).id == previous
    listed = client.responses.input_items.with_raw_response.list(previous, order="asc")
    assert listed.headers["x-continuum-replica"] == replica  # the replica storing it
    items = listed.parse().data  # the first input, then four turns of output and "go on"
    assert [item.role for item in items] == ["user", *["assistant", "user"] * 4]
    assert (items[0].content[0].text, items[-1].content[0].text) == ("hello there", "go on")
    # Ids no replica stores: each replica is asked, and the single server's answer comes back.
    unknown = httpx.post(ray_server.base_url + "/v1/responses", timeout=60, json={
        "model": "tiny", "input": "x", "previous_response_id": "resp_never",
        "max_output_tokens": 2})
    assert unknown.status_code == 400
    assert unknown.json()["error"]["param"] == "previous_response_id"
    assert httpx.get(ray_server.base_url + "/v1/responses/resp_never", timeout=60
                     ).status_code == 404


def test_a_messages_conversation_stays_on_its_replica(ray_server: RayServer) -> None:
    ray_server.deploy("affinity")
    client = anthropic.Anthropic(base_url=ray_server.base_url, api_key="x", max_retries=0)
    system = [{"type": "text", "text": "You answer in one word.",
               "cache_control": {"type": "ephemeral"}}]
    messages: list[dict[str, Any]] = [{"role": "user", "content": "hello there"}]
    first = client.messages.with_raw_response.create(model="tiny", max_tokens=4,
                                                     system=system, messages=messages)
    replica = first.headers["x-continuum-replica"]
    assert first.headers["x-continuum-route"] == "placed"  # by its conversation's key
    for _ in range(2):  # later turns re-send the opening: the same key, the same replica
        reply = [block.model_dump(exclude_none=True) for block in first.parse().content]
        messages = [*messages, {"role": "assistant", "content": reply},
                    {"role": "user", "content": "go on"}]
        later = client.messages.with_raw_response.create(model="tiny", max_tokens=4,
                                                         system=system, messages=messages)
        assert later.headers["x-continuum-replica"] == replica
        assert later.headers["x-continuum-route"] == "affinity"
        assert later.parse().usage.cache_read_input_tokens > 0
    # Over INLINE_PARSE_BYTES: its route read in the ingress's parsing child.
    padded = json.dumps({"model": "tiny", "max_tokens": 2, "system": system,
                         "messages": messages})
    padded = padded[:-1] + " " * INLINE_PARSE_BYTES + "}"
    large = httpx.post(ray_server.base_url + "/v1/messages", content=padded, timeout=60,
                       headers={"Content-Type": "application/json", "x-api-key": "x"})
    assert large.status_code == 200, large.text
    assert large.json()["type"] == "message"
    assert large.headers["x-continuum-replica"] == replica
    assert large.headers["x-continuum-route"] == "affinity"
    counted = client.messages.count_tokens(model="tiny", system=system, messages=messages)
    assert counted.input_tokens == large.json()["usage"]["input_tokens"] + sum(
        large.json()["usage"][field] for field in ("cache_read_input_tokens",
                                                    "cache_creation_input_tokens"))
    refused = httpx.post(ray_server.base_url + "/v1/messages", timeout=30,
                         json={"model": "tiny", "messages": messages})  # no max_tokens
    assert refused.status_code == 400
    assert refused.json()["type"] == "error"
    assert refused.json()["error"]["type"] == "invalid_request_error"


def test_bad_input_gets_the_single_servers_error(ray_server: RayServer) -> None:
    ray_server.deploy("affinity")
    response = httpx.post(ray_server.base_url + "/v1/chat/completions", timeout=30,
                          json={"model": "tiny", "messages": [], "max_tokens": -1})
    assert response.status_code == 400
    assert response.json()["error"]["type"] == "invalid_request_error"
    # Nested past the JSON parser's depth: a route of neither key nor follow-up, read here
    # (a small body) or in the ingress's parsing child (a larger one), then the replica's 400.
    for deep in (b"[" * 3000, b"[" * (INLINE_PARSE_BYTES + 1)):
        response = httpx.post(ray_server.base_url + "/v1/chat/completions", timeout=60,
                              content=deep, headers={"Content-Type": "application/json"})
        assert response.status_code == 400, response.text


def test_a_killed_replica_leaves_the_other_replicas_jobs_complete(
        ray_server: RayServer) -> None:
    """Kills a replica while a streamed turn and a long unstreamed completion are on it: the
    jobs that never ran there complete, the completion (no output yet) is retried on the other
    replica, and the streams cut off end with an error."""
    ray_server.deploy("affinity")
    jobs = [AgentJobSpec(job_id, tuple(TurnSpec(24, 6, "bash", 0.3) for _ in range(4)))
            for job_id in _job_ids_on_both_replicas(ray_server.replica_ids, 8)]
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
    retries = next(float(line.split()[1]) for line in text.splitlines()
                   if line.startswith("continuum:replica_retries_total "))
    assert retries >= 1  # the completion, and any turn without output yet


def test_round_robin_scatters_jobs_and_loses_their_cache(
        ray_server: RayServer, tmp_path: Path) -> None:
    affinity_run, _ = ray_server.bench_agent_run("affinity", tmp_path)
    run, printed = ray_server.bench_agent_run("round-robin", tmp_path)
    assert run["failures"] == 0
    on_one_replica = int(printed.split("jobs on one replica ")[1].split("/")[0])
    assert on_one_replica < 8  # each turn goes to the next replica, whatever its job
    assert run["cached_token_fraction"] < affinity_run["cached_token_fraction"]


LONG_OUTPUT_TOKENS = 600


def _job_ids_on_both_replicas(replica_ids: set[str], count: int) -> list[str]:
    """`count` job ids of the replay's API key whose rendezvous-hash replicas are half one
    replica, half the other: wherever the long completion is placed, some jobs never ran on
    its replica (ids drawn blindly all hash to one replica once in 128 runs)."""
    headers = {"authorization": "Bearer EMPTY"}
    by_replica: dict[str, list[str]] = {replica_id: [] for replica_id in replica_ids}
    for index in range(100 * count):
        job_id = f"kill-{index}"
        home = rendezvous_rank(job_key(job_id, headers), sorted(replica_ids))[0]
        if len(by_replica[home]) < count // 2:
            by_replica[home].append(job_id)
        if sum(map(len, by_replica.values())) == count:
            return [job_id for job_ids in by_replica.values() for job_id in job_ids]
    raise AssertionError(f"no {count} job ids split over {replica_ids}")


class LongCompletion(threading.Thread):
    """An unstreamed completion of `LONG_OUTPUT_TOKENS` tokens, a turn of job `job_id`."""

    def __init__(self, base_url: str, job_id: str) -> None:
        super().__init__()
        self.base_url = base_url
        self.job_id = job_id
        self.response: httpx.Response | None = None

    def run(self) -> None:
        # The replay's API key: routing keys are per API key.
        self.response = httpx.post(self.base_url + "/v1/completions", timeout=240,
                                   headers={"Authorization": "Bearer EMPTY"}, json={
            "model": "tiny", "prompt": [9] * 24, "max_tokens": LONG_OUTPUT_TOKENS,
            "ignore_eos": True, "job_id": self.job_id})


def _kill_a_replica_after_some_turns(
        replay: AgentReplay, base_url: str) -> tuple[str, list[set[str]], LongCompletion]:
    """Once every job has had a turn answered, sends a long completion as a job of its own,
    asks the ingress which replica holds that job, and kills that replica (Ray Serve restarts
    it under a new id) while the completion runs there; returns the replica's id, by job the
    replicas that had answered its turns by then, and the completion."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        started = list(replay.started)
        if len(started) == len(replay.jobs) and all(r.replica_ids for r in started):
            touched = {record.job_id: set(record.replica_ids) for record in started}
            # A job no replayed turn shares: a replayed turn moved under load would take the
            # job's affinity, and the completion with it, to the other replica.
            long_request = LongCompletion(base_url, "kill-long")
            long_request.start()
            time.sleep(0.5)
            victim = _replica_of_job(base_url, long_request.job_id)
            actor = ray.get_actor(f"SERVE_REPLICA::{APP}#EngineReplica#{victim}",
                                  namespace="serve")
            ray.kill(actor, no_restart=False)
            return victim, [touched[job.job_id] for job in replay.jobs], long_request
        time.sleep(0.02)
    raise AssertionError("the replay did not get going")


def _replica_of_job(base_url: str, job_id: str) -> str:
    """The replica the ingress routes job `job_id` to (a job lookup, as the replay's key)."""
    response = httpx.get(f"{base_url}/v1/jobs/{job_id}", timeout=30,
                         headers={"Authorization": "Bearer EMPTY"})
    assert response.status_code == 200 and response.headers["x-continuum-route"] == "lookup"
    return response.headers["x-continuum-replica"]


def test_the_ingress_checks_the_api_key_before_it_reads_a_body(ray_server: RayServer) -> None:
    """A client without a key that announces a body and sends none gets 401 at once: the
    ingress does not wait for (and hold) a body it would refuse."""
    ray_server.deploy("round-robin")
    with socket.create_connection(("127.0.0.1", ray_server.port), timeout=30) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                     b"Content-Type: application/json\r\nContent-Length: 1000000\r\n\r\n")
        assert sock.recv(4096).startswith(b"HTTP/1.1 401")
    url = ray_server.base_url
    assert httpx.get(url + "/metrics", timeout=30).status_code == 401
    assert httpx.get(url + "/health", timeout=30).status_code == 200
    answer = httpx.post(url + "/v1/completions", timeout=60,
                        headers={"Authorization": "Bearer secret"},
                        json={"model": "tiny", "prompt": "hi", "max_tokens": 2})
    assert answer.status_code == 200, answer.text


def test_the_ingress_refuses_bodies_past_its_budget_unread(ray_server: RayServer) -> None:
    """Held bodies fill the ingress's budget of body bytes (two of 64 KiB, one byte short
    each): the next request gets 503 (one tenant: its clients share the whole budget), one
    sent again at once gets it Retry-After late, and once the holders go away requests are
    served again."""
    ray_server.deploy("round-robin")
    url, key = ray_server.base_url, {"Authorization": "Bearer secret"}
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 2}
    held = []
    try:
        for _ in range(2):
            sock = socket.create_connection(("127.0.0.1", ray_server.port), timeout=30)
            held.append(sock)
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                         b"Authorization: Bearer secret\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 65536\r\n\r\n" + b" " * 65535)
        # Until the ingress holds both, a probe may be admitted and then give its room to
        # an older body: a refusal while it is read, which is not paced.
        deadline_s = time.monotonic() + 60
        while _ingress_sample(url, key, "continuum:ingress_request_body_bytes_held") < 131070:
            assert time.monotonic() < deadline_s
            time.sleep(0.05)
        refused = _first_answer(url, key, body, lambda status: status == 503)
        assert refused.json()["error"]["code"] == "server_busy"
        assert refused.headers["retry-after"] == "3"
        started_s = time.monotonic()
        again = httpx.post(url + "/v1/completions", timeout=60, headers=key, json=body)
        assert again.status_code == 503 and time.monotonic() - started_s >= 3.0
        assert _ingress_sample(url, key, 'continuum:ingress_request_bodies_refused_total'
                               '{status="503"}') >= 2
        assert _ingress_sample(url, key,
                               "continuum:ingress_request_body_refusals_paced_total") >= 1
    finally:
        for sock in held:
            sock.close()
    _first_answer(url, key, body, lambda status: status == 200)


def _ingress_sample(url: str, headers: dict[str, str], name: str) -> float:
    """The value of the sample `name` (with its labels, if any) in the ingress's /metrics."""
    text = httpx.get(url + "/metrics", timeout=60, headers=headers).text
    value, = (float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.rsplit(" ", 1)[0] == name)
    return value


def _first_answer(url: str, headers: dict[str, str], body: dict[str, Any],
                  wanted: Callable[[int], bool]) -> httpx.Response:
    """The first answer to `body` with a status `wanted`, asked again until one comes."""
    deadline_s = time.monotonic() + 60
    while True:
        answer = httpx.post(url + "/v1/completions", timeout=60, headers=headers, json=body)
        if wanted(answer.status_code):
            return answer
        assert time.monotonic() < deadline_s, answer.text
        time.sleep(0.1)


def test_stopping_the_application_drains_every_replica_first(ray_server: RayServer) -> None:
    """What `continuum serve --replicas` does on SIGTERM (`stop_application`) drains the
    replicas as a single server drains: a new generation gets 503 `server_shutting_down`, a
    stream still running at the drain's end gets that error event and `[DONE]` instead of
    being cut off. Last: it deletes the application."""
    ray_server.deploy("round-robin")
    url, key = ray_server.base_url, {"Authorization": "Bearer secret"}
    with httpx.stream("POST", url + "/v1/completions", timeout=60, headers=key, json={
            "model": "tiny", "prompt": "hi", "max_tokens": 900, "ignore_eos": True,
            "stream": True}) as stream:
        lines = stream.iter_lines()
        assert next(line for line in lines if line).startswith("data: {")
        drained = serve.get_app_handle(APP).drain.remote().result(timeout_s=60)
        assert len(set(drained)) == 2
        refused = httpx.post(url + "/v1/completions", timeout=60, headers=key,
                             json={"model": "tiny", "prompt": "hi", "max_tokens": 2})
        rest = [line for line in lines if line]
    assert refused.status_code == 503
    assert refused.json()["error"]["code"] == "server_shutting_down"
    assert rest[-1] == "data: [DONE]"
    assert json.loads(rest[-2].removeprefix("data: "))["error"]["code"] == \
        "server_shutting_down"
    stop_application(APP, 0.0)
    ray_server.deployed = None
    assert APP not in serve.status().applications
