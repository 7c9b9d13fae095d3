import pytest

from engine.request import FinishReason, RequestStatus
from engine.scheduler import events
from engine.scheduler.policies import FCFSPolicy
from engine.scheduler.retention import POLICY_ERROR
from tests.engine.helpers import (
    FakeClock,
    FakeRunner,
    make_request,
    make_scheduler,
    run_step,
    run_until_done,
)


def free_blocks(scheduler) -> int:
    return scheduler.kv_cache_manager.block_pool.num_free_blocks


def test_new_request_is_sent_in_full_then_as_deltas() -> None:
    scheduler = make_scheduler(block_size=4)
    runner = FakeRunner(4)
    scheduler.add_request(make_request("a", list(range(6)), max_tokens=4))

    output, core_outputs = run_step(scheduler, runner)
    [new] = output.scheduled_new_reqs
    assert new.prompt_token_ids == list(range(6))
    assert new.block_ids == [0, 1]
    assert output.num_scheduled_tokens == {"a": 6}
    assert [o.new_token_ids for o in core_outputs] == [[1]]

    output, _ = run_step(scheduler, runner)  # token 7 fits block 1
    assert output.scheduled_new_reqs == []
    assert output.scheduled_cached_reqs.req_ids == ["a"]
    assert output.scheduled_cached_reqs.new_block_ids == [[]]
    assert output.scheduled_cached_reqs.num_computed_tokens == [6]

    run_step(scheduler, runner)  # 8 tokens computed
    output, _ = run_step(scheduler, runner)  # the 9th token needs a new block
    assert output.scheduled_cached_reqs.new_block_ids == [[2]]


def test_chunked_prefill_spreads_a_long_prompt_over_steps() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=8, max_model_len=64)
    runner = FakeRunner(4)
    scheduler.add_request(make_request("a", list(range(20)), max_tokens=2))
    scheduled, sampled = [], []
    for _ in range(4):
        output, core_outputs = run_step(scheduler, runner)
        scheduled.append(output.num_scheduled_tokens["a"])
        sampled.append([o.new_token_ids for o in core_outputs])
    assert scheduled == [8, 8, 4, 1]
    assert sampled == [[], [], [[1]], [[1]]]  # no token until the prefill completes


def test_prefill_chunk_shares_the_budget_with_running_decodes() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=10)
    runner = FakeRunner(4)
    scheduler.add_request(make_request("a", [1, 2, 3], max_tokens=10))
    run_step(scheduler, runner)
    scheduler.add_request(make_request("b", list(range(30)), max_tokens=2))
    output, _ = run_step(scheduler, runner)
    assert output.num_scheduled_tokens == {"a": 1, "b": 9}  # running first, then the rest
    assert output.total_num_scheduled_tokens == 10


def test_long_prefill_threshold_caps_each_step() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=32, long_prefill_token_threshold=5)
    runner = FakeRunner(4)
    scheduler.add_request(make_request("a", list(range(12)), max_tokens=1))
    scheduler.add_request(make_request("b", list(range(40, 43)), max_tokens=1))
    output, _ = run_step(scheduler, runner)
    assert output.num_scheduled_tokens == {"a": 5, "b": 3}
    output, _ = run_step(scheduler, runner)
    assert output.num_scheduled_tokens == {"a": 5}


def test_without_chunked_prefill_a_prompt_waits_until_it_fits_whole() -> None:
    scheduler = make_scheduler(
        max_num_batched_tokens=16, max_model_len=16, enable_chunked_prefill=False
    )
    runner = FakeRunner(4)
    scheduler.add_request(make_request("a", list(range(10)), max_tokens=5))
    scheduler.add_request(make_request("b", list(range(100, 110)), max_tokens=1))
    output, _ = run_step(scheduler, runner)
    assert output.num_scheduled_tokens == {"a": 10}  # b would need 10 of the 6 left
    output, _ = run_step(scheduler, runner)
    assert output.num_scheduled_tokens == {"a": 1, "b": 10}


