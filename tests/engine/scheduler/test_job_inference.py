"""Job inference: a request without a job joins the job of the finished turn it continues."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from continuum.presets import CONTINUUM
from engine.config import SchedulerConfig
from engine.engine_args import EngineArgs
from engine.kv_cache.pins import PinReleaseReason
from engine.request import JobInfo, Request
from engine.sampling_params import SamplingParams
from engine.scheduler.policy import PolicyEnvironment
from engine.scheduler.tracer import SchedulerTracer
from estimator.ttl_estimator import ConstantTTLEstimator
from tests.engine.helpers import (
    FakeClock,
    FakeRunner,
    PinningPolicy,
    make_request,
    make_scheduler,
    run_step,
    run_until_done,
)
from tracing.reader import read_trace
from tracing.records import JobEnded, PinReleased, RequestArrived

BLOCK_SIZE = 4
FIRST_PROMPT = list(range(10, 20))  # two full blocks and a tail of two tokens
OUTPUT_TOKEN = 1  # what the fake runner samples
RE_RENDERED = [90, 91, 92]  # the previous output as a chat template renders it back
TOOL_RESULT = [60, 61, 62, 63, 64]


def _next_prompt(prompt: list[int]) -> list[int]:
    """The next turn of a chat: the conversation so far, the assistant's reply re-rendered
    (not the sampled tokens), and a tool result."""
    return [*prompt, *RE_RENDERED, *TOOL_RESULT]


def _setup(policy=None, clock=None, **kwargs):
    clock = FakeClock() if clock is None else clock
    scheduler = make_scheduler(block_size=BLOCK_SIZE, policy=policy or PinningPolicy(),
                               clock=clock, **kwargs)
    return scheduler, FakeRunner(BLOCK_SIZE), clock


def _turn(scheduler, runner, request_id, prompt, **kwargs) -> Request:
    request = make_request(request_id, prompt, max_tokens=3, **kwargs)
    scheduler.add_request(request)
    run_until_done(scheduler, runner)
    return request


def _salted(request_id: str, prompt: list[int], cache_salt: str) -> Request:
    return Request(request_id, prompt, SamplingParams(max_tokens=3), arrival_time_s=0.0,
                   cache_salt=cache_salt)


def test_a_request_without_a_job_starts_an_inferred_job_and_its_next_turn_joins_it():
    scheduler, runner, _ = _setup()
    first = _turn(scheduler, runner, "first", FIRST_PROMPT)
    assert first.job is not None and first.job.inferred
    job_id = first.job_id
    assert job_id.startswith("~inferred/") and job_id.endswith("/first")
    pin = scheduler.pins.get(job_id)  # the policy pins every turn of a job, inferred or not
    assert pin is not None and pin.request_id == "first"

    second = make_request("second", _next_prompt(FIRST_PROMPT), max_tokens=3)
    scheduler.add_request(second)
    assert second.job == JobInfo(job_id=job_id, inferred=True)
    run_until_done(scheduler, runner)
    assert pin.release_reason is PinReleaseReason.REUSED
    # The hit covers the first turn's prompt and output up to the re-rendered block.
    assert second.num_cached_tokens == len(FIRST_PROMPT) // BLOCK_SIZE * BLOCK_SIZE
    assert scheduler.pins.get(job_id).request_id == "second"


def test_the_whole_previous_prompt_must_be_continued():
    scheduler, runner, _ = _setup()
    first = _turn(scheduler, runner, "first", FIRST_PROMPT)
    same_blocks_other_tail = [*FIRST_PROMPT[:8], 77, 78, *RE_RENDERED]  # another question
    resent = FIRST_PROMPT  # the same prompt again (a regenerate), not a continuation
    for request_id, prompt in (("other", same_blocks_other_tail), ("resent", resent)):
        request = make_request(request_id, prompt, max_tokens=3)
        scheduler.add_request(request)
        assert request.job.inferred and request.job_id != first.job_id
        run_until_done(scheduler, runner)


def test_an_explicit_job_always_wins_and_leaves_the_table_alone():
    scheduler, runner, _ = _setup()
    first = _turn(scheduler, runner, "first", FIRST_PROMPT)
    explicit = _turn(scheduler, runner, "explicit", _next_prompt(FIRST_PROMPT), job_id="mine")
    assert explicit.job == JobInfo(job_id="mine")
    later = make_request("later", _next_prompt(FIRST_PROMPT), max_tokens=3)
    scheduler.add_request(later)
    assert later.job_id == first.job_id  # the inferred job's turn was still there to continue


def test_one_tenant_never_joins_another_tenants_job():
    scheduler, runner, _ = _setup()
    first = _salted("a-first", FIRST_PROMPT, "tenant-a\x00")
    scheduler.add_request(first)
    run_until_done(scheduler, runner)
    intruder = _salted("b-next", _next_prompt(FIRST_PROMPT), "tenant-b\x00")
    scheduler.add_request(intruder)
    assert intruder.job.inferred and intruder.job_id != first.job_id
    own = _salted("a-next", _next_prompt(FIRST_PROMPT), "tenant-a\x00")
    scheduler.add_request(own)
    assert own.job_id == first.job_id
    run_until_done(scheduler, runner)


def test_tenants_that_share_the_prefix_cache_still_never_join_each_others_jobs():
    scheduler, runner, _ = _setup()

    def unsalted(request_id: str, prompt: list[int], tenant: str) -> Request:
        return Request(request_id, prompt, SamplingParams(max_tokens=3), arrival_time_s=0.0,
                       tenant=tenant)

    first = unsalted("a-first", FIRST_PROMPT, "alpha")
    scheduler.add_request(first)
    run_until_done(scheduler, runner)
    intruder = unsalted("b-next", _next_prompt(FIRST_PROMPT), "beta")
    intruder.continues_request_id = "a-first"  # even naming alpha's turn
    scheduler.add_request(intruder)
    assert intruder.job.inferred and intruder.job_id != first.job_id
    run_until_done(scheduler, runner)
    assert intruder.num_cached_tokens >= 8  # the cache is shared; the job is not
    own = unsalted("a-next", _next_prompt(FIRST_PROMPT), "alpha")
    scheduler.add_request(own)
    assert own.job_id == first.job_id
    run_until_done(scheduler, runner)


def test_runs_that_answered_alike_are_continued_latest_first():
    # Identical turns: the continuation joins the one that finished last, then the next one
    # the other; neither starts a job of its own.
    scheduler, runner, clock = _setup()
    twin_a = _turn(scheduler, runner, "twin-a", FIRST_PROMPT)
    clock.advance(1.0)
    twin_b = _turn(scheduler, runner, "twin-b", FIRST_PROMPT)
    assert twin_a.job_id != twin_b.job_id
    next_b = make_request("next-b", _next_prompt(FIRST_PROMPT), max_tokens=3)
    scheduler.add_request(next_b)
    next_a = make_request("next-a", _next_prompt(FIRST_PROMPT), max_tokens=3)
    scheduler.add_request(next_a)
    assert (next_b.job_id, next_a.job_id) == (twin_b.job_id, twin_a.job_id)
    run_until_done(scheduler, runner)


def test_runs_after_two_concurrent_identical_runs_are_one_job_each():
    # Two runs of one script, turn by turn together, then four more one after the other:
    # every turn of a later run joins that run's own first turn, none starts a job.
    scheduler, runner, clock = _setup()

    def run_turns(run: str, prompts: list[list[int]]) -> list[Request]:
        return [make_request(f"{run}-{index}", prompt, max_tokens=3)
                for index, prompt in enumerate(prompts)]

    prompts = [FIRST_PROMPT]
    for _ in range(2):
        prompts.append(_next_prompt(prompts[-1]))
    pair = [run_turns(run, prompts) for run in ("a", "b")]
    for index in range(len(prompts)):
        for turns in pair:
            scheduler.add_request(turns[index])
        run_until_done(scheduler, runner)
        clock.advance(1.0)
    assert len({turn.job_id for turns in pair for turn in turns}) == 2
    for run in ("c", "d", "e", "f"):
        turns = run_turns(run, prompts)
        for turn in turns:
            scheduler.add_request(turn)
            run_until_done(scheduler, runner)
            clock.advance(1.0)
        assert len({turn.job_id for turn in turns}) == 1, run
        assert turns[0].job_id not in {turn.job_id for turns in pair for turn in turns}


def _sampling_by_request(outputs: dict[str, list[int]]):
    """A runner's `sample` giving each named request its own output tokens (else 1)."""
    def sample(request_id: str, position: int) -> int:
        tokens = outputs.get(request_id)
        if tokens is None:
            return OUTPUT_TOKEN
        return tokens[(position - len(FIRST_PROMPT)) % len(tokens)]
    return sample


