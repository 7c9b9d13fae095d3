"""The engine core in its own process, through the sync and asyncio ZMQ clients."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import msgspec
import pytest
import zmq

from engine.config import EngineConfig, ModelConfig
from engine.core import engine_core as engine_core_module
from engine.core.client import AsyncMPClient, EngineDeadError, InprocClient, SyncMPClient
from engine.core.core_proc import EngineCoreProc
from engine.core.engine_core import EngineCore
from engine.core.wire import CoreEvent, EngineCoreRequest, Shutdown, UtilityCall
from engine.request import FinishReason, JobInfo
from engine.sampling_params import SamplingParams
from engine.structured_output import grammars
from engine.structured_output.output_manager import StructuredOutputManager
from engine.structured_output.spec import StructuredOutputSpec
from tests.engine.core.conftest import SMALL_CONFIG, core_request


def collect(client: SyncMPClient, request_ids: set[str]) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {request_id: [] for request_id in request_ids}
    unfinished = set(request_ids)
    while unfinished:
        for output in client.get_output(timeout_s=30):
            if output.request_id not in tokens:
                continue  # a late output of an earlier test's aborted request
            tokens[output.request_id].extend(output.new_token_ids)
            if output.finish_reason is not None:
                unfinished.discard(output.request_id)
    return tokens


@pytest.fixture(scope="module")
def client():
    client = SyncMPClient(SMALL_CONFIG)
    yield client
    client.shutdown()
    assert client.process.exitcode == 0  # a clean shutdown, not a kill


def test_outputs_match_the_in_process_core(client: SyncMPClient) -> None:
    requests = [core_request(f"r{i}", [i + 1] * (3 + 5 * i), max_tokens=6 + i) for i in range(4)]
    for request in requests:
        client.add_request(request)
    remote = collect(client, {r.request_id for r in requests})
    local_client = InprocClient(SMALL_CONFIG)
    for request in requests:
        local_client.add_request(request)
    local: dict[str, list[int]] = {r.request_id: [] for r in requests}
    while local_client.core.has_unfinished_requests():
        for output in local_client.get_output():
            local[output.request_id].extend(output.new_token_ids)
    assert remote == local


def test_the_frontend_has_the_core_prepare_its_grammars(client: SyncMPClient) -> None:
    assert client.call_utility("prepare_grammars", 258) is True


def test_utilities_answer_and_report_errors(client: SyncMPClient) -> None:
    stats = client.call_utility("stats")
    assert stats["num_kv_blocks"] == client.num_kv_blocks == 128
    assert client.call_utility("reset_prefix_cache") is True
    with pytest.raises(ValueError, match="job_id"):
        client.call_utility("release_job", "")
    with pytest.raises(ValueError, match="unknown utility"):
        client.call_utility("shutdown")


def test_abort_mid_generation_frees_every_block(client: SyncMPClient) -> None:
    client.add_request(core_request("long", list(range(1, 120)), max_tokens=120))
    assert client.get_output(timeout_s=30)
    client.abort_requests(["long"])
    deadline_s = time.monotonic() + 10
    while (stats := client.call_utility("stats"))["num_running"] and time.monotonic() < deadline_s:
        time.sleep(0.01)
    assert stats["num_running"] == stats["num_waiting"] == 0
    assert stats["num_free_blocks"] == stats["num_kv_blocks"]
    assert client.call_utility("check_invariants") is True


def send_raw(client: SyncMPClient, payload: bytes) -> None:
    client._proc.input_socket.send_multipart([client._proc.identity, payload])


def test_malformed_messages_never_kill_the_core(client: SyncMPClient) -> None:
    encode = msgspec.msgpack.encode
    send_raw(client, b"\xc1 not msgpack")
    send_raw(client, encode({"type": "no-such-type"}))
    send_raw(client, encode([1, 2, 3]))
    send_raw(client, encode({"type": "add", "request_id": "broken", "prompt_token_ids": "x"}))
    send_raw(client, encode({"type": "utility", "call_id": 10_000, "method": 5}))
    client.add_request(core_request("bad-ids", [1, 99999]))
    rejected = {}
    while len(rejected) < 2:
        for output in client.get_output(timeout_s=30):
            if output.request_id in ("broken", "bad-ids"):
                rejected[output.request_id] = output
    assert all(o.finish_reason is FinishReason.ABORT and o.error for o in rejected.values())
    assert "prompt token ids" in rejected["bad-ids"].error
    assert "malformed" in utility_error(client, 10_000)
    client._send(UtilityCall(call_id=10_001, method="release_job", args=[1, 2, 3]))
    assert "TypeError" in utility_error(client, 10_001)
    client.add_request(core_request("after", max_tokens=4))
    assert len(collect(client, {"after"})["after"]) == 4


def utility_error(client: SyncMPClient, call_id: int) -> str | None:
    while call_id not in client._utility_results:
        client._receive(None)
    return client._utility_results.pop(call_id).error


def test_an_idle_core_expires_pins_and_forgets_idle_jobs_with_no_request_and_no_step() -> None:
    # continuum-fixed pins a turn that called an unknown tool for 2 s; the job's books go
    # 1 s after that, from the idle loop's sweeps: no request arrives and no step runs.
    scheduler = dataclasses.replace(SMALL_CONFIG.scheduler, policy="continuum-fixed",
                                    policy_options={"job_idle_timeout_s": "1"})
    client = SyncMPClient(dataclasses.replace(SMALL_CONFIG, scheduler=scheduler))
    try:
        request = core_request("turn", list(range(1, 41)), max_tokens=4)
        client.add_request(msgspec.structs.replace(request, job=JobInfo(job_id="job",
                                                                        tool_name="ls")))
        assert len(collect(client, {"turn"})["turn"]) == 4
        finished_s = time.monotonic()
        state = client.call_utility("job_state", "job")
        assert state is not None and state["pin"]["ttl_s"] == 2.0
        num_steps = client.call_utility("stats")["num_steps"]
        while (state := client.call_utility("job_state", "job")) is not None:
            assert time.monotonic() - finished_s < 8, f"the job is still held: {state}"
            time.sleep(0.05)
        stats = client.call_utility("stats")
        assert (stats["num_jobs"], stats["num_pins"]) == (0, 0)
        assert stats["pins_released"] == {"expired": 1}
        assert stats["num_free_blocks"] == stats["num_kv_blocks"]
        assert stats["num_steps"] == num_steps  # swept without a single (empty) step
        assert client.call_utility("check_invariants") is True
    finally:
        client.shutdown()


def test_a_core_that_fails_to_start_reports_why() -> None:
    bad = EngineConfig(model=ModelConfig(model="/nonexistent/model"))
    started_s = time.monotonic()
    with pytest.raises(RuntimeError, match="is not 'tiny', a catalogued model"):
        SyncMPClient(bad)
    assert time.monotonic() - started_s < 60


def test_killing_the_sync_clients_core_fails_calls_promptly() -> None:
    client = SyncMPClient(SMALL_CONFIG)
    try:
        client.add_request(core_request("a", max_tokens=200))
        os.kill(client.process.pid, signal.SIGKILL)
        started_s = time.monotonic()
        with pytest.raises(EngineDeadError, match="died"):
            while True:
                client.get_output()
        assert time.monotonic() - started_s < 5
        with pytest.raises(EngineDeadError):
            client.add_request(core_request("b"))
    finally:
        client.shutdown()


def test_async_client_streams_outputs_and_utilities() -> None:
    async def scenario() -> None:
        client = AsyncMPClient(SMALL_CONFIG)
        try:
            await client.add_request_async(core_request("a", max_tokens=3))
            tokens = []
            while len(tokens) < 3:
                tokens += [t for o in await client.get_output_async() for t in o.new_token_ids]
            stats = await client.call_utility_async("stats")
            assert stats["num_free_blocks"] == stats["num_kv_blocks"]
            os.kill(client.process.pid, signal.SIGKILL)
            with pytest.raises(EngineDeadError):
                await asyncio.wait_for(client.get_output_async(), timeout=5)
            with pytest.raises(EngineDeadError):
                await client.call_utility_async("stats")
        finally:
            client.shutdown()

    asyncio.run(scenario())


def test_the_core_exits_when_its_frontend_process_is_killed(tmp_path) -> None:
    script = (
        "import sys, time\n"
        "from engine.core.client import SyncMPClient\n"
        "from tests.engine.core.conftest import SMALL_CONFIG\n"
        "if __name__ == '__main__':\n"
        "    client = SyncMPClient(SMALL_CONFIG)\n"
        "    print(client.process.pid, flush=True)\n"
        "    time.sleep(60)\n"
    )
    path = tmp_path / "frontend.py"
    path.write_text(script)
    root = Path(__file__).resolve().parents[3]
    frontend = subprocess.Popen([sys.executable, str(path)], cwd=root, stdout=subprocess.PIPE,
                                text=True, env={**os.environ, "PYTHONPATH": str(root)})
    try:
        core_pid = int(frontend.stdout.readline())
        frontend.kill()
        frontend.wait()
        deadline_s = time.monotonic() + 10
        while _process_exists(core_pid) and time.monotonic() < deadline_s:
            time.sleep(0.05)
        assert not _process_exists(core_pid)
    finally:
        frontend.kill()


def _process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    status = Path(f"/proc/{pid}/stat")
    return not (status.exists() and status.read_text().split()[2] == "Z")  # zombies are gone


def test_a_request_is_taken_in_while_the_core_waits_for_another_requests_compile(
        monkeypatch) -> None:
    """The busy loop, on a thread here: while the only work is a grammar compile (held), a
    step waits for it up to `GRAMMAR_WAIT_S` (made a minute); the input thread wakes that
    wait when a message arrives, so a plain request is served at once."""
    gate = threading.Event()
    real_compile = StructuredOutputManager._compile

    def held_compile(self, *args):
        gate.wait(60.0)
        return real_compile(self, *args)

    monkeypatch.setattr(StructuredOutputManager, "_compile", held_compile)
    monkeypatch.setattr(engine_core_module, "GRAMMAR_WAIT_S", 60.0)
    context = zmq.Context()
    sockets = {name: context.socket(zmq.PAIR) for name in
               ("core_in", "client_in", "core_out", "client_out")}
    sockets["core_in"].bind("inproc://input")
    sockets["client_in"].connect("inproc://input")
    sockets["core_out"].bind("inproc://output")
    sockets["client_out"].connect("inproc://output")
    proc = EngineCoreProc(EngineCore(SMALL_CONFIG), sockets["core_in"], sockets["core_out"],
                          os.getppid())
    loop = threading.Thread(target=proc.run)
    loop.start()
    encoder, decoder = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(CoreEvent)
    try:
        spec = StructuredOutputSpec(kind="choice", grammar=grammars.choice_grammar(["yes"]))
        sockets["client_in"].send(encoder.encode(EngineCoreRequest(
            request_id="constrained", prompt_token_ids=[1, 2, 3], eos_token_id=258,
            sampling_params=SamplingParams(max_tokens=4, structured_output=spec))))
        time.sleep(0.3)  # the loop is in its wait for the compile now
        sockets["client_in"].send(encoder.encode(core_request("plain", max_tokens=2)))
        assert sockets["client_out"].poll(20_000), "the plain request waited for the compile"
        finished = set()
        while "plain" not in finished and sockets["client_out"].poll(20_000):
            event = decoder.decode(sockets["client_out"].recv())
            finished |= {output.request_id for output in getattr(event, "outputs", [])
                         if output.finish_reason is not None}
        assert "plain" in finished and "constrained" not in finished
    finally:
        gate.set()
        sockets["client_in"].send(encoder.encode(Shutdown()))
        loop.join(30.0)
        for socket in sockets.values():
            socket.close(linger=0)
        context.term()
    assert not loop.is_alive()