def test_without_chunked_prefill_a_too_long_prompt_is_passed_over_not_blocking() -> None:
    scheduler = make_scheduler(
        max_num_batched_tokens=16, max_model_len=16, enable_chunked_prefill=False
    )
    runner = FakeRunner(4)
    scheduler.add_request(make_request("a", list(range(10)), max_tokens=5))
    scheduler.add_request(make_request("big", list(range(100, 112)), max_tokens=1))
    scheduler.add_request(make_request("small", [7, 8, 9], max_tokens=1))
    output, _ = run_step(scheduler, runner)
    assert output.num_scheduled_tokens == {"a": 10, "small": 3}  # big (12) > 6 left
    assert [r.request_id for r in scheduler.waiting] == ["big"]  # kept its place
    output, _ = run_step(scheduler, runner)
    assert output.num_scheduled_tokens == {"a": 1, "big": 12}


def test_max_num_seqs_caps_running_requests() -> None:
    scheduler = make_scheduler(max_num_seqs=2)
    runner = FakeRunner(4)
    for name in "abc":
        scheduler.add_request(make_request(name, [ord(name)] * 3, max_tokens=3))
    output, _ = run_step(scheduler, runner)
    assert set(output.num_scheduled_tokens) == {"a", "b"}
    assert [r.request_id for r in scheduler.waiting] == ["c"]
    run_until_done(scheduler, runner)


def test_prefix_hit_is_reported_and_capped() -> None:
    scheduler = make_scheduler(block_size=4)
    runner = FakeRunner(4)
    scheduler.add_request(make_request("a", list(range(8)), max_tokens=1))
    run_until_done(scheduler, runner)
    scheduler.add_request(make_request("b", list(range(8)), max_tokens=1))
    output, core_outputs = run_step(scheduler, runner)
    [new] = output.scheduled_new_reqs
    assert new.num_computed_tokens == 4  # 8 cached, capped at 8 - 1 -> one block
    assert output.num_scheduled_tokens == {"b": 4}
    assert core_outputs[0].num_cached_tokens == 4


def test_preemption_recomputes_with_prefix_hits() -> None:
    # 6 blocks of 4: two requests of 8-token prompts fill 4 blocks; decoding exhausts the pool.
    scheduler = make_scheduler(num_blocks=6, block_size=4, max_model_len=24)
    runner = FakeRunner(4)
    scheduler.add_request(make_request("a", list(range(8)), max_tokens=10))
    scheduler.add_request(make_request("b", list(range(50, 58)), max_tokens=10))
    preempted_at = None
    for step in range(12):
        output, _ = run_step(scheduler, runner)
        if output.preempted_req_ids:
            preempted_at = step
            break
    assert preempted_at is not None
    assert output.preempted_req_ids == {"b"}  # FCFS preempts the most recently admitted
    victim = scheduler.requests["b"]
    assert victim.status is RequestStatus.PREEMPTED
    assert victim.num_preemptions == 1
    assert [r.request_id for r in scheduler.waiting] == ["b"]
    output_tokens_at_preemption = victim.output_token_ids

    # Re-admission sends the request in full, output tokens included, with prefix hits.
    output, _ = run_step(scheduler, runner)
    while victim.status is not RequestStatus.RUNNING:
        output, _ = run_step(scheduler, runner)
    [resumed] = [n for n in output.scheduled_new_reqs if n.req_id == "b"]
    assert resumed.output_token_ids == output_tokens_at_preemption
    assert resumed.output_token_ids
    # b's blocks were freed tail-first, so a's growth evicted b's suffix and its first
    # block survived as a prefix hit.
    assert resumed.num_computed_tokens == 4
    run_until_done(scheduler, runner)
    assert free_blocks(scheduler) == 6


