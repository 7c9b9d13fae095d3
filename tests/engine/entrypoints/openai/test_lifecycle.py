"""Disconnects, metrics, health and a dead engine."""

from __future__ import annotations

import time

import httpx
import openai
import pytest

from tests.engine.entrypoints.openai.conftest import start_server

LONG = {"model": "tiny", "prompt": "Hello", "max_tokens": 900, "ignore_eos": True}


def _aborted(server) -> float:
    return server.metric("request_success_total", 'finished_reason="abort"')


def test_streaming_client_that_disconnects_frees_its_blocks(server):
    aborted_before = _aborted(server)
    with server.http() as http, http.stream(
        "POST", "/v1/completions", json={**LONG, "stream": True}
    ) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
        assert server.stats().num_running == 1
    stats = server.wait_idle(timeout_s=10)
    assert stats.num_free_blocks == stats.num_kv_blocks
    assert _aborted(server) == aborted_before + 1


def test_an_error_mid_stream_aborts_its_engine_request(server, monkeypatch):
    serving = server.app.state.completions
    stream = serving.stream

    async def failing(body, prepared):
        async for chunk in stream(body, prepared):
            yield chunk
            raise RuntimeError("an error after the engine started on the request")

    monkeypatch.setattr(serving, "stream", failing)
    aborted_before = _aborted(server)
    with server.http() as http, pytest.raises(httpx.RemoteProtocolError), http.stream(
        "POST", "/v1/completions", json={**LONG, "stream": True}
    ) as response:
        assert response.status_code == 200
        list(response.iter_lines())
    stats = server.wait_idle(timeout_s=10)
    assert stats.num_free_blocks == stats.num_kv_blocks
    assert _aborted(server) == aborted_before + 1


def test_non_streaming_client_that_disconnects_frees_its_blocks(server):
    aborted_before = _aborted(server)
    with server.http(timeout=httpx.Timeout(60, read=0.5)) as http, \
            pytest.raises(httpx.ReadTimeout):
        http.post("/v1/chat/completions", json={
            "model": "tiny", "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 900, "ignore_eos": True})
    stats = server.wait_idle(timeout_s=10)
    assert stats.num_free_blocks == stats.num_kv_blocks
    assert _aborted(server) == aborted_before + 1


def test_metrics_report_requests_latencies_and_the_core(server):
    server.client().completions.create(model="tiny", prompt="Hello", max_tokens=5,
                                       extra_body={"ignore_eos": True})  # sampled: EOS could end it
    with server.http() as http:
        response = http.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    text = response.text
    for name in ("time_to_first_token_seconds_count", "inter_token_latency_seconds_count",
                 "e2e_request_latency_seconds_count", "num_requests_running",
                 "num_requests_waiting", "kv_cache_usage_perc", "prefix_cache_queries_total",
                 "prefix_cache_hits_total", "num_preemptions_total",
                 "recomputed_tokens_total", "pins_created_total",
                 "num_pins", "pinned_blocks", "prompt_tokens_total", "generation_tokens_total",
                 "host_kv_cache_total_blocks", "host_kv_cache_used_blocks",
                 "host_kv_cache_stored_tokens_total", "host_kv_cache_loaded_tokens_total",
                 "prefix_cache_host_hits_total"):
        assert f"continuum:{name}{{" in text, name
    assert server.metric("host_kv_cache_total_blocks") == 0  # the server has no host tier
    assert server.metric("request_success_total", 'finished_reason="length"') >= 1
    assert server.metric("time_to_first_token_seconds_count") >= 1
    assert server.metric("inter_token_latency_seconds_count") >= 4
    assert server.metric("prefix_cache_queries_total") > 0


def test_health_version_and_models(server):
    with server.http() as http:
        assert http.get("/health").status_code == 200
        assert http.head("/health").status_code == 200  # load balancers' probe
        assert http.get("/version").json()["version"]
    (model,) = server.client().models.list().data
    assert model.id == "tiny"
    assert model.model_extra["max_model_len"] == 1024
    assert server.client().models.retrieve("tiny").id == "tiny"


def test_dead_engine_answers_503_promptly():
    server = start_server()
    try:
        server.engine.client.process.kill()
        deadline_s = time.monotonic() + 10
        with server.http() as http:
            while http.get("/health").status_code != 503:
                assert time.monotonic() < deadline_s, "/health did not notice the dead core"
                time.sleep(0.05)
            assert http.head("/health").status_code == 503
            response = http.post("/v1/completions", json={"model": "tiny", "prompt": "x"})
        assert response.status_code == 503
        assert response.json()["error"]["code"] == "engine_dead"
        with pytest.raises(openai.InternalServerError):
            server.client().chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=2)
    finally:
        server.stop()
