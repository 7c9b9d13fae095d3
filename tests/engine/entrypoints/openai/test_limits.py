"""The server's limits: each answers a clear OpenAI error naming the limit, changes nothing,
and the engine keeps serving (the pool ends all-free)."""

from __future__ import annotations

import dataclasses
import threading
import time

import httpx
import openai
import pytest

from engine.entrypoints.openai.body_limits import (
    MAX_CONVERSATION_ITEMS,
    MAX_CONVERSATION_PARTS,
    MAX_TOOLS,
)
from engine.entrypoints.openai.serving import ServerSettings
from tests.engine.entrypoints.openai.conftest import ServerThread, start_server

LIMITS = ServerSettings(
    served_model_name="tiny", max_request_body_bytes=64 * 1024, max_prompt_tokens=64,
    max_output_tokens=12, max_n=2, max_prompts=2, max_stop_strings=2, max_stop_token_ids=4,
    max_waiting_requests=2, retry_after_s=3,
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
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "stop_token_ids": [1, 2, 3, 4, 5]},
     "stop_token_ids"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "stop_token_ids": [1, 2, 3, 4, 5]}, "stop_token_ids"),
    ("/v1/completions", {"prompt": ["a", "b", "c"], "max_tokens": 2}, "prompt"),
    ("/v1/completions", {"prompt": [[5], [6], [7]], "max_tokens": 2}, "prompt"),
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
        extra_body={"ignore_eos": True, "stop_token_ids": [1, 2, 3, 4]})
    assert [choice.index for choice in completion.choices] == [0, 1]
    assert completion.usage.completion_tokens <= 24
    batch = client.completions.create(model="tiny", prompt=["a", "b"], max_tokens=2)
    assert [choice.index for choice in batch.choices] == [0, 1]


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
    streams = [_Stream(server) for _ in range(2)]
    try:
        _wait_for(lambda: server.stats().num_waiting == 1)
        with server.http() as http:
            # One slot is left: a request of two completions is refused whole.
            for body in ({"prompt": ["a", "b"]}, {"prompt": "a", "n": 2}):
                response = http.post("/v1/completions",
                                     json={"model": "tiny", "max_tokens": 2, **body})
                assert response.status_code == 429, response.text
                assert response.json()["error"]["code"] == "queue_full"
            # One that could never fit is told so, rather than to retry.
            response = http.post("/v1/completions", json={
                "model": "tiny", "max_tokens": 2, "prompt": ["a", "b"], "n": 2})
            _assert_limit_error(response, "n")
            assert (server.stats().num_waiting, server.engine.num_waiting_requests) == (1, 1)
        streams.append(_Stream(server))
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


def test_min_tokens_beyond_the_context_is_a_400(server):
    with server.http() as http:
        response = http.post("/v1/completions", json={
            "model": "tiny", "prompt": "hi", "max_tokens": None, "min_tokens": 1100})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert (error["param"], error["code"]) == ("min_tokens", "context_length_exceeded")
    _assert_still_serving(server)


def test_a_million_stop_token_ids_are_refused_at_the_default_limit(server):
    """The default limit (256) refuses what once took 51 s and slowed every other client."""
    with server.http() as http:
        response = http.post("/v1/completions", json={
            "model": "tiny", "prompt": "hi", "max_tokens": 2, "n": 16,
            "stop_token_ids": [3] * 30_000})
    _assert_limit_error(response, "stop_token_ids")
    _assert_still_serving(server)


