"""Grammars that would cost the engine core too much memory or CPU fail alone, over HTTP: a
400 naming the request field, a short message, nothing left running, and other requests
served meanwhile. (`python -m lab grammars` measures the memory and the other tenant's
latency under such grammars.)"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Iterator

import pytest

from tests.engine.entrypoints.openai.conftest import ServerThread, start_server

TOO_LARGE = "(a{1000}){64}"  # a lexer of about 23 MB: stopped by the fuel 8 MiB buys
TOO_SLOW = "(a{1000}){12}"  # within the fuel 8 MiB buys, masks of several ms


@pytest.fixture(scope="module")
def strict_server() -> Iterator[ServerThread]:
    """Grammars limited to 8 MiB each and 1 ms of CPU a mask: `TOO_SLOW`'s masks take 3-20 ms
    here, a plain grammar's 0.01-0.1 ms (a budget of 0.5 ms once failed one on a busy CI
    machine)."""
    running = start_server(max_grammar_bytes=8 << 20, grammar_mask_budget_s=0.001)
    yield running
    running.stop()


def _regex_completion(server: ServerThread, regex: str, *, stream: bool = False):
    with server.http() as http:
        return http.post("/v1/completions", json={
            "model": "tiny", "prompt": "a", "max_tokens": 4, "stream": stream,
            "structured_outputs": {"regex": regex}})


@pytest.mark.parametrize(("regex", "message"), [
    (TOO_LARGE, "the grammar is too large: compiling it takes more than the limit of 8 MiB"),
    (TOO_SLOW, "the grammar is too slow: computing its allowed tokens took over 1 ms"),
])
def test_a_costly_grammar_gets_a_400_naming_its_field(strict_server, regex, message):
    response = _regex_completion(strict_server, regex)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "structured_outputs.regex"
    assert error["message"].startswith(f"structured_outputs.regex: {message}")
    assert "\n" not in error["message"] and len(error["message"]) < 400
    stats = strict_server.wait_idle()
    assert stats.num_free_blocks == stats.num_kv_blocks


def test_a_costly_grammar_ends_its_stream_with_the_error(strict_server):
    response = _regex_completion(strict_server, TOO_LARGE, stream=True)
    assert response.status_code == 200
    assert '"param":"structured_outputs.regex"' in response.text.replace(" ", "")
    strict_server.wait_idle()


def test_other_requests_are_served_while_costly_grammars_fail(strict_server):
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        costly = [pool.submit(_regex_completion, strict_server, f"(a{{1000}}){{{count}}}")
                  for count in range(64, 68)]
        with strict_server.http() as http:
            plain = http.post("/v1/completions", json={
                "model": "tiny", "prompt": "hello", "max_tokens": 8, "ignore_eos": True})
            fine = http.post("/v1/completions", json={
                "model": "tiny", "prompt": "a", "max_tokens": 3,
                "structured_outputs": {"regex": "[ab]{3}"}})
        assert plain.status_code == 200
        assert len(plain.json()["choices"][0]["text"]) > 0
        assert fine.status_code == 200, fine.text
        assert set(fine.json()["choices"][0]["text"]) <= {"a", "b"}
        assert [future.result().status_code for future in costly] == [400] * 4
    stats = strict_server.wait_idle()
    assert stats.num_free_blocks == stats.num_kv_blocks
