"""Prompt logprobs from the model runner, against a reference forward pass of the whole prompt,
through chunked prefill, a prefix-cache hit and preemption (real scheduler, tiny model)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.outputs import EngineCoreOutput, PromptLogprobs, TokenLogprobs
from engine.request import Request
from engine.scheduler.policies import FCFSPolicy
from engine.scheduler.scheduler import Scheduler
from engine.worker import model_runner
from engine.worker.model_runner import ModelRunner
from tests.engine.helpers import FakeClock
from tests.engine.worker.test_model_runner import BLOCK_SIZE, make_runner, prompt, request

NUM_TOP = 3
ATOL = 1e-4


@pytest.fixture(scope="module")
def reference_runner() -> ModelRunner:
    """A runner whose KV pool no request uses: its model runs whole prompts for reference."""
    return make_runner()


def reference_logprobs(runner: ModelRunner, tokens: list[int]) -> torch.Tensor:
    """[len(tokens), vocab]: log-softmax of the logits at every position of one full forward
    pass of `tokens` (row `i` is the distribution of token `i + 1`)."""
    num_blocks = -(-len(tokens) // BLOCK_SIZE)
    metadata = runner.attention.build_metadata(
        np.array([len(tokens)]), np.array([0]), np.arange(num_blocks)[None])
    with torch.inference_mode():
        hidden = runner.model(torch.tensor(tokens), torch.from_numpy(metadata.positions),
                              runner.kv_caches, metadata)
        return runner.model.compute_logits(hidden).float().log_softmax(dim=-1)


class Collector:
    """Drives a scheduler with a runner and records every prompt-logprobs run the core reports,
    per request, and every token."""

    def __init__(self, runner: ModelRunner, scheduler: Scheduler) -> None:
        self.runner = runner
        self.scheduler = scheduler
        self.prompt_runs: dict[str, list[PromptLogprobs]] = {}
        self.tokens: dict[str, list[int]] = {}
        self.outputs: list[EngineCoreOutput] = []

    @classmethod
    def for_runner(cls, runner: ModelRunner) -> Collector:
        config = runner.config
        return cls(runner, Scheduler(config.scheduler, config.cache, FCFSPolicy(),
                                     num_kv_blocks=runner.num_kv_blocks, clock=FakeClock()))

    def run(self, requests: list[Request]) -> Collector:
        for req in requests:
            self.scheduler.add_request(req)
        while self.scheduler.requests:
            scheduler_output = self.scheduler.schedule()
            runner_output = self.runner.execute_model(scheduler_output)
            for output in self.scheduler.update_from_output(scheduler_output, runner_output):
                self.outputs.append(output)
                self.tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
                if output.prompt_logprobs is not None:
                    self.prompt_runs.setdefault(output.request_id, []).append(
                        output.prompt_logprobs)
            self.scheduler.check_invariants()
        return self

    def by_position(self, req_id: str) -> dict[int, list[TokenLogprobs]]:
        """Every entry reported for each prompt position (a recomputed prompt repeats some)."""
        entries: dict[int, list[TokenLogprobs]] = {}
        for run in self.prompt_runs.get(req_id, []):
            for offset, entry in enumerate(run.entries):
                entries.setdefault(run.start_index + offset, []).append(entry)
        return entries


def assert_matches_reference(entry: TokenLogprobs, expected: torch.Tensor, token_id: int,
                             num_top: int) -> None:
    assert entry.token_id == token_id
    assert entry.logprob == pytest.approx(expected[token_id].item(), abs=ATOL)
    assert entry.rank == int((expected > expected[token_id]).sum()) + 1
    top_values = expected.topk(num_top).values
    assert entry.top_logprobs == pytest.approx(top_values.tolist(), abs=ATOL)
    assert len(entry.top_token_ids) == num_top
    for token, value in zip(entry.top_token_ids, top_values.tolist(), strict=True):
        assert expected[token].item() == pytest.approx(value, abs=ATOL)  # ties may swap ids


def assert_prompt_logprobs(collector: Collector, req_id: str, tokens: list[int],
                           reference_runner: ModelRunner, num_top: int) -> None:
    """Each prompt token but the first has logprobs, and they are the reference's."""
    entries = collector.by_position(req_id)
    assert sorted(entries) == list(range(1, len(tokens)))
    expected = reference_logprobs(reference_runner, tokens)
    for position, reported in entries.items():
        for entry in reported:
            assert_matches_reference(entry, expected[position - 1], tokens[position], num_top)


def test_prompt_logprobs_match_a_full_forward_across_chunked_prefill(reference_runner) -> None:
    runner = make_runner(max_num_batched_tokens=16)
    tokens = prompt(40, 3)
    collector = Collector.for_runner(runner).run([
        request("p", tokens, temperature=0.0, max_tokens=3, prompt_logprobs=NUM_TOP),
        request("plain", prompt(12, 4), temperature=0.0, max_tokens=3),
    ])
    runs = collector.prompt_runs["p"]
    assert len(runs) >= 3  # one run per prefill step
    assert [run.start_index for run in runs] == sorted(run.start_index for run in runs)
    assert sum(len(run.entries) for run in runs) == len(tokens) - 1  # each position once
    assert_prompt_logprobs(collector, "p", tokens, reference_runner, NUM_TOP)
    partial = [o for o in collector.outputs if o.request_id == "p" and not o.new_token_ids]
    assert partial and all(o.prompt_logprobs is not None and o.finish_reason is None
                           for o in partial)
    assert "plain" not in collector.prompt_runs
    assert collector.tokens["p"] and len(collector.tokens["p"]) == 3