def test_a_prefill_is_timed_from_first_admission_to_first_token() -> None:
    # Steps take 1 s (the clock moves while the runner runs). b's first 8 tokens are a's
    # cached blocks; its other 8 take two 4-token chunks: admitted at 2 s, first token at 4 s.
    clock = FakeClock()
    scheduler = make_scheduler(clock=clock, max_num_batched_tokens=4, block_size=4)
    runner = FakeRunner(4)

    def step_runs(*_: object) -> None:
        clock.advance(1.0)

    scheduler.add_request(make_request("a", list(range(8)), max_tokens=1))
    while scheduler.has_unfinished_requests():
        run_step(scheduler, runner, after_schedule=step_runs)
    b = make_request("b", list(range(16)), max_tokens=3)
    scheduler.add_request(b)
    assert b.first_scheduled_at_s is None and b.first_token_at_s is None
    while scheduler.has_unfinished_requests():
        run_step(scheduler, runner, after_schedule=step_runs)
    assert (b.first_scheduled_at_s, b.first_token_at_s) == (2.0, 4.0)
    assert b.num_cached_tokens == 8


def test_no_admission_in_a_step_that_preempted() -> None:
    scheduler = make_scheduler(num_blocks=4, block_size=4, max_model_len=16)
    runner = FakeRunner(4)
    scheduler.add_request(make_request("a", list(range(7)), max_tokens=8))
    scheduler.add_request(make_request("b", list(range(20, 27)), max_tokens=8))
    run_step(scheduler, runner)  # a: 2 blocks, b: 2 blocks, pool full
    run_step(scheduler, runner)  # both reach 8 computed tokens, still 2 blocks each
    scheduler.add_request(make_request("tiny", [99], max_tokens=1))
    output = scheduler.schedule()  # a needs a 3rd block -> b is preempted
    assert output.preempted_req_ids == {"b"}
    assert output.scheduled_new_reqs == []  # neither b nor "tiny" is admitted this step
    assert set(output.num_scheduled_tokens) == {"a"}
    scheduler.update_from_output(output, runner.execute(output))
    scheduler.check_invariants()


def test_victim_scheduled_earlier_in_the_step_is_unscheduled_and_uncached() -> None:
    from engine.kv_cache.hashing import hash_block_tokens
    from engine.scheduler.policies import PriorityPolicy

    scheduler = make_scheduler(num_blocks=4, block_size=4, max_model_len=16,
                               policy=PriorityPolicy())
    runner = FakeRunner(4)
    low_prompt = list(range(6))
    scheduler.add_request(make_request("low", low_prompt, max_tokens=8, priority=5))
    run_step(scheduler, runner)  # low: 6 computed, 7 tokens, 2 blocks
    scheduler.add_request(make_request("high", list(range(20, 28)), max_tokens=8, priority=0))
    run_step(scheduler, runner)  # low: 7 computed; high: 8 computed, 9 tokens; pool full
    assert [r.request_id for r in scheduler.running] == ["low", "high"]

    # low is scheduled first (its 8th token fills block 1, which is cached at once); then
    # high needs a 3rd block and the victim is low, already scheduled in this step.
    output = scheduler.schedule()
    assert output.preempted_req_ids == {"low"}
    assert output.num_scheduled_tokens == {"high": 1}
    assert output.total_num_scheduled_tokens == 1
    assert output.scheduled_cached_reqs.req_ids == ["high"]
    # The block low would have completed holds no KV: it must not stay a prefix-cache hit.
    low_tokens = scheduler.requests["low"].all_token_ids
    first = hash_block_tokens(None, low_tokens[:4])
    pool = scheduler.kv_cache_manager.block_pool
    assert pool.get_cached_block(first) is not None
    assert pool.get_cached_block(hash_block_tokens(first, low_tokens[4:8])) is None
    scheduler.update_from_output(output, runner.execute(output))
    scheduler.check_invariants()
    run_until_done(scheduler, runner)  # the runner checks every later hit's KV content