def test_the_output_a_continuation_repeats_decides_between_rollouts_of_one_prompt():
    outputs = {"roll-a": [40, 41, 42], "roll-b": [40, 51, 52], "roll-c": [40, 41, 62]}
    scheduler, _, _ = _setup()
    runner = FakeRunner(BLOCK_SIZE, _sampling_by_request(outputs))
    rollouts = {request_id: make_request(request_id, FIRST_PROMPT, max_tokens=3)
                for request_id in outputs}
    for request in rollouts.values():
        scheduler.add_request(request)
    run_until_done(scheduler, runner)
    # Each continuation re-renders its rollout's answer: all of it comes back, except for
    # `roll-c`, whose last token is rendered otherwise.
    continuations = {}
    for request_id, output in outputs.items():
        kept = output[:2] if request_id == "roll-c" else output
        prompt = [*FIRST_PROMPT, *kept, 99, *TOOL_RESULT]
        continuations[request_id] = make_request(f"next-{request_id}", prompt, max_tokens=3)
    for request_id in ("roll-b", "roll-a"):
        scheduler.add_request(continuations[request_id])
        assert continuations[request_id].job_id == rollouts[request_id].job_id
    # `roll-c`'s continuation repeats [40, 41] as `roll-a`'s would have; `roll-a` is taken.
    scheduler.add_request(continuations["roll-c"])
    assert continuations["roll-c"].job_id == rollouts["roll-c"].job_id
    run_until_done(scheduler, runner)


