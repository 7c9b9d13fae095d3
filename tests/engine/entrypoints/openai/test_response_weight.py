"""What a completion may weigh, and how a heavy one is built: the bound on a response's
logprob values (`max_response_logprobs`), echoed prompt logprobs shared by every choice, and
bodies built off the event loop. Real servers on the tiny model."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from engine.entrypoints.openai.serving import ServerSettings
from tests.engine.entrypoints.openai.conftest import MAX_BODY_BYTES, ServerThread, start_server

LIMIT = 20_000
ATOL = 1e-4
# About a token a character (the tiny model's tokenizer reads bytes).
LONG_PROMPT = "the quick brown fox jumps over the lazy dog " * 20


@pytest.fixture(scope="module")
def bounded() -> Iterator[ServerThread]:
    """A server whose responses carry at most `LIMIT` logprob values."""
    running = start_server(settings=ServerSettings(
        served_model_name="tiny", max_request_body_bytes=MAX_BODY_BYTES,
        max_response_logprobs=LIMIT))
    yield running
    running.stop()


@pytest.mark.parametrize(("path", "body", "counted"), [
    # 2 prompts x n 2 x 880 echoed tokens x (1 + 5): the second prompt takes it past.
    ("/v1/completions", {"prompt": [LONG_PROMPT, LONG_PROMPT[1:]], "echo": True,
                         "logprobs": 5, "max_tokens": 0, "n": 2},
     "the first 2 of 2 prompts' tokens"),
    # 4 x 3,000 x 6 generated: past it before anything is tokenized.
    ("/v1/completions", {"prompt": "hi", "logprobs": 5, "max_tokens": 3000, "n": 4},
     "max_tokens 3000"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "logprobs": True, "top_logprobs": 20, "max_tokens": 900,
                              "n": 3}, "choices"),
    ("/v1/responses", {"input": "hi", "include": ["message.output_text.logprobs"],
                       "top_logprobs": 20, "max_output_tokens": 1000}, "choices"),
])
def test_a_response_over_the_logprob_bound_is_refused_before_any_work(
        bounded, path, body, counted):
    with bounded.http() as http:
        response = http.post(path, json={"model": "tiny", **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["param"], error["code"]) == ("logprobs", "limit_exceeded")
    assert f"limit of {LIMIT} (max_response_logprobs)" in error["message"]
    assert counted in error["message"]
    assert bounded.engine.num_unfinished_requests == 0
    stats = bounded.wait_idle()
    assert stats.num_free_blocks == stats.num_kv_blocks


def _choices(response: httpx.Response) -> list[dict[str, Any]]:
    assert response.status_code == 200, response.text
    return response.json()["choices"]


def _assert_same_choice(choice: dict[str, Any], expected: dict[str, Any]) -> None:
    assert choice["text"] == expected["text"]
    logprobs, want = choice["logprobs"], expected["logprobs"]
    assert logprobs["tokens"] == want["tokens"]
    assert logprobs["text_offset"] == want["text_offset"]
    assert logprobs["token_logprobs"][0] is None and want["token_logprobs"][0] is None
    assert logprobs["token_logprobs"][1:] == pytest.approx(want["token_logprobs"][1:], abs=ATOL)
    for top, want_top in zip(logprobs["top_logprobs"][1:], want["top_logprobs"][1:],
                             strict=True):
        assert top.keys() == want_top.keys()


@pytest.mark.parametrize("max_tokens", [0, 3])
def test_every_choice_echoes_its_prompts_logprobs_in_a_large_body_as_in_a_small_one(
        server, max_tokens):
    """2 prompts x n 4 x about 880 tokens x 6 values: built off the event loop, in pieces;
    each choice is the one a request for its prompt alone gives (built on the loop)."""
    prompts = [LONG_PROMPT[:880], LONG_PROMPT[3:883]]
    common = {"model": "tiny", "echo": True, "logprobs": 5, "max_tokens": max_tokens,
              "temperature": 0.0, "ignore_eos": True}
    with server.http() as http:
        large = http.post("/v1/completions", json={**common, "prompt": prompts, "n": 4})
        assert int(large.headers["content-length"]) == len(large.content) > 256 * 1024
        choices = _choices(large)
        assert [choice["index"] for choice in choices] == list(range(8))
        for prompt_index, prompt in enumerate(prompts):
            (alone,) = _choices(http.post("/v1/completions", json={**common, "prompt": prompt}))
            assert alone["text"].startswith(prompt)
            for choice in choices[4 * prompt_index:4 * prompt_index + 4]:
                _assert_same_choice(choice, alone)
                assert len(choice["logprobs"]["tokens"]) == len(prompt) + max_tokens
    server.wait_idle()


def test_a_streamed_echo_carries_the_prompts_logprobs_in_each_choices_first_chunk(server):
    prompts = [LONG_PROMPT[:880], LONG_PROMPT[5:885]]
    common = {"model": "tiny", "prompt": prompts, "echo": True, "logprobs": 5, "n": 4,
              "max_tokens": 2, "temperature": 0.0, "ignore_eos": True}
    with server.http() as http:
        whole = _choices(http.post("/v1/completions", json=common))
        firsts: dict[int, dict[str, Any]] = {}
        with http.stream("POST", "/v1/completions", json={**common, "stream": True}) as stream:
            for line in stream.iter_lines():
                if line.startswith("data: {"):
                    for choice in json.loads(line[6:])["choices"]:
                        firsts.setdefault(choice["index"], choice)
    assert sorted(firsts) == list(range(8))
    for index, choice in firsts.items():
        num_prompt_tokens = len(prompts[index // 4])
        assert choice["text"].startswith(prompts[index // 4])
        assert choice["logprobs"]["tokens"][:num_prompt_tokens] == (
            whole[index]["logprobs"]["tokens"][:num_prompt_tokens])
    server.wait_idle()
