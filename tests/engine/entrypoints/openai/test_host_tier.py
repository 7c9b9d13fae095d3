"""The host KV tier over HTTP (issue 24's acceptance): a job's second turn whose first turn
was pushed out of a small device pool by other traffic gets its prefix back from the host tier
(`fcfs`, `--kv-offload-gib 1`), and its greedy output is the same as without a tier, where the
prefix is recomputed."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass

import pytest
import torch

from tests.engine.entrypoints.openai.conftest import ServerThread, start_server

BLOCK_SIZE = 16
NUM_KV_BLOCKS = 16  # 256 tokens: one other request takes nearly the whole pool


def token_ids(length: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (length,), generator=generator).tolist()


@dataclass(frozen=True)
class SecondTurn:
    first_turn_num_tokens: int
    cached_tokens: int
    token_ids: list[int]
    logprobs: list[float]  # the top 3 at each position, position by position
    host_hit_tokens: int


def run_job_with_traffic(server: ServerThread) -> SecondTurn:
    """Turn 1 of a job, two other requests that each need most of the pool, then turn 2
    (turn 1's prompt and output and more), all greedy."""
    client = server.client()
    first_prompt = token_ids(100, 1)
    first = client.completions.create(
        model="tiny", prompt=first_prompt, max_tokens=16, temperature=0,
        extra_body={"job_id": "agent", "return_token_ids": True, "ignore_eos": True})
    first_output = first.choices[0].model_extra["token_ids"]
    for index in range(2):
        client.completions.create(model="tiny", prompt=token_ids(200, 10 + index),
                                  max_tokens=8, temperature=0)
    second = client.completions.create(
        model="tiny", prompt=[*first_prompt, *first_output, *token_ids(20, 2)], max_tokens=12,
        temperature=0, logprobs=3,
        extra_body={"job_id": "agent", "is_last_step": True, "return_token_ids": True,
                    "ignore_eos": True})
    stats = server.wait_idle()
    assert stats.num_free_blocks == stats.num_kv_blocks
    choice = second.choices[0]
    return SecondTurn(
        first_turn_num_tokens=len(first_prompt) + len(first_output),
        cached_tokens=second.usage.prompt_tokens_details.cached_tokens,
        token_ids=choice.model_extra["token_ids"],
        logprobs=[logprob for top in choice.logprobs.top_logprobs
                  for logprob in sorted(top.values())],
        host_hit_tokens=stats.prefix_cache_host_hit_tokens,
    )


def fcfs_server(**overrides: object) -> ServerThread:
    return start_server(scheduling_policy="fcfs", num_kv_blocks=NUM_KV_BLOCKS,
                        max_model_len=256, **overrides)


def test_second_turn_gets_its_evicted_prefix_from_the_host_tier() -> None:
    with ExitStack() as servers, ThreadPoolExecutor(1) as pool:
        without_tier = fcfs_server()
        servers.callback(without_tier.stop)
        # The second server starts while the first one serves (starting takes most of the
        # time); not both at once, as the first import of the tokenizer library is not
        # thread-safe.
        starting = pool.submit(fcfs_server, kv_offload_gib=1)
        try:
            recomputed = run_job_with_traffic(without_tier)
        finally:
            with_tier = starting.result()
            servers.callback(with_tier.stop)
        reloaded = run_job_with_traffic(with_tier)
    assert recomputed.cached_tokens == 0  # the traffic evicted turn 1 from the pool
    # Every full block of turn 1 whose KV was computed (its last token's never is).
    num_full_blocks = (reloaded.first_turn_num_tokens - 1) // BLOCK_SIZE
    assert reloaded.cached_tokens == num_full_blocks * BLOCK_SIZE
    assert reloaded.host_hit_tokens == reloaded.cached_tokens
    assert len(reloaded.token_ids) == 12
    assert reloaded.token_ids == recomputed.token_ids
    assert reloaded.logprobs == pytest.approx(recomputed.logprobs, abs=1e-4)