def test_a_re_sent_tool_call_binds_the_continuation_to_the_turn_that_issued_it():
    scheduler, runner, _ = _setup()
    twins = [_turn(scheduler, runner, f"twin-{index}", FIRST_PROMPT) for index in range(4)]
    order = [2, 0, 3, 1]
    continuations = []
    for index in order:
        request = make_request(f"next-{index}", _next_prompt(FIRST_PROMPT), max_tokens=3)
        request.continues_request_id = f"twin-{index}"
        scheduler.add_request(request)
        continuations.append(request)
    assert [request.job_id for request in continuations] == [twins[i].job_id for i in order]
    run_until_done(scheduler, runner)


def test_a_named_turn_that_the_prompt_does_not_continue_is_not_joined():
    scheduler, runner, _ = _setup()
    first = _turn(scheduler, runner, "first", FIRST_PROMPT)
    other = make_request("other", [*FIRST_PROMPT[:8], 77, 78, *RE_RENDERED], max_tokens=3)
    other.continues_request_id = "first"  # a forged or stale call id
    scheduler.add_request(other)
    assert other.job.inferred and other.job_id != first.job_id
    unknown = make_request("unknown", _next_prompt(FIRST_PROMPT), max_tokens=3)
    unknown.continues_request_id = "never-ran"
    scheduler.add_request(unknown)
    assert unknown.job_id == first.job_id  # matched by its prompt, as without a name
    run_until_done(scheduler, runner)