def test_abort_of_waiting_and_running_requests_frees_every_block() -> None:
    scheduler = make_scheduler(num_blocks=8, max_num_seqs=1, max_model_len=32)
    runner = FakeRunner(4)
    scheduler.add_request(make_request("run", list(range(10)), max_tokens=20))
    scheduler.add_request(make_request("wait", list(range(10)), max_tokens=20))
    run_step(scheduler, runner)
    assert free_blocks(scheduler) < 8
    scheduler.finish_requests(["run", "wait", "unknown"])
    scheduler.check_invariants()
    assert not scheduler.has_unfinished_requests()
    assert free_blocks(scheduler) == 8
    output = scheduler.schedule()
    assert output.finished_req_ids == {"run", "wait"}
    assert output.is_empty


def test_abort_between_schedule_and_update_drops_the_tokens() -> None:
    scheduler = make_scheduler()
    runner = FakeRunner(4)
    scheduler.add_request(make_request("a", [1, 2, 3], max_tokens=5))
    output = scheduler.schedule()
    runner_output = runner.execute(output)
    scheduler.finish_requests(["a"])
    assert scheduler.update_from_output(output, runner_output) == []
    scheduler.check_invariants()


@pytest.mark.parametrize(
    ("sampling", "tokens", "expected_tokens", "reason", "stop_reason"),
    [
        ({"max_tokens": 3}, [5, 6, 7, 8], [5, 6, 7], FinishReason.LENGTH, None),
        ({"max_tokens": 9}, [5, 0, 7], [5, 0], FinishReason.STOP, None),  # EOS is 0
        ({"max_tokens": 9, "ignore_eos": True}, [5, 0, 7], [5, 0, 7], FinishReason.LENGTH, None),
        ({"max_tokens": 9, "min_tokens": 3}, [0, 0, 0, 4], [0, 0, 0], FinishReason.STOP, None),
        ({"max_tokens": 9, "stop_token_ids": (6,)}, [5, 6, 7], [5, 6], FinishReason.STOP, 6),
        ({"max_tokens": 2}, [5, 0], [5, 0], FinishReason.STOP, None),  # stop wins over length
    ],
)
def test_stop_conditions(sampling, tokens, expected_tokens, reason, stop_reason) -> None:
    # Tokens beyond the script repeat 4 (a neutral token).
    scheduler = make_scheduler()
    runner = FakeRunner(4, sample=lambda req_id, pos: (tokens + [4] * 9)[pos - 3])
    scheduler.add_request(make_request("a", [1, 2, 3], eos_token_id=0, **sampling))
    generated, finish = [], None
    while scheduler.has_unfinished_requests():
        _, outputs = run_step(scheduler, runner)
        for output in outputs:
            generated += output.new_token_ids
            finish = output.finish_reason or finish
            last = output
    # Truncate to the stated expectation length when max_tokens allowed more neutral tokens.
    assert generated[: len(expected_tokens)] == expected_tokens
    if reason is FinishReason.LENGTH:
        assert len(generated) == sampling["max_tokens"]
    else:
        assert generated == expected_tokens
    assert finish is reason
    assert last.stop_reason == stop_reason
    assert free_blocks(scheduler) == 64


def test_max_model_len_caps_generation() -> None:
    scheduler = make_scheduler(max_model_len=8)
    runner = FakeRunner(4)
    scheduler.add_request(make_request("a", list(range(5)), max_tokens=None))
    outputs = []
    while scheduler.has_unfinished_requests():
        outputs += run_step(scheduler, runner)[1]
    assert sum(len(o.new_token_ids) for o in outputs) == 3
    assert outputs[-1].finish_reason is FinishReason.LENGTH


def test_several_tokens_in_one_step_stop_at_the_first_stop() -> None:
    from engine.outputs import ModelRunnerOutput

    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", [1, 2, 3], max_tokens=10, eos_token_id=0))
    output = scheduler.schedule()
    runner_output = ModelRunnerOutput(req_ids=["a"], sampled_token_ids=[[5, 0, 7]])
    [core_output] = scheduler.update_from_output(output, runner_output)
    assert core_output.new_token_ids == [5, 0]
    assert core_output.finish_reason is FinishReason.STOP
    scheduler.check_invariants()


