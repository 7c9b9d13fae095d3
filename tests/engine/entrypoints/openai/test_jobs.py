"""The job extension reaches the scheduler, from the body (`extra_body`) and from headers.

The scripted server's policy pins every non-final job turn for `PIN_TTL_S` plus the length of
the turn's tool name, so a pin's TTL shows that `job_id` and `tool_name` arrived, and a last
step (which is never pinned and ends the job) shows that `is_last_step` arrived.
"""

from __future__ import annotations

import contextlib
import json
import math
import socket
import threading
import time
from collections.abc import Callable, Iterator

import openai
import pytest

from engine.entrypoints.openai.api_server import ServerSettings
from engine.entrypoints.openai.tenants import Tenants
from tests.continuum.priced import PRICED_CONTINUUM_PATH
from tests.engine.entrypoints.openai.conftest import (
    SCRIPTED,
    ServerThread,
    start_scripted_server,
    start_server,
)
from tests.engine.entrypoints.openai.scripted import PIN_TTL_S

MESSAGES = [{"role": "user", "content": "go"}]


@pytest.fixture(scope="module")
def scripted_server() -> Iterator[ServerThread]:
    """This module's own scripted server: its last test checks that releasing every job it
    made leaves the pool free, which the package's shared one, pinned by other files' jobs,
    cannot show."""
    running = start_scripted_server()
    yield running
    running.stop()


def _turn(server, **kwargs):
    return server.client().chat.completions.create(
        model="scripted", messages=MESSAGES, max_tokens=200, **kwargs)


def _job(server, job_id):
    with server.http(headers={"Authorization": "Bearer secret-key"}) as http:
        return http.get(f"/v1/jobs/{job_id}")


def _delete(server, job_id):
    with server.http(headers={"Authorization": "Bearer secret-key"}) as http:
        return http.delete(f"/v1/jobs/{job_id}")


@pytest.mark.parametrize("how", ["body", "body-alias", "headers"])
def test_job_fields_reach_the_scheduler(scripted_server, how):
    job_id = f"job-{how}"
    if how == "body":
        first = {"extra_body": {"job_id": job_id, "tool_name": "bash"}}
        last = {"extra_body": {"job_id": job_id, "is_last_step": True}}
    elif how == "body-alias":
        first = {"extra_body": {"job_id": job_id, "this_func_call": "bash"}}
        last = {"extra_body": {"job_id": job_id, "is_last_step": True}}
    else:
        first = {"extra_headers": {"X-Job-Id": job_id, "X-Tool-Name": "bash"}}
        last = {"extra_headers": {"X-Job-Id": job_id, "X-Job-Last-Step": "true"}}
    reused_before = scripted_server.metric("pins_released_total", 'reason="reused"')
    _turn(scripted_server, **first)
    state = _job(scripted_server, job_id).json()
    assert state["pin"]["ttl_s"] == PIN_TTL_S + len("bash")
    assert state["pin"]["num_blocks"] > 0
    assert state["num_unfinished_requests"] == 0

    _turn(scripted_server, **last)
    assert _job(scripted_server, job_id).status_code == 404  # the last step ended the job
    reused = scripted_server.metric("pins_released_total", 'reason="reused"')
    assert reused == reused_before + 1


def test_next_turn_hits_the_pinned_prefix(scripted_server):
    first = scripted_server.client().chat.completions.create(
        model="scripted", messages=MESSAGES, max_tokens=200,
        extra_body={"job_id": "job-hit", "return_token_ids": True})
    prompt = first.model_extra["prompt_token_ids"] + first.choices[0].model_extra["token_ids"]
    second = scripted_server.client().completions.create(
        model="scripted", prompt=[*prompt, 10, 11], max_tokens=3,
        extra_body={"job_id": "job-hit", "is_last_step": True})
    block_size = 16  # the hit covers the previous turn's full blocks
    assert second.usage.prompt_tokens_details.cached_tokens == \
        len(prompt) // block_size * block_size


