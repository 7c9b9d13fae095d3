"""Each tenant's cap on engine requests in flight (`max_waiting_requests_per_tenant` beyond
its share of the batch), over HTTP against a real server with two tenants."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

import httpx
import pytest

from engine.entrypoints.openai.serving import ServerSettings
from engine.entrypoints.openai.tenants import Tenants
from tests.engine.entrypoints.openai.conftest import ServerThread, start_server

KEYS = {"attacker": "key-attacker", "victim": "key-victim"}
# Two tenants and max_num_seqs 2: each one's share is 1, its cap 1 + 2 = 3.
SETTINGS = ServerSettings(
    served_model_name="tiny", max_waiting_requests_per_tenant=2, retry_after_s=2,
    tenants=Tenants.from_pairs([(key, name) for name, key in KEYS.items()]))


@pytest.fixture(scope="module")
def capped() -> Iterator[ServerThread]:
    """Simulated 70B steps keep a long completion running for the test's length."""
    running = start_server(settings=SETTINGS, api_key=KEYS["victim"], max_num_seqs=2,
                           executor="simulated", sim_profile="4xh100-llama3.1-70b")
    yield running
    running.stop()


def _http(server: ServerThread, tenant: str) -> httpx.Client:
    return server.http(headers={"Authorization": f"Bearer {KEYS[tenant]}"})


class _HeldCompletion:
    """A streamed completion of `n` choices of 1,000 tokens, read in a thread until closed."""

    def __init__(self, server: ServerThread, tenant: str, n: int) -> None:
        self._http = _http(server, tenant)
        self._body = {"model": "tiny", "prompt": "long", "max_tokens": 1000, "n": n,
                      "stream": True, "ignore_eos": True}
        self.first_chunk = threading.Event()
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        with self._http.stream("POST", "/v1/completions", json=self._body) as response:
            assert response.status_code == 200
            for _ in response.iter_lines():
                self.first_chunk.set()
                if self._closed.is_set():
                    return

    def close(self) -> None:
        self._closed.set()
        self._thread.join(30)
        self._http.close()


def _wait_for(condition: Callable[[], bool], timeout_s: float = 30.0) -> None:
    deadline_s = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline_s, "timed out"
        time.sleep(0.05)


def test_a_tenant_past_its_cap_gets_429_and_the_other_tenant_is_served(capped):
    held = _HeldCompletion(capped, "attacker", n=3)
    try:
        assert held.first_chunk.wait(30)
        with _http(capped, "attacker") as attacker:
            answered_s = []
            for path, body in (("/v1/completions", {"prompt": "more", "max_tokens": 2}),
                               ("/v1/responses", {"input": "more", "max_output_tokens": 2}),
                               ("/v1/chat/completions", {"max_tokens": 2, "messages": [
                                   {"role": "user", "content": "more"}]})):
                sent_s = time.monotonic()
                refused = attacker.post(path, json={"model": "tiny", **body})
                answered_s.append(time.monotonic() - sent_s)
                assert refused.status_code == 429, refused.text
                assert refused.headers["Retry-After"] == "2"
                error = refused.json()["error"]
                assert error["code"] == "rate_limit_exceeded"
                assert "max_waiting_requests_per_tenant" in error["message"]
                assert "3 engine requests in flight" in error["message"]
            sent_s = time.monotonic()
            message = attacker.post("/v1/messages", json={
                "model": "tiny", "max_tokens": 2, "messages": [
                    {"role": "user", "content": "more"}]})
            answered_s.append(time.monotonic() - sent_s)
            assert message.status_code == 429, message.text
            assert message.json()["error"]["type"] == "rate_limit_error"
            assert "max_waiting_requests_per_tenant" in message.json()["error"]["message"]
            # A refusal repeated within Retry-After is answered that much later.
            assert min(answered_s[1:]) >= 1.5
            # One that could never fit is told so, rather than to retry.
            whole = attacker.post("/v1/completions", json={
                "model": "tiny", "prompt": ["a", "b"], "n": 2, "max_tokens": 2})
            assert whole.status_code == 400, whole.text
            assert (whole.json()["error"]["param"], whole.json()["error"]["code"]) == (
                "n", "limit_exceeded")
        with _http(capped, "victim") as victim:
            served = victim.post("/v1/completions", json={
                "model": "tiny", "prompt": "mine", "max_tokens": 2, "n": 3,
                "ignore_eos": True})
            assert served.status_code == 200, served.text
            assert len(served.json()["choices"]) == 3
    finally:
        held.close()
    # Once its response has ended, the attacker's requests no longer count.
    with _http(capped, "attacker") as attacker:
        _wait_for(lambda: capped.stats().num_running == 0)
        again = attacker.post("/v1/completions", json={
            "model": "tiny", "prompt": "again", "max_tokens": 2, "n": 3, "ignore_eos": True})
        assert again.status_code == 200, again.text
    capped.wait_idle()


def test_the_default_cap_admits_the_largest_request_a_tenant_may_send():
    settings = ServerSettings(served_model_name="tiny", max_prompts=4, max_n=3)
    assert settings.tenant_request_cap(max_num_seqs=256) == (256, 12)
    two = ServerSettings(served_model_name="tiny",
                         tenants=Tenants.from_pairs([("a", "a"), ("b", "b"), ("c", "c")]))
    assert two.tenant_request_cap(max_num_seqs=256) == (86, 64 * 16)
    with pytest.raises(ValueError, match="max_waiting_requests_per_tenant"):
        ServerSettings(served_model_name="tiny", max_waiting_requests_per_tenant=0)