def test_add_request_rejects_bad_input_without_change() -> None:
    scheduler = make_scheduler(max_model_len=16)
    scheduler.add_request(make_request("a", [1]))
    with pytest.raises(ValueError, match="already in use"):
        scheduler.add_request(make_request("a", [2]))
    with pytest.raises(ValueError, match="exceeds max_model_len"):
        scheduler.add_request(make_request("long", list(range(17))))
    assert list(scheduler.requests) == ["a"]
    scheduler.check_invariants()


def test_pool_too_small_for_one_sequence_is_rejected() -> None:
    with pytest.raises(ValueError, match="cannot hold one sequence"):
        make_scheduler(num_blocks=3, block_size=4, max_model_len=16)


def test_finish_requests_rejects_a_non_finished_status() -> None:
    scheduler = make_scheduler()
    with pytest.raises(ValueError, match="not a finished status"):
        scheduler.finish_requests(["a"], RequestStatus.RUNNING)


def test_a_held_back_request_computes_up_to_its_last_token_and_keeps_its_place() -> None:
    """The engine core holds back constrained requests whose grammar mask is late: they must
    not sample, so a prompt computes all but its last token and a decode sits the step out,
    keeping its blocks; the others run as usual."""
    scheduler = make_scheduler(block_size=4)
    runner = FakeRunner(4)
    scheduler.add_request(make_request("held", list(range(6)), max_tokens=4))
    scheduler.add_request(make_request("free", list(range(10, 15)), max_tokens=4))

    output = scheduler.schedule(held_back=frozenset({"held"}))
    assert output.num_scheduled_tokens == {"held": 5, "free": 5}
    outputs = scheduler.update_from_output(output, runner.execute(output))
    scheduler.check_invariants()
    assert [o.request_id for o in outputs if o.new_token_ids] == ["free"]

    output = scheduler.schedule()
    assert output.num_scheduled_tokens == {"held": 1, "free": 1}
    outputs = scheduler.update_from_output(output, runner.execute(output))
    assert sorted(o.request_id for o in outputs if o.new_token_ids) == ["free", "held"]

    blocks = free_blocks(scheduler)
    output = scheduler.schedule(held_back=frozenset({"held"}))
    assert output.num_scheduled_tokens == {"free": 1}
    scheduler.update_from_output(output, runner.execute(output))
    scheduler.check_invariants()
    assert free_blocks(scheduler) <= blocks
    assert [r.request_id for r in scheduler.running] == ["held", "free"]
    run_until_done(scheduler, runner)


class _FailingRetention(FCFSPolicy):
    """Raises on every retention decision, as a policy whose output parser broke would."""

    def retention(self, request, now_s):
        raise ValueError("Exceeds the limit (4300 digits) for integer string conversion")


class _Recorder:
    def __init__(self) -> None:
        self.events: list = []

    def started(self, event) -> None:
        pass

    def receive(self, event) -> bool:
        self.events.append(event)
        return True

    def close(self) -> None:
        pass


def test_a_policy_failing_on_a_finished_turn_costs_the_turn_its_pin_not_the_engine() -> None:
    scheduler = make_scheduler(block_size=4, policy=_FailingRetention())
    recorder = _Recorder()
    scheduler.subscribe(recorder)
    runner = FakeRunner(4)
    scheduler.add_request(make_request("turn", list(range(9)), max_tokens=2, job_id="J"))
    scheduler.add_request(make_request("plain", list(range(20, 29)), max_tokens=2))
    run_until_done(scheduler, runner)
    decided = [e for e in recorder.events if isinstance(e, events.RetentionDecided)]
    assert {e.request.request_id for e in decided} == {"turn", "plain"}  # plain's is inferred
    assert all(e.pin is None and e.inputs.source == POLICY_ERROR for e in decided)
    assert len(scheduler.pins) == 0 and free_blocks(scheduler) == scheduler.num_kv_blocks
    scheduler.add_request(make_request("after", list(range(40, 49)), max_tokens=2))
    run_until_done(scheduler, runner)  # the engine goes on
    assert not scheduler.has_unfinished_requests()
