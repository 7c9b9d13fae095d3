"""`continuum serve --async-scheduling` over HTTP with the openai SDK: the same answers as the
server whose steps run in order, streams cut off by their client free everything."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Iterator

import pytest

from tests.engine.entrypoints.openai.conftest import ServerThread, start_server

PROMPTS = ["Hello", "Write a list of fruit", "1, 2, 3,", "The weather today is"]


@pytest.fixture(scope="module")
def async_server() -> Iterator[ServerThread]:
    running = start_server(async_scheduling=True)
    yield running
    running.stop()


def _answers(server: ServerThread) -> list[tuple[str, str | None, int]]:
    """Concurrent completions and chats (greedy, seeded and streamed ones): text, finish
    reason and completion tokens of each."""
    client = server.client()

    def completion(index: int) -> tuple[str, str | None, int]:
        prompt = PROMPTS[index % len(PROMPTS)]
        if index % 2:
            chat = client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": prompt}],
                max_tokens=8 + index, temperature=0.8, seed=index)
            choice = chat.choices[0]
            return choice.message.content or "", choice.finish_reason, chat.usage.completion_tokens
        chunks = list(client.completions.create(
            model="tiny", prompt=prompt, max_tokens=12 + index, temperature=0.0, stream=True,
            stream_options={"include_usage": True}))
        text = "".join(chunk.choices[0].text for chunk in chunks if chunk.choices)
        reason = next(chunk.choices[0].finish_reason for chunk in reversed(chunks)
                      if chunk.choices)
        return text, reason, chunks[-1].usage.completion_tokens

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        return list(pool.map(completion, range(8)))


def test_answers_match_the_server_whose_steps_run_in_order(server, async_server) -> None:
    assert _answers(async_server) == _answers(server)
    stats = async_server.wait_idle()
    assert stats.num_running == 0 and stats.num_free_blocks + stats.num_pinned_blocks == \
        stats.num_kv_blocks


def test_a_stream_its_client_leaves_is_aborted(async_server) -> None:
    with async_server.http(timeout=60) as http, http.stream(
            "POST", "/v1/completions",
            json={"model": "tiny", "prompt": "Hello", "max_tokens": 900, "ignore_eos": True,
                  "stream": True}) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
    stats = async_server.wait_idle()
    assert stats.num_running == 0 and stats.num_waiting == 0
    assert stats.num_free_blocks + stats.num_pinned_blocks == stats.num_kv_blocks