def test_an_aborted_continuation_gives_its_turn_back_and_an_aborted_first_turn_ends_its_job(
    tmp_path: Path,
):
    path = tmp_path / "trace.jsonl"
    scheduler, runner, _ = _setup(tracer=SchedulerTracer(path))
    first = _turn(scheduler, runner, "first", FIRST_PROMPT)
    attempt = make_request("attempt", _next_prompt(FIRST_PROMPT), max_tokens=3)
    scheduler.add_request(attempt)
    scheduler.finish_requests(["attempt"])
    scheduler.check_invariants()
    retry = make_request("retry", _next_prompt(FIRST_PROMPT), max_tokens=3)
    scheduler.add_request(retry)
    assert attempt.job_id == retry.job_id == first.job_id
    run_until_done(scheduler, runner)

    lone = make_request("lone", [30, 31, 32, 33, 34], max_tokens=3)
    scheduler.add_request(lone)
    scheduler.finish_requests(["lone"])
    scheduler.check_invariants()
    assert len(scheduler.job_inference) == 1  # the retry's turn; nothing of "lone"
    scheduler.close_subscribers()
    ended = [e.job_id for e in read_trace(path).events if isinstance(e, JobEnded)]
    assert ended == [lone.job_id]


def test_a_released_inferred_job_is_not_continued():
    scheduler, runner, _ = _setup()
    first = _turn(scheduler, runner, "first", FIRST_PROMPT)
    assert scheduler.end_job(first.job_id) is not None  # DELETE /v1/jobs/...: its pin goes
    assert len(scheduler.job_inference) == 0
    after = make_request("after", _next_prompt(FIRST_PROMPT), max_tokens=3)
    scheduler.add_request(after)
    assert after.job_id != first.job_id
    run_until_done(scheduler, runner)


def test_the_table_is_bounded_in_turns_and_its_dropped_turns_end_their_jobs():
    scheduler, runner, _ = _setup(job_inference_max_turns=2)
    prompts = [[k, *FIRST_PROMPT] for k in (1, 2, 3)]
    turns = [_turn(scheduler, runner, f"t{k}", prompt) for k, prompt in enumerate(prompts)]
    assert len(scheduler.job_inference) == 2
    oldest = turns[0].job_id
    assert oldest not in scheduler.pins  # its job ended: the pin went with it
    assert scheduler.pins.num_released[PinReleaseReason.JOB_END] == 1
    late = make_request("late", _next_prompt(prompts[0]), max_tokens=3)
    scheduler.add_request(late)
    assert late.job_id != oldest
    newest = make_request("newest", _next_prompt(prompts[2]), max_tokens=3)
    scheduler.add_request(newest)
    assert newest.job_id == turns[2].job_id
    run_until_done(scheduler, runner)


def test_a_full_table_drops_the_turns_of_the_tenant_holding_the_most():
    """One tenant's flood of finished requests never pushes another tenant's turns out of
    the table while it holds more of it: the victim's job goes on."""
    scheduler, runner, _ = _setup(job_inference_max_turns=3)

    def turn(request_id: str, prompt: list[int], tenant: str) -> Request:
        request = Request(request_id, prompt, SamplingParams(max_tokens=3), arrival_time_s=0.0,
                          tenant=tenant)
        scheduler.add_request(request)
        run_until_done(scheduler, runner)
        return request

    victim = turn("victim-1", FIRST_PROMPT, "victim")
    flood = [turn(f"flood-{k}", [k, *FIRST_PROMPT], "flood") for k in range(6)]
    assert len(scheduler.job_inference) == 3
    assert scheduler.pins.get(victim.job_id) is not None
    assert [request.job_id in scheduler.pins for request in flood] == [False] * 4 + [True] * 2
    scheduler.check_invariants()
    following = Request("victim-2", _next_prompt(FIRST_PROMPT), SamplingParams(max_tokens=3),
                        arrival_time_s=0.0, tenant="victim")
    scheduler.add_request(following)
    assert following.job_id == victim.job_id
    run_until_done(scheduler, runner)


