"""Scheduling step N+1 before step N's tokens are back (async scheduling): placeholders, stops
one step late, preemption and aborts while a step is out, and the same tokens as in order."""

from __future__ import annotations

import random
from collections import defaultdict

from hypothesis import example, given
from hypothesis import strategies as st

from engine.outputs import EngineCoreOutput
from engine.scheduler.policies import FCFSPolicy, PriorityPolicy
from engine.scheduler.scheduler import Scheduler
from tests.engine.helpers import (
    FakeClock,
    FakeRunner,
    PinningPolicy,
    PipelinedSteps,
    assert_everything_released,
    make_request,
    make_scheduler,
    run_step,
)

BLOCK_SIZE = 4
EOS = 0
POLICIES = {"fcfs": FCFSPolicy, "priority": PriorityPolicy, "pinning": PinningPolicy}


def _sample(req_id: str, position: int) -> int:
    """A token that depends on the request and position only, EOS now and then."""
    return random.Random(f"{req_id}/{position}").choice([EOS, *range(1, 12)])


def _streams(outputs: list[EngineCoreOutput]) -> dict[str, tuple[list[int], str | None]]:
    tokens: dict[str, list[int]] = defaultdict(list)
    finish: dict[str, str | None] = {}
    for output in outputs:
        tokens[output.request_id] += output.new_token_ids
        if output.finish_reason is not None:
            finish[output.request_id] = str(output.finish_reason)
    return {req_id: (tokens[req_id], finish.get(req_id)) for req_id in tokens}


def _add_requests(scheduler: Scheduler, specs: list[tuple[int, int, int]],
                  num_tenants: int = 0) -> list[str]:
    """Adds the requests of `specs` (each tenant's jobs named apart: `t1:job2`); their job
    ids."""
    prefixes = [[7] * 8, [8] * 12, [9] * 4, []]
    job_ids = set()
    for index, (prefix, length, max_tokens) in enumerate(specs):
        prompt = (prefixes[prefix] + [(index * 7 + k) % 40 + 1 for k in range(length)])[:24]
        tenant = f"t{index % num_tenants}" if num_tenants else None
        job_id = f"job{index % 3}" if tenant is None else f"{tenant}:job{index % 3}"
        job_ids.add(job_id)
        scheduler.add_request(make_request(f"r{index}", prompt, max_tokens=max_tokens,
                                           eos_token_id=EOS, job_id=job_id, tenant=tenant))
    return sorted(job_ids)


@given(
    policy_name=st.sampled_from(sorted(POLICIES)),
    num_blocks=st.integers(6, 14),
    budget=st.integers(4, 40),
    max_num_seqs=st.integers(1, 8),
    caching=st.booleans(),
    specs=st.lists(st.tuples(st.integers(0, 3), st.integers(1, 20), st.integers(1, 16)),
                   min_size=1, max_size=10),
    num_tenants=st.integers(0, 3),
)
# A request preempted for a tenant's share must not be admitted again in the same step.
@example(policy_name="fcfs", num_blocks=10, budget=18, max_num_seqs=5, caching=False,
         specs=[(3, 13, 8), (1, 2, 10), (3, 17, 12), (3, 7, 14), (2, 8, 11), (3, 5, 4)],
         num_tenants=2)
def test_pipelined_steps_give_the_tokens_of_steps_in_order(
    policy_name, num_blocks, budget, max_num_seqs, caching, specs, num_tenants,
) -> None:
    """Each request gets the same tokens and finish reason whether the next step is scheduled
    before or after the scheduler hears of the last one (preemptions included: the pools are
    small, and with tenants some are for a tenant's share), the invariants hold after every
    step, and everything is released at the end."""
    results = []
    for pipelined in (False, True):
        scheduler = make_scheduler(
            num_blocks=num_blocks, block_size=BLOCK_SIZE, max_num_batched_tokens=budget,
            max_num_seqs=max_num_seqs, max_model_len=24, enable_prefix_caching=caching,
            policy=POLICIES[policy_name](),
        )
        runner = FakeRunner(BLOCK_SIZE, sample=_sample)
        job_ids = _add_requests(scheduler, specs, num_tenants)
        if pipelined:
            outputs = PipelinedSteps(scheduler, runner).run_until_done()
        else:
            outputs = []
            while scheduler.has_unfinished_requests():
                outputs += run_step(scheduler, runner)[1]
        assert_everything_released(scheduler, runner, job_ids)
        results.append(_streams(outputs))
    assert results[0] == results[1]


