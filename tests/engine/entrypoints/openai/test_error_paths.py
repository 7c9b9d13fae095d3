"""Every way a request can end early once the engine has it (an error while its answer is
formatted or streamed, a client that goes away) aborts its engine request: nothing is left
running and every KV block is free again."""

from __future__ import annotations

import asyncio
import contextlib

import httpx
import pytest

ENDPOINTS = {
    "completions": ("/v1/completions", {"prompt": "Hello", "max_tokens": 900}),
    "chat": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hello"}],
                                      "max_tokens": 900}),
    "responses": ("/v1/responses", {"input": "Hello", "max_output_tokens": 900}),
}


def _aborted(server) -> float:
    return server.metric("request_success_total", 'finished_reason="abort"')


def _fail_after_start(serving, monkeypatch, stream: bool) -> None:
    """Makes the endpoint's answer fail once the engine runs its request."""
    if stream:
        original = serving.stream

        async def failing_stream(body, prepared):
            async for chunk in original(body, prepared):
                yield chunk
                raise RuntimeError("an error while streaming")
        monkeypatch.setattr(serving, "stream", failing_stream)
    else:
        async def failing_create(body, prepared):
            await asyncio.sleep(0.3)
            raise RuntimeError("an error while formatting")
        monkeypatch.setattr(serving, "create", failing_create)


@pytest.mark.parametrize("endpoint", sorted(ENDPOINTS))
@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
@pytest.mark.parametrize("failure", ["server-error", "client-gone"])
def test_no_engine_request_outlives_its_http_request(server, monkeypatch, endpoint, stream,
                                                     failure):
    path, fields = ENDPOINTS[endpoint]
    body = {"model": "tiny", "ignore_eos": True, "stream": stream, **fields}
    if failure == "server-error":
        _fail_after_start(getattr(server.app.state, endpoint), monkeypatch, stream)
    aborted_before = _aborted(server)
    timeout = httpx.Timeout(60, read=0.5 if failure == "client-gone" and not stream else 60)
    with server.http(timeout=timeout) as http:
        if stream:
            with pytest.raises(httpx.RemoteProtocolError) if failure == "server-error" \
                    else contextlib.nullcontext(), http.stream("POST", path, json=body) as response:
                assert response.status_code == 200
                lines = response.iter_lines()
                assert next(line for line in lines if line.startswith("data: "))
                if failure == "server-error":
                    list(lines)
        elif failure == "server-error":
            assert http.post(path, json=body).status_code == 500
        else:
            with pytest.raises(httpx.ReadTimeout):
                http.post(path, json=body)
    stats = server.wait_idle(timeout_s=10)
    assert stats.num_free_blocks == stats.num_kv_blocks
    assert _aborted(server) == aborted_before + 1