def test_between_tenants_holding_as_many_turns_the_oldest_turn_goes():
    scheduler, runner, clock = _setup(job_inference_max_turns=4)

    def turn(request_id: str, prompt: list[int], tenant: str) -> Request:
        clock.advance(1.0)
        request = Request(request_id, prompt, SamplingParams(max_tokens=3),
                          arrival_time_s=clock(), tenant=tenant)
        scheduler.add_request(request)
        run_until_done(scheduler, runner)
        return request

    first = turn("a-1", [1, *FIRST_PROMPT], "alpha")
    oldest = turn("b-1", [2, *FIRST_PROMPT], "beta")
    kept = turn("a-2", [3, *FIRST_PROMPT], "alpha")
    turn("a-1-next", _next_prompt([1, *FIRST_PROMPT]), "alpha")  # alpha's first turn left
    turn("b-2", [4, *FIRST_PROMPT], "beta")
    turn("c-1", [5, *FIRST_PROMPT], "gamma")  # alpha and beta hold two turns each
    assert oldest.job_id not in scheduler.pins and kept.job_id in scheduler.pins
    assert first.job_id in scheduler.pins
    scheduler.check_invariants()


def test_turns_of_two_jobs_may_share_a_request_id():
    """Clients of the Python API choose request ids and may reuse one for turns of two
    inferred jobs: the id names the later turn, and both turns leave the table cleanly (its
    index once lost the earlier turn, and the sweep raised KeyError)."""
    scheduler, runner, clock = _setup()
    earlier = _turn(scheduler, runner, "x", FIRST_PROMPT)
    later = _turn(scheduler, runner, "x", [30, 31, 32, 33, 34, 35, 36, 37, 38])
    assert earlier.job_id != later.job_id and len(scheduler.job_inference) == 2
    scheduler.check_invariants()
    named = make_request("named", [*later.prompt_token_ids, *RE_RENDERED], max_tokens=3)
    named.continues_request_id = "x"
    scheduler.add_request(named)
    assert named.job_id == later.job_id
    earlier_named = make_request("earlier-named", _next_prompt(FIRST_PROMPT), max_tokens=3)
    earlier_named.continues_request_id = "x"  # the id's older turn, which its prompt continues
    scheduler.add_request(earlier_named)
    assert earlier_named.job_id == earlier.job_id
    run_until_done(scheduler, runner)
    scheduler.check_invariants()
    clock.advance(10_000.0)
    assert set(scheduler.sweep().forgotten_job_ids) == {earlier.job_id, later.job_id}
    assert len(scheduler.job_inference) == 0
    scheduler.check_invariants()


def test_a_turn_too_old_is_not_continued_and_the_sweep_ends_its_job():
    scheduler, runner, clock = _setup(policy=PinningPolicy(ttl_s=1000.0),
                                      job_inference_max_age_s=5.0)
    first = _turn(scheduler, runner, "first", FIRST_PROMPT)
    pin = scheduler.pins.get(first.job_id)
    assert pin.ttl_s == 5.0  # capped: after 5 s no turn could take it over
    clock.advance(5.5)
    stale = make_request("stale", _next_prompt(FIRST_PROMPT), max_tokens=3)
    scheduler.add_request(stale)  # before any sweep: the lookup skips the old turn
    assert stale.job_id != first.job_id
    run_until_done(scheduler, runner)
    assert pin.release_reason is PinReleaseReason.EXPIRED  # then its job ended
    assert len(scheduler.job_inference) == 1  # only "stale" is left

    clock.advance(6.0)
    sweep = scheduler.sweep()
    assert sweep.forgotten_job_ids == (stale.job_id,)
    assert len(scheduler.job_inference) == 0 and len(scheduler.pins) == 0