def test_delete_releases_the_pin(scripted_server):
    released_before = scripted_server.metric("pins_released_total", 'reason="release"')
    _turn(scripted_server, extra_body={"job_id": "job-delete"})
    assert scripted_server.metric("num_pins") >= 1
    response = _delete(scripted_server, "job-delete")
    assert response.status_code == 200
    assert response.json() == {"id": "job-delete", "object": "job", "deleted": True,
                               "released_pin": True}
    assert scripted_server.metric("pins_released_total", 'reason="release"') == \
        released_before + 1
    missing = _delete(scripted_server, "job-delete")
    assert missing.status_code == 404
    assert missing.json()["error"]["code"] == "job_not_found"


def test_job_ids_with_slashes_can_be_released(scripted_server):
    _turn(scripted_server, extra_headers={"X-Job-Id": "team/run-1"})
    assert _job(scripted_server, "team/run-1").json()["pin"] is not None
    assert _delete(scripted_server, "team%2Frun-1").json()["released_pin"] is True


def test_conflicting_or_incomplete_job_fields_are_rejected(scripted_server):
    with pytest.raises(openai.BadRequestError, match="disagrees"):
        _turn(scripted_server, extra_body={"job_id": "a"}, extra_headers={"X-Job-Id": "b"})
    with pytest.raises(openai.BadRequestError, match="need a job_id"):
        _turn(scripted_server, extra_body={"is_last_step": True})
    with pytest.raises(openai.BadRequestError, match="x-job-last-step"):
        _turn(scripted_server, extra_headers={"X-Job-Id": "a", "X-Job-Last-Step": "maybe"})
    with pytest.raises(openai.BadRequestError, match="job_id"):
        _turn(scripted_server, extra_body={"job_id": 17})


def test_all_jobs_released_leaves_the_pool_free(scripted_server):
    _turn(scripted_server, extra_body={"job_id": "job-final"})
    assert _delete(scripted_server, "job-final").json()["released_pin"] is True
    stats = scripted_server.wait_idle()
    leftover = [job for job in ("job-body", "job-body-alias", "job-headers", "job-hit")
                if _job(scripted_server, job).status_code != 404]
    assert leftover == []
    assert stats.num_pins == 0
    assert stats.num_free_blocks == stats.num_kv_blocks


def test_the_default_policy_reads_the_tool_and_pins_for_the_eq2_ttl(tmp_path):
    """The default policy (continuum, Eq. 2) on a server whose turns call `bash` in Hermes
    format: the core parses the tool from the output, prices the rebuild from the given
    profile (4 s, so the cold-start TTL is ln 4), and saves what it learned at shutdown."""
    profile, state_path = tmp_path / "profile.json", tmp_path / "estimator.json"
    profile.write_text(json.dumps({"points": [[0, 4.0], [1000, 4.0]]}))
    server = start_server(executor=f"{SCRIPTED}:ScriptedExecutor",
                          scheduling_policy=PRICED_CONTINUUM_PATH,
                          policy_options={"prefill_profile": str(profile),
                                          "estimator_state": str(state_path)},
                          settings=ServerSettings(served_model_name="scripted"))
    try:
        first = server.client().completions.create(
            model="scripted", prompt="Fix the bug.", max_tokens=200,
            extra_body={"job_id": "agent-7", "return_token_ids": True})
        with server.http() as http:
            state = http.get("/v1/jobs/agent-7").json()
        assert state["policy"]["last_tool_name"] == "bash"
        assert state["pin"]["ttl_s"] == pytest.approx(math.log(4.0))
        assert state["policy"]["num_pins_created"] == 1
        assert server.metric("num_jobs") >= 1
        choice = first.choices[0].model_extra
        prompt = choice["prompt_token_ids"] + choice["token_ids"]
        second = server.client().completions.create(
            model="scripted", prompt=[*prompt, 10, 11], max_tokens=2,
            extra_body={"job_id": "agent-7", "is_last_step": True})
        assert second.usage.prompt_tokens_details.cached_tokens == len(prompt) // 16 * 16
        with server.http() as http:
            assert http.get("/v1/jobs/agent-7").status_code == 404
    finally:
        server.stop()
    saved = json.loads(state_path.read_text())
    assert len(saved["tools_s"]["bash"]) == 1 and saved["job_num_turns"] == [2]


