"""Four concurrent rollouts of one prompt over the Responses API, on the tiny model (random
weights, one token a byte), each re-sending its conversation for a second turn as agent
frameworks do: four jobs of two turns each, every time. Their answers are random bytes, often
not UTF-8, so the text a client sends back is not the tokens the model sampled; the engine
tells the rollouts apart by the text (`engine/scheduler/job_inference.py`).
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from engine.engine_args import EngineArgs
from engine.entrypoints.openai.serving import ServerSettings
from tests.compat.jobs import TracedServer
from tests.engine.entrypoints.openai.conftest import MAX_BODY_BYTES

NUM_RUNS = 10
NUM_ROLLOUTS = 4


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TracedServer]:
    trace = tmp_path_factory.mktemp("rollouts") / "trace.jsonl"
    server = TracedServer(
        EngineArgs(num_kv_blocks=256, max_model_len=1024, trace_path=str(trace)),
        ServerSettings(served_model_name="tiny", max_request_body_bytes=MAX_BODY_BYTES),
        trace=trace)
    server.start()
    yield server
    server.stop()


def _rollout(server: TracedServer, prompt: str, seed: int) -> tuple[str, str]:
    """Two turns of one rollout, the second re-sending the first's output; their ids."""
    client = server.client()
    first = client.responses.create(model="tiny", input=prompt, max_output_tokens=24,
                                    extra_body={"seed": seed})
    conversation: list[Any] = [
        {"role": "user", "content": prompt},
        *(item.model_dump(exclude_none=True) for item in first.output),
        {"role": "user", "content": "Go on."}]
    second = client.responses.create(model="tiny", input=conversation, max_output_tokens=24,
                                     extra_body={"seed": seed + 1})
    return first.id, second.id


def test_four_rollouts_of_one_prompt_are_four_jobs_in_every_run(server) -> None:
    for run in range(NUM_RUNS):
        prompt = f"Rollout prompt number {run}: tell me something."

        def four_rollouts(prompt: str = prompt, run: int = run) -> list[tuple[str, str]]:
            with ThreadPoolExecutor(NUM_ROLLOUTS) as pool:
                return list(pool.map(lambda index: _rollout(server, prompt, 100 * run + 10 * index),
                                     range(NUM_ROLLOUTS)))

        rollouts, turns = server.turns(four_rollouts)
        assert len(turns) == 2 * NUM_ROLLOUTS
        job_of = {turn.request_id: turn.job_id for turn in turns}
        inferred_from = {turn.request_id: turn.arrived.inferred_from for turn in turns}
        for first, second in rollouts:
            assert job_of[second] == job_of[first], f"run {run}"
            assert inferred_from[second] == first, f"run {run}"
        assert len(set(job_of.values())) == NUM_ROLLOUTS, f"run {run}"


def _identical_run(server: TracedServer, prompt: str, num_turns: int = 3) -> list[str]:
    """A chat of `num_turns` greedy turns, each re-sending the conversation: the chat
    completion ids of its turns (every run of `prompt` answers alike)."""
    client = server.client()
    messages: list[Any] = [{"role": "user", "content": prompt}]
    ids = []
    for _ in range(num_turns):
        reply = client.chat.completions.create(model="tiny", messages=messages, max_tokens=12,
                                               temperature=0)
        ids.append(reply.id)
        messages += [{"role": "assistant", "content": reply.choices[0].message.content},
                     {"role": "user", "content": "Go on."}]
    return ids


def test_identical_runs_each_keep_one_job_after_two_ran_together(server) -> None:
    # Two runs at once, then four one after the other. The pair's turns are alike and
    # finish together, so nothing tells whose is whose: their six turns stay in their two
    # jobs (a turn may continue the other run's job, whose KV is the same), no third job.
    # Each later run keeps one job of its own, though the pair's last turns, alike, stay in
    # the table.
    prompt = "Identical runs: say something."
    with ThreadPoolExecutor(2) as pool:
        _, pair_turns = server.turns(
            lambda: list(pool.map(lambda _: _identical_run(server, prompt), range(2))))
    assert len({turn.job_id for turn in pair_turns}) == 2
    for _ in range(4):
        ids, turns = server.turns(lambda: _identical_run(server, prompt))
        assert len({turn.job_id for turn in turns}) == 1 and len(turns) == len(ids)