def test_health_answers_while_a_maximal_batch_is_prepared(server):
    """Prompts are tokenized and validated off the event loop: /health keeps answering
    while the largest batch the default limits allow (64 long prompts x n 16) is prepared.
    The batch is streamed and dropped once it starts, which aborts it."""
    prompts = [f"prompt {index} " + "lorem ipsum dolor sit amet " * 33 for index in range(64)]
    latencies_s: list[float] = []
    started = threading.Event()

    def post_batch() -> None:
        body = {"model": "tiny", "prompt": prompts, "n": 16, "max_tokens": 1, "stream": True}
        try:
            with server.http() as http, http.stream("POST", "/v1/completions",
                                                    json=body) as response:
                assert response.status_code == 200
        finally:
            started.set()

    thread = threading.Thread(target=post_batch, daemon=True)
    with server.http() as http:
        http.get("/health")
        thread.start()
        while not started.is_set():
            start_s = time.monotonic()
            assert http.get("/health").status_code == 200
            latencies_s.append(time.monotonic() - start_s)
            time.sleep(0.01)
    thread.join(60)
    latencies_s.sort()
    assert latencies_s[len(latencies_s) // 2] < 0.1, latencies_s
    _assert_still_serving(server)


@pytest.mark.parametrize(("path", "field"), [
    ("/v1/chat/completions", "messages"), ("/v1/responses", "input")])
def test_a_conversation_over_the_part_limit_is_refused_before_it_is_validated(
        server, path, field):
    """One message of 420,000 content parts held the event loop 1.9 s in validation."""
    half = MAX_CONVERSATION_PARTS // 2 + 1
    body = {"model": "tiny", field: [{"role": "user", "content": [{}] * half}] * 2}
    with server.http() as http:
        response = http.post(path, json=body)
    _assert_limit_error(response, field)
    assert f"{2 * half} content parts" in response.json()["error"]["message"]
    _assert_still_serving(server)


_BLOCK: dict = {}  # the count is checked before any block is validated
_OVER = MAX_CONVERSATION_PARTS + 1


@pytest.mark.parametrize(("path", "field", "body"), [
    # Blocks the limit once missed: a system prompt's, a tool result's.
    ("/v1/messages", "messages", {"max_tokens": 4, "system": [_BLOCK] * _OVER,
                                  "messages": [{"role": "user", "content": "hi"}]}),
    ("/v1/messages", "messages", {"max_tokens": 4, "messages": [
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t",
                                      "content": [_BLOCK] * _OVER}]}]}),
    ("/v1/chat/completions", "messages", {"messages": [
        {"role": "tool", "tool_call_id": "t", "content": [_BLOCK] * _OVER}]}),
    ("/v1/responses", "input", {"input": [
        {"type": "function_call_output", "call_id": "t", "output": [_BLOCK] * _OVER}]}),
])
def test_blocks_over_the_part_limit_anywhere_in_a_conversation_are_refused(
        server, path, field, body):
    with server.http() as http:
        response = http.post(path, json={"model": "tiny", **body})
    assert response.status_code == 400, response.text
    error = response.json().get("error", {})
    assert "over the limit of" in str(error.get("message")), response.text
    _assert_still_serving(server)


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ("/v1/responses", {"input": "hi"})])
def test_more_tools_than_the_limit_are_refused(server, path, body):
    tool = {"type": "function", "function": {"name": "f"}, "name": "f"}
    with server.http() as http:
        response = http.post(path, json={"model": "tiny", **body,
                                          "tools": [tool] * (MAX_TOOLS + 1)})
    _assert_limit_error(response, "tools")


@pytest.mark.parametrize("field", ["max_prompt_tokens", "max_output_tokens", "max_n",
                                   "max_prompts", "max_stop_strings", "max_stop_token_ids",
                                   "max_waiting_requests", "retry_after_s",
                                   "max_body_bytes_in_flight"])
def test_limits_must_be_positive(field):
    with pytest.raises(ValueError, match=field):
        dataclasses.replace(LIMITS, **{field: 0})


def test_the_body_bytes_in_flight_hold_at_least_one_largest_body():
    with pytest.raises(ValueError, match="at least max_request_body_bytes"):
        dataclasses.replace(LIMITS, max_body_bytes_in_flight=LIMITS.max_request_body_bytes - 1)


@pytest.mark.parametrize(("path", "field"), [
    ("/v1/chat/completions", "messages"), ("/v1/responses", "input")])
def test_a_conversation_over_the_item_limit_is_refused_before_it_is_validated(
        server, path, field):
    body = {"model": "tiny", field: [{}] * (MAX_CONVERSATION_ITEMS + 1)}
    with server.http() as http:
        response = http.post(path, json=body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert (error["param"], error["code"]) == (field, "limit_exceeded")
    assert f"{MAX_CONVERSATION_ITEMS + 1} items" in error["message"]