def test_inference_can_be_turned_off():
    scheduler, runner, _ = _setup(job_inference=False)
    first = _turn(scheduler, runner, "first", FIRST_PROMPT)
    second = _turn(scheduler, runner, "second", _next_prompt(FIRST_PROMPT))
    assert first.job is None and second.job is None and scheduler.job_inference is None
    assert len(scheduler.pins) == 0


def test_only_the_scheduler_makes_inferred_jobs():
    with pytest.raises(ValueError, match="reserved for inferred jobs"):
        JobInfo(job_id="~inferred/0/x")
    with pytest.raises(ValueError, match="reserved for inferred jobs"):
        JobInfo(job_id="plain", inferred=True)
    scheduler, _, _ = _setup()
    forged = Request("forged", FIRST_PROMPT, SamplingParams(max_tokens=3), arrival_time_s=0.0,
                     job=JobInfo(job_id="~inferred/0/x", inferred=True))
    with pytest.raises(ValueError, match="only the scheduler infers jobs"):
        scheduler.add_request(forged)
    assert not scheduler.has_unfinished_requests()


def _tool_call_decoder(token_ids) -> str:
    """Outputs holding token 7 are a Hermes tool call; others plain text."""
    if 7 in token_ids:
        return '<tool_call>\n{"name": "bash", "arguments": {"command": "ls"}}\n</tool_call>'
    return "All done."


def test_continuum_orders_an_inferred_turn_as_its_job_and_pins_only_tool_calls():
    clock = FakeClock()
    policy = CONTINUUM.build(estimator=ConstantTTLEstimator(30.0))
    scheduler = make_scheduler(block_size=BLOCK_SIZE, policy=policy, clock=clock,
                               max_num_seqs=1,
                               environment=PolicyEnvironment(decode=_tool_call_decoder))
    runner = FakeRunner(BLOCK_SIZE, sample=lambda req_id, position: 7 if "tool" in req_id
                        else OUTPUT_TOKEN)
    tool_turn = _turn(scheduler, runner, "tool-1", FIRST_PROMPT)
    chat = _turn(scheduler, runner, "chat", [40, *FIRST_PROMPT])
    assert scheduler.pins.get(tool_turn.job_id) is not None  # it called a tool: pinned
    assert scheduler.pins.get(chat.job_id) is None  # it called none: not pinned

    clock.advance(1.0)
    hog = make_request("hog", [50, 51, 52, 53, 54], max_tokens=4)
    scheduler.add_request(hog)
    run_step(scheduler, runner)  # the hog runs: max_num_seqs = 1
    newcomer = make_request("newcomer", [55, 56, 57, 58, 59], max_tokens=1)
    continuation = make_request("tool-2", _next_prompt(FIRST_PROMPT), max_tokens=1)
    scheduler.add_request(newcomer)
    scheduler.add_request(continuation)
    assert continuation.job_id == tool_turn.job_id
    admitted = []
    while scheduler.has_unfinished_requests():
        output, _ = run_step(scheduler, runner)
        admitted += [new.req_id for new in output.scheduled_new_reqs]
    # The older job's turn, which holds a pin, goes before the newer request.
    assert admitted == ["tool-2", "newcomer"]
    books = policy.job_state(tool_turn.job_id)
    assert books["num_turns_finished"] == 2 and books["pins_released"] == {"reused": 1}