def test_a_plain_request_is_served_within_the_bound_behind_a_flood_of_one_jobs_turns():
    """The issue's starvation case in reduced form: client loops keep sending non-final,
    tool-calling turns of one job (each pinned for 2 s) into a small pool; a plain request
    sent meanwhile heads the queue once it has waited `max_plain_wait_s` and is served."""
    server = start_server(num_kv_blocks=40, max_model_len=640,
                          policy_options={"estimator": "fixed-2s", "max_plain_wait_s": "1.0"})
    stop = threading.Event()

    def flood(loop: int) -> None:
        client = server.client()
        serial = 0
        while not stop.is_set():
            prompt = [5 + (loop * 97 + serial + k) % 240 for k in range(300)]
            client.completions.create(model="tiny", prompt=prompt, max_tokens=1,
                                      extra_body={"job_id": "flood", "tool_name": "bash"})
            serial += 1

    loops = [threading.Thread(target=flood, args=(loop,)) for loop in range(6)]
    try:
        for thread in loops:
            thread.start()
        time.sleep(1.0)
        started_s = time.monotonic()
        reply = server.client().completions.create(
            model="tiny", prompt=[7 + k % 200 for k in range(300)], max_tokens=2,
            extra_body={"ignore_eos": True})  # sampled: EOS could end it first
        waited_s = time.monotonic() - started_s
        assert reply.choices[0].finish_reason == "length"
        assert waited_s < 1.0 + 5.0, waited_s  # the bound, plus slack for a busy machine
        assert server.metric("pins_created_total") > 0  # the flood's turns were pinned
    finally:
        stop.set()
        for thread in loops:
            thread.join(timeout=60)
        server.stop()


def test_every_api_names_its_job_in_a_header_and_jobs_finds_an_inferred_one() -> None:
    """Each generation's `x-continuum-job-id` names its job (the client's, or the one the
    engine inferred, as the tenant names it), streamed or not, on the four APIs; under
    `--api-key` and tenants, `GET /v1/jobs/{that id}` finds an inferred job."""
    server = start_server(settings=ServerSettings(
        served_model_name="tiny", tenants=Tenants.from_pairs([("key-a", "a")])),
        api_key="key-a")
    bodies = {
        "/v1/completions": {"prompt": "hello there, a long enough prompt"},
        "/v1/chat/completions": {"messages": [{"role": "user", "content": "hello there"}]},
        "/v1/responses": {"input": "hello there", "max_output_tokens": 4},
        "/v1/messages": {"messages": [{"role": "user", "content": "hello there"}]},
    }
    try:
        with server.http(headers={"Authorization": "Bearer key-a"}) as http:
            for path, body in bodies.items():
                for stream in (False, True):
                    named = http.post(path, headers={"x-job-id": "mine"}, json={
                        "model": "tiny", "max_tokens": 4, "stream": stream, **body})
                    assert named.status_code == 200, (path, named.text)
                    assert named.headers["x-continuum-job-id"] == "mine", (path, stream)
                    inferred = http.post(path, json={
                        "model": "tiny", "max_tokens": 4, "stream": stream, **body})
                    job_id = inferred.headers["x-continuum-job-id"]
                    assert job_id.startswith("~inferred/"), (path, stream, job_id)
            assert http.get(f"/v1/jobs/{job_id}").status_code == 200
            # A header carries printable ASCII only: the rest is percent-encoded.
            for job, named_as in (("café\nlist", "caf%C3%A9%0Alist"),
                                  ("\U000ee821 x", "%F3%AE%A0%A1%20x"), ("50%", "50%25")):
                body = {"model": "tiny", "max_tokens": 2, "job_id": job,
                        **bodies["/v1/completions"]}
                answer = http.post("/v1/completions", content=json.dumps(body),
                                   headers={"Content-Type": "application/json"})
                assert answer.status_code == 200, answer.text
                assert answer.headers["x-continuum-job-id"] == named_as
    finally:
        server.stop()


