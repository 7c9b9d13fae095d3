"""The server's limits: each answers a clear OpenAI error naming the limit, changes nothing,
and the engine keeps serving (the pool ends all-free)."""

from __future__ import annotations

import dataclasses
import threading
import time

import httpx
import openai
import pytest

from engine.entrypoints.openai.serving import ServerSettings
from tests.engine.entrypoints.openai.conftest import ServerThread, start_server

LIMITS = ServerSettings(
    served_model_name="tiny", max_request_body_bytes=64 * 1024, max_prompt_tokens=64,
    max_output_tokens=12, max_n=2, max_stop_strings=2, max_waiting_requests=2,
    retry_after_s=3,
)


@pytest.fixture(scope="module")
def limited() -> ServerThread:
    """At most one request runs at once, so that others wait."""
    running = start_server(settings=LIMITS, max_num_seqs=1)
    yield running
    running.stop()


def _assert_limit_error(response: httpx.Response, param: str, status: int = 400) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param
    assert error["code"] == "limit_exceeded"
    assert "limit" in error["message"]


def _assert_still_serving(server: ServerThread) -> None:
    completion = server.client().completions.create(
        model="tiny", prompt="ok", max_tokens=3, extra_body={"ignore_eos": True})
    assert completion.usage.completion_tokens == 3
    stats = server.wait_idle()
    assert stats.num_free_blocks == stats.num_kv_blocks


OVER_LIMIT = [
    ("/v1/completions", {"prompt": "x" * 65, "max_tokens": 2}, "prompt"),
    ("/v1/completions", {"prompt": [5] * 65, "max_tokens": 2}, "prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "y" * 80}]}, "prompt"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 13}, "max_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "max_completion_tokens": 13}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "n": 3}, "n"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 3}, "n"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "stop": ["a", "b", "c"]}, "stop"),
]


@pytest.mark.parametrize(("path", "body", "param"), OVER_LIMIT)
def test_each_limit_answers_400_and_the_engine_keeps_serving(limited, path, body, param):
    with limited.http() as http:
        _assert_limit_error(http.post(path, json={"model": "tiny", **body}), param)
    _assert_still_serving(limited)


def test_requests_at_the_limits_are_served(limited):
    client = limited.client()
    completion = client.completions.create(
        model="tiny", prompt=[5] * 64, max_tokens=12, n=2, stop=["a", "b"],
        extra_body={"ignore_eos": True})
    assert [choice.index for choice in completion.choices] == [0, 1]
    assert completion.usage.completion_tokens <= 24


def test_max_output_tokens_caps_a_request_that_names_none(limited):
    chat = limited.client().chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}],
        extra_body={"ignore_eos": True})
    assert chat.usage.completion_tokens == 12
    assert chat.choices[0].finish_reason == "length"


def test_oversized_body_answers_413(limited):
    with limited.http() as http:
        response = http.post("/v1/completions", json={"model": "tiny", "prompt": "z" * 70_000})
    assert response.status_code == 413
    assert response.json()["error"]["code"] == "request_too_large"
    _assert_still_serving(limited)


def test_a_full_waiting_queue_answers_429_with_retry_after():
    """One request runs (max_num_seqs=1) and two wait: the next ones are turned away, and
    served once the queue drains. Simulated 70B steps keep the first request running."""
    server = start_server(settings=dataclasses.replace(LIMITS, max_output_tokens=None),
                          max_num_seqs=1, executor="simulated",
                          sim_profile="4xh100-llama3.1-70b")
    streams = [_Stream(server) for _ in range(3)]
    try:
        _wait_for(lambda: server.stats().num_waiting == 2)
        with server.http() as http:
            response = http.post("/v1/completions",
                                 json={"model": "tiny", "prompt": "hi", "max_tokens": 2})
        assert response.status_code == 429, response.text
        assert response.headers["Retry-After"] == "3"
        error = response.json()["error"]
        assert (error["type"], error["code"]) == ("rate_limit_error", "queue_full")
        with pytest.raises(openai.RateLimitError):
            server.client().chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        stats = server.stats()
        assert (stats.num_running, stats.num_waiting) == (1, 2)  # the refused never arrived
        for stream in streams:
            stream.close()
        _wait_for(lambda: server.engine.num_waiting_requests == 0)
        _assert_still_serving(server)
    finally:
        for stream in streams:
            stream.close()
        server.stop()


class _Stream:
    """A streamed completion of 1000 tokens, read in a thread until closed."""

    def __init__(self, server: ServerThread) -> None:
        self._client = httpx.Client(base_url=server.base_url, timeout=60)
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        body = {"model": "tiny", "prompt": "long", "max_tokens": 1000, "stream": True}
        with self._client.stream("POST", "/v1/completions", json=body) as response:
            for _ in response.iter_lines():
                if self._closed.is_set():
                    return

    def close(self) -> None:
        self._closed.set()
        self._thread.join(30)
        self._client.close()


def _wait_for(condition, timeout_s: float = 30.0) -> None:
    deadline_s = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline_s, "timed out"
        time.sleep(0.05)


def test_min_tokens_beyond_the_default_output_limit_is_a_400(limited):
    with limited.http() as http:
        response = http.post("/v1/chat/completions", json={
            "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "min_tokens": 13})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "min_tokens"
    _assert_still_serving(limited)


@pytest.mark.parametrize("field", ["max_prompt_tokens", "max_output_tokens", "max_n",
                                   "max_stop_strings", "max_waiting_requests", "retry_after_s"])
def test_limits_must_be_positive(field):
    with pytest.raises(ValueError, match=field):
        dataclasses.replace(LIMITS, **{field: 0})