def test_the_trace_records_the_inference_and_the_jobs_it_ends(tmp_path: Path):
    path = tmp_path / "trace.jsonl"
    scheduler, runner, clock = _setup(tracer=SchedulerTracer(path),
                                      job_inference_max_age_s=5.0)
    first = _turn(scheduler, runner, "first", FIRST_PROMPT)
    second = _turn(scheduler, runner, "second", _next_prompt(FIRST_PROMPT))
    explicit = _turn(scheduler, runner, "explicit", [70, 71, 72, 73, 74], job_id="mine",
                     is_last_step=True)
    clock.advance(6.0)
    scheduler.sweep()
    scheduler.close_subscribers()

    events = read_trace(path).events
    arrived = {e.request_id: e for e in events if isinstance(e, RequestArrived)}
    assert (arrived["first"].job_id, arrived["first"].job_inferred,
            arrived["first"].inferred_from) == (first.job_id, True, None)
    assert (arrived["second"].job_id, arrived["second"].job_inferred,
            arrived["second"].inferred_from) == (first.job_id, True, "first")
    assert (arrived["explicit"].job_inferred, arrived["explicit"].inferred_from) == (False, None)
    assert second.job_id == first.job_id and explicit.job_id == "mine"
    ended = [(e.job_id, e.reason) for e in events if isinstance(e, JobEnded)]
    assert ended == [("mine", "job_end"), (first.job_id, "job_end")]
    released = [(e.request_id, e.reason) for e in events if isinstance(e, PinReleased)]
    # The last pin's TTL was capped at the table's age: it ran out before its job ended.
    assert released == [("first", "reused"), ("explicit", "job_end"), ("second", "expired")]


def test_the_config_bounds_and_the_serve_flags():
    assert SchedulerConfig().job_inference is True
    for bad in ({"job_inference_max_turns": 0}, {"job_inference_max_age_s": 0.0},
                {"job_inference_max_age_s": float("inf")}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            SchedulerConfig(**bad)
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    args = parser.parse_args(["--no-job-inference", "--job-inference-max-turns", "8",
                              "--job-inference-max-age-s", "12.5"])
    engine_args = EngineArgs.from_cli_args(args)
    assert "--no-job-inference" in EngineArgs.cli_flags(args)
    config = engine_args.to_engine_config().scheduler
    assert (config.job_inference, config.job_inference_max_turns,
            config.job_inference_max_age_s) == (False, 8, 12.5)



@settings(max_examples=150, deadline=None)
@given(
    max_turns=st.integers(1, 3),
    max_age_s=st.sampled_from([0.5, 2.0, 100.0]),
    script=st.lists(st.tuples(st.integers(0, 2), st.sampled_from(["turn", "abort", "wait"]),
                              st.integers(1, 6)), max_size=25),
)
def test_random_conversations_keep_the_table_and_the_pins_consistent(max_turns, max_age_s,
                                                                      script):
    """Conversations that take turns, abort them, and pause; the scheduler checks the table
    (no inferred pin outliving its job among them) after every step and sweep."""
    scheduler, runner, clock = _setup(job_inference_max_turns=max_turns,
                                      job_inference_max_age_s=max_age_s, max_model_len=256)
    history: dict[int, list[int]] = {}
    previous_job: dict[int, str] = {}
    for number, (conversation, action, size) in enumerate(script):
        if action == "wait":
            clock.advance(size * 0.5)
            scheduler.sweep()
            scheduler.check_invariants()
            continue
        prompt = [*history.get(conversation, [200 + conversation]), *range(30, 30 + size)]
        request = make_request(f"r{number}", prompt, max_tokens=2)
        scheduler.add_request(request)
        assert request.job.inferred
        if action == "abort":
            run_step(scheduler, runner)
            scheduler.finish_requests([request.request_id])
            scheduler.check_invariants()
            continue
        run_until_done(scheduler, runner)
        if max_turns == 3 and max_age_s == 100.0 and conversation in previous_job:
            # Room for every conversation, no turn too old: the previous turn was there.
            assert request.job_id == previous_job[conversation]
        history[conversation] = [*prompt, *RE_RENDERED]
        if len(prompt) >= BLOCK_SIZE:  # a shorter prompt cannot be recognised
            previous_job[conversation] = request.job_id
        else:
            previous_job.pop(conversation, None)
    assert len(scheduler.job_inference) <= max_turns
    clock.advance(max_age_s + 1.0)
    scheduler.sweep()  # PinningPolicy never expires a pin: only the jobs' ends release them
    assert len(scheduler.job_inference) == 0 and len(scheduler.pins) == 0
    scheduler.check_invariants()