def test_metrics_count_jobs_created_inferred_ended_and_pins_by_source() -> None:
    server = start_server()
    try:
        with server.http() as http:
            for body in ({"job_id": "j", "is_last_step": True}, {}):
                assert http.post("/v1/completions", json={
                    "model": "tiny", "prompt": "count these jobs please", "max_tokens": 2,
                    **body}).status_code == 200
            server.wait_idle()
            text = http.get("/metrics").text
        assert 'continuum:jobs_created_total{model_name="tiny"} 2.0' in text
        assert 'continuum:jobs_inferred_total{model_name="tiny"} 1.0' in text
        assert 'continuum:jobs_ended_total{model_name="tiny",reason="job_end"} 1.0' in text
        assert "continuum:pins_created_by_source_total" in text
    finally:
        server.stop()


def test_a_stream_without_a_job_starts_at_its_first_token() -> None:
    """With no job to name (inference off, none sent), the stream still starts at its first
    token, not once the request has finished: its first chunk arrives while it runs
    (simulated 70B steps keep it running)."""
    server = start_server(job_inference=False, executor="simulated",
                          sim_profile="4xh100-llama3.1-70b")
    try:
        with server.http() as http, http.stream("POST", "/v1/completions", json={
                "model": "tiny", "prompt": "hello", "max_tokens": 900, "ignore_eos": True,
                "stream": True}) as response:
            assert response.status_code == 200
            assert "x-continuum-job-id" not in response.headers
            lines = response.iter_lines()  # kept: a dropped iterator closes the response
            first_chunk = next(line for line in lines if line.startswith("data: {"))
            assert len(json.loads(first_chunk[6:])["choices"]) == 1
            assert server.stats().num_running == 1
    finally:
        server.stop()


def test_a_stream_whose_client_leaves_before_its_first_token_is_aborted() -> None:
    """A streamed request waiting for the one seat (max_num_seqs=1, simulated 70B steps keep
    the first running) is aborted when its client closes the connection, though its stream
    has sent nothing yet: no engine request outlives its client."""
    server = start_server(max_num_seqs=1, executor="simulated",
                          sim_profile="4xh100-llama3.1-70b")
    port = int(server.base_url.rsplit(":", 1)[1])

    def streamed(max_tokens: int) -> bytes:
        body = json.dumps({"model": "tiny", "prompt": "long", "max_tokens": max_tokens,
                           "ignore_eos": True, "stream": True})
        return (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: "
                f"application/json\r\nContent-Length: {len(body)}\r\n\r\n{body}").encode()

    running = socket.create_connection(("127.0.0.1", port))
    # Read as a client does: a stream nobody reads is ended by the server after a while.
    reader = threading.Thread(target=_read_until_closed, args=(running,), daemon=True)
    try:
        running.sendall(streamed(1000))  # about 20 s of steps
        reader.start()
        _wait_until(lambda: server.stats().num_running == 1)
        with socket.create_connection(("127.0.0.1", port)) as waiting:
            waiting.sendall(streamed(8))
            _wait_until(lambda: server.stats().num_waiting == 1)
        _wait_until(lambda: server.stats().num_waiting == 0)
        assert server.stats().num_running == 1
    finally:
        running.close()
        server.stop()


def _read_until_closed(connection: socket.socket) -> None:
    with contextlib.suppress(OSError):
        while connection.recv(65536):
            pass


def _wait_until(condition: Callable[[], bool], timeout_s: float = 30.0) -> None:
    deadline_s = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline_s, "timed out"
        time.sleep(0.05)