def test_a_decode_is_scheduled_on_the_token_still_out() -> None:
    """While step N is out, step N+1 computes the token N samples: the request holds one
    placeholder per step out, and its KV runs one token ahead of its known tokens."""
    scheduler = make_scheduler(block_size=BLOCK_SIZE)
    scheduler.add_request(make_request("a", [1, 2, 3], max_tokens=8))
    runner = FakeRunner(BLOCK_SIZE, sample=lambda r, p: 5)
    first = scheduler.schedule()
    first_output = runner.execute(first)
    request = scheduler.requests["a"]
    assert (request.num_tokens, request.num_computed_tokens) == (3, 3)
    assert request.num_output_placeholders == 1
    second = scheduler.schedule()
    assert second.num_scheduled_tokens == {"a": 1}
    assert (request.num_tokens, request.num_computed_tokens) == (3, 4)
    assert request.num_output_placeholders == 2
    second_output = runner.execute(second)
    outputs = scheduler.update_from_output(first, first_output)
    assert [output.new_token_ids for output in outputs] == [[5]]
    assert (request.num_tokens, request.num_output_placeholders) == (4, 1)
    scheduler.check_invariants()
    scheduler.update_from_output(second, second_output)
    assert (request.num_tokens, request.num_computed_tokens) == (5, 4)
    assert request.num_output_placeholders == 0
    scheduler.check_invariants()


def test_no_token_is_scheduled_past_max_tokens_or_max_model_len() -> None:
    """A request whose awaited token is its last is not scheduled again (the fake runner
    fails on a step past a request's blocks or tokens), and finishes with that token."""
    scheduler = make_scheduler(block_size=BLOCK_SIZE, max_model_len=8)
    scheduler.add_request(make_request("short", [1, 2], max_tokens=2))
    scheduler.add_request(make_request("long", [1, 2, 3, 4, 5], max_tokens=None))
    steps = PipelinedSteps(scheduler, FakeRunner(BLOCK_SIZE, sample=lambda r, p: 5))
    outputs = steps.run_until_done()
    streams = _streams(outputs)
    assert streams["short"] == ([5, 5], "length")
    assert streams["long"] == ([5, 5, 5], "length")
    assert scheduler.kv_cache_manager.block_pool.num_free_blocks == 64


def test_a_request_stopped_by_the_step_out_computes_one_token_for_nothing() -> None:
    """EOS comes back one step late: the step already scheduled computes one more token for
    the request, whose output nobody receives; the next step tells the runner to drop it."""
    scheduler = make_scheduler(block_size=BLOCK_SIZE)
    scheduler.add_request(make_request("a", [1, 2, 3], max_tokens=8, eos_token_id=EOS))
    runner = FakeRunner(BLOCK_SIZE, sample=lambda r, p: EOS if p == 4 else 6)
    steps = PipelinedSteps(scheduler, runner)
    outputs = steps.step() + steps.step() + steps.step()
    assert _streams(outputs) == {"a": ([6, EOS], "stop")}
    assert not scheduler.has_unfinished_requests()
    assert len(runner.states["a"].token_ids) == 6  # one token past the EOS, dropped
    outputs = steps.step()
    assert outputs == []
    assert "a" not in runner.states


def test_a_request_preempted_while_its_token_is_out_resumes_with_it() -> None:
    """A running request preempted by the step after the one sampling its token gets that
    token while it waits, and is recomputed with it."""
    clock = FakeClock()
    scheduler = make_scheduler(block_size=BLOCK_SIZE, num_blocks=4, max_model_len=16,
                               max_num_batched_tokens=16, clock=clock)
    scheduler.add_request(make_request("a", [1] * 6, max_tokens=6))
    scheduler.add_request(make_request("b", [2] * 6, max_tokens=6))
    steps = PipelinedSteps(scheduler, FakeRunner(BLOCK_SIZE, sample=lambda r, p: 3))
    outputs = steps.run_until_done()
    assert scheduler.num_preemptions > 0
    assert _streams(outputs) == {"a": ([3] * 6, "length"), "b": ([3] * 6, "length")}


def test_an_aborted_request_id_reused_while_its_step_is_out_gets_none_of_its_tokens() -> None:
    """The step out still carries the aborted request's token; the new request with the same
    id must not receive it."""
    scheduler = make_scheduler(block_size=BLOCK_SIZE)
    scheduler.add_request(make_request("a", [1, 2, 3], max_tokens=8))
    runner = FakeRunner(BLOCK_SIZE, sample=lambda r, p: 5 if p < 4 else 9)
    steps = PipelinedSteps(scheduler, runner)
    steps.step()
    steps.step()
    scheduler.finish_requests(["a"])
    scheduler.add_request(make_request("a", [4, 4, 4, 4, 4, 4], max_tokens=1))
    outputs = steps.step()  # carries the old "a"'s first token, and drops its runner state
    assert outputs == []
    outputs += steps.run_until_done()
    assert _streams(outputs) == {"a": ([9], "length")}