def test_zero_top_logprobs_gives_only_the_prompt_tokens_own(reference_runner) -> None:
    tokens = prompt(9, 5)
    collector = Collector.for_runner(make_runner()).run(
        [request("p", tokens, temperature=0.0, max_tokens=1, prompt_logprobs=0)])
    assert all(entry.top_token_ids == [] and entry.top_logprobs == []
               for entries in collector.by_position("p").values() for entry in entries)
    assert_prompt_logprobs(collector, "p", tokens, reference_runner, 0)


def test_a_prefix_cache_hit_is_not_used_by_a_request_with_prompt_logprobs(
    reference_runner,
) -> None:
    runner = make_runner()
    shared = prompt(24, 6)
    tokens = shared + prompt(6, 7)
    collector = Collector.for_runner(runner)
    collector.run([request("warm", [*shared, 1], temperature=0.0, max_tokens=1)])
    collector.run([request("p", tokens, temperature=0.0, max_tokens=1, prompt_logprobs=2)])
    collector.run([request("plain", tokens, temperature=0.0, max_tokens=1)])
    cached = {o.request_id: o.num_cached_tokens for o in collector.outputs}
    assert cached["plain"] >= 24  # the cache holds the prefix ...
    assert cached["p"] == 0  # ... but the prompt-logprobs request computed all of it
    assert_prompt_logprobs(collector, "p", tokens, reference_runner, 2)
    assert collector.tokens["p"] == collector.tokens["plain"]


def test_prompt_logprobs_survive_preemption(reference_runner) -> None:
    """A request preempted during its prefill recomputes its prompt and reports those positions
    again, with the same values; once it sampled a token it reports no prompt logprobs."""
    tokens = prompt(30, 8)
    crowd = [request(f"o{i}", prompt(6 + 3 * i, 10 + i), temperature=1.0, max_tokens=20)
             for i in range(3)]
    collector = Collector.for_runner(make_runner(num_kv_blocks=16, max_num_batched_tokens=8))
    collector.run([*crowd, request("p", tokens, temperature=0.0, max_tokens=4,
                                   prompt_logprobs=1)])
    assert any(len(entries) > 1 for entries in collector.by_position("p").values())
    assert_prompt_logprobs(collector, "p", tokens, reference_runner, 1)
    first_token = next(index for index, o in enumerate(collector.outputs)
                       if o.request_id == "p" and o.new_token_ids)
    assert all(o.prompt_logprobs is None for o in collector.outputs[first_token + 1 :]
               if o.request_id == "p")


def test_one_token_prompt_has_no_prompt_logprobs() -> None:
    collector = Collector.for_runner(make_runner()).run(
        [request("p", [7], temperature=0.0, max_tokens=2, prompt_logprobs=3)])
    assert collector.prompt_runs == {} and len(collector.tokens["p"]) == 2


def test_logit_bias_forces_and_bans_greedy_tokens_of_the_tiny_model() -> None:
    tokens = prompt(8, 9)
    plain = Collector.for_runner(make_runner()).run(
        [request("r", tokens, temperature=0.0, max_tokens=6)]).tokens["r"]
    forced_token = next(t for t in range(256) if t not in plain)
    forced = Collector.for_runner(make_runner()).run([
        request("r", tokens, temperature=0.0, max_tokens=6,
                logit_bias=((forced_token, 100.0),), logprobs=1),
    ])
    assert forced.tokens["r"] == [forced_token] * 6
    first = next(o.logprobs[0] for o in forced.outputs if o.logprobs)
    # Logprobs are the unbiased model's: its best first token is the unbiased greedy one.
    assert first.token_id == forced_token and first.rank > 1
    assert first.top_token_ids == [plain[0]]
    banned = Collector.for_runner(make_runner()).run([
        request("r", tokens, temperature=0.0, max_tokens=6, logit_bias=((plain[0], -100.0),)),
    ]).tokens["r"]
    assert plain[0] not in banned and len(banned) == 6


def test_logits_are_computed_in_bounded_slices(reference_runner, monkeypatch) -> None:
    runner = make_runner()
    monkeypatch.setattr(model_runner, "PROMPT_LOGITS_CHUNK_BYTES", 3 * 4 * runner.arch.vocab_size)
    tokens = prompt(20, 11)
    collector = Collector.for_runner(runner).run(
        [request("p", tokens, temperature=0.0, max_tokens=1, prompt_logprobs=2),
         request("q", tokens[:7], temperature=0.0, max_tokens=1, prompt_logprobs=1)])
    assert_prompt_logprobs(collector, "p", tokens, reference_runner, 2)
    assert_prompt_logprobs(collector, "q", tokens[:7], reference_runner, 1)
