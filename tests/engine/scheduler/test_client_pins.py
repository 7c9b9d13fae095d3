"""A client's cache breakpoint is kept as its job's pin: the blocks of the prompt up to the
breakpoint, for the client's TTL, unless the policy's own pin lasts longer; a client's pin
is the first to go when any request cannot get blocks."""

from __future__ import annotations

import pytest

from engine.kv_cache.pins import PinReleaseReason
from engine.request import Request
from engine.sampling_params import CacheBreakpoint
from engine.scheduler.policies import FCFSPolicy
from engine.scheduler.scheduler import Scheduler
from tests.engine.helpers import (
    FakeClock,
    FakeRunner,
    PinningPolicy,
    make_request,
    make_scheduler,
    run_step,
)

PROMPT = list(range(1, 41))  # 10 blocks of 4


def _turn(request_id: str, prompt: list[int], *, job: str | None = "J",
          breakpoint_tokens: int | None = 32, ttl_s: float = 300.0, **kwargs) -> Request:
    ask = None if breakpoint_tokens is None else CacheBreakpoint(
        num_prompt_tokens=breakpoint_tokens, ttl_s=ttl_s)
    return make_request(request_id, prompt, job_id=job, cache_breakpoint=ask, **kwargs)


def _finish(scheduler: Scheduler, runner: FakeRunner, *requests: Request) -> None:
    for request in requests:
        scheduler.add_request(request)
    while scheduler.has_unfinished_requests():
        run_step(scheduler, runner)


def test_the_breakpoints_prefix_is_pinned_for_the_clients_ttl_and_hit_by_the_next_turn() -> None:
    clock = FakeClock(10.0)
    scheduler = make_scheduler(num_blocks=32, block_size=4, max_model_len=64,
                               policy=FCFSPolicy(), clock=clock)
    runner = FakeRunner(4)
    _finish(scheduler, runner, _turn("t1", PROMPT, max_tokens=3))
    pin = scheduler.pins.get("J")
    assert pin is not None and (pin.source, pin.ttl_s, pin.num_blocks) == ("client", 300.0, 8)
    clock.advance(200.0)
    # Meanwhile other prompts take every unpinned block: the turn's tail is evicted.
    _finish(scheduler, runner, make_request("x", [500 + t for t in range(44)], max_tokens=4),
            make_request("y", [800 + t for t in range(44)], max_tokens=4))
    second = _turn("t2", [*PROMPT, 90, 91], max_tokens=2)
    _finish(scheduler, runner, second)
    assert second.num_cached_tokens == 32  # the breakpoint's prefix, kept 200 s
    assert scheduler.pins.num_released[PinReleaseReason.REUSED] == 1
    assert scheduler.pins.get("J").deadline_s == clock() + 300.0  # refreshed by the hit


def test_a_request_without_a_job_is_pinned_under_its_inferred_job() -> None:
    scheduler = make_scheduler(num_blocks=32, block_size=4, max_model_len=64,
                               policy=FCFSPolicy(), job_inference=True)
    runner = FakeRunner(4)
    plain = _turn("plain", PROMPT, job=None)
    _finish(scheduler, runner, plain)
    [pin] = scheduler.pins
    assert plain.job is not None and plain.job.inferred and pin.job_id == plain.job.job_id


def test_no_job_or_no_breakpoint_or_an_abort_pins_nothing() -> None:
    scheduler = make_scheduler(num_blocks=32, block_size=4, max_model_len=64,
                               policy=FCFSPolicy(), job_inference=False)
    runner = FakeRunner(4)
    _finish(scheduler, runner, _turn("plain", PROMPT, job=None),
            _turn("unasked", PROMPT[:20], job="K", breakpoint_tokens=None))
    assert len(scheduler.pins) == 0
    scheduler.add_request(_turn("aborted", PROMPT, job="L"))
    run_step(scheduler, runner)
    scheduler.finish_requests(["aborted"])
    assert len(scheduler.pins) == 0


def test_the_pin_that_lasts_longer_wins() -> None:
    longer = make_scheduler(num_blocks=32, block_size=4, max_model_len=64,
                            policy=PinningPolicy(ttl_s=1000.0))
    _finish(longer, FakeRunner(4), _turn("t1", PROMPT, max_tokens=3, ttl_s=300.0))
    assert longer.pins.get("J").source == "policy"
    assert longer.pins.get("J").num_blocks == 10  # the whole turn's cached blocks
    shorter = make_scheduler(num_blocks=32, block_size=4, max_model_len=64,
                             policy=PinningPolicy(ttl_s=2.0))
    _finish(shorter, FakeRunner(4), _turn("t1", PROMPT, max_tokens=3, ttl_s=300.0))
    assert shorter.pins.get("J").source == "client"


def test_a_clients_pin_is_the_first_to_go_when_a_request_cannot_get_blocks() -> None:
    scheduler = make_scheduler(num_blocks=16, block_size=4, max_model_len=64,
                               policy=FCFSPolicy())
    runner = FakeRunner(4)
    _finish(scheduler, runner, _turn("t1", PROMPT, max_tokens=1))
    assert scheduler.pins.get("J").num_blocks == 8
    scheduler.add_request(make_request("busy", [7] * 8, max_tokens=30))
    run_step(scheduler, runner)
    # 10 blocks wanted, 6 free: FCFS would release pins only with nothing running.
    big = make_request("big", [9] * 40, max_tokens=2)
    scheduler.add_request(big)
    run_step(scheduler, runner)
    assert "J" not in scheduler.pins
    assert scheduler.pins.num_released[PinReleaseReason.CLIENT_PRESSURE] == 1
    assert big in scheduler.running and scheduler.num_preemptions == 0


def _two_tenants(num_blocks: int = 128) -> Scheduler:
    return make_scheduler(num_blocks=num_blocks, block_size=4,
                          max_model_len=min(512, 4 * num_blocks),
                          max_num_batched_tokens=512, policy=FCFSPolicy(), job_inference=False)


VICTIM_PROMPT = list(range(1000, 1100))  # 25 blocks


def test_a_tenant_over_its_share_never_takes_a_within_share_tenants_client_pin() -> None:
    # 128 blocks, two tenants (64 each). The victim pins 25 blocks for an hour; the attacker
    # grows two requests to 124 blocks: they preempt each other, the victim's pin stays, and
    # the victim's next turn reads its whole breakpoint prefix back.
    scheduler, runner = _two_tenants(), FakeRunner(4)
    _finish(scheduler, runner, _turn("v1", VICTIM_PROMPT, breakpoint_tokens=100, ttl_s=3600.0,
                                     tenant="victim", max_tokens=1))
    pin = scheduler.pins.get("J")
    assert pin is not None and pin.num_blocks == 25
    _finish(scheduler, runner,
            *(make_request(f"a{index}", [2000 + 10 * index + t for t in range(8)],
                           max_tokens=240, tenant="attacker") for index in range(2)))
    assert scheduler.pins.get("J") is pin and pin.release_reason is None
    assert scheduler.num_preemptions > 0  # the attacker's requests gave way to each other
    second = _turn("v2", [*VICTIM_PROMPT, 7, 8], tenant="victim", max_tokens=1)
    _finish(scheduler, runner, second)
    assert second.num_cached_tokens == 100


@pytest.mark.parametrize(("prompt_tokens", "released"), [(180, {"M"}), (220, {"M", "T"})])
def test_a_tenant_takes_its_own_client_pins_first_then_a_within_share_tenants(
        prompt_tokens: int, released: set[str]) -> None:
    # 64 blocks: tenant a's pin M and tenant b's pin T hold 10 each, 44 are free. A request
    # of tenant a (nothing else running: within its share) takes its own pin first, and
    # the other tenant's only when that is not enough.
    scheduler, runner = _two_tenants(64), FakeRunner(4)
    _finish(scheduler, runner,
            _turn("mine", VICTIM_PROMPT[:40], job="M", breakpoint_tokens=40, tenant="a",
                  max_tokens=1),
            _turn("theirs", VICTIM_PROMPT[40:80], job="T", breakpoint_tokens=40, tenant="b",
                  max_tokens=1))
    assert {pin.job_id for pin in scheduler.pins} == {"M", "T"}
    _finish(scheduler, runner, make_request("big", [5] * prompt_tokens, max_tokens=1,
                                            tenant="a"))
    assert {pin.job_id for pin in scheduler.pins} == {"M", "T"} - released
    assert scheduler.pins.num_released[PinReleaseReason.CLIENT_PRESSURE] == len(released)


def test_an_inferred_jobs_hour_long_breakpoint_is_kept_and_continued_for_the_hour() -> None:
    # The turn of an inferred job whose client asked for an hour is remembered as long as its
    # pin (not the inference table's 300 s), so that its next turn continues it and hits it.
    clock = FakeClock(0.0)
    scheduler = make_scheduler(num_blocks=64, block_size=4, max_model_len=128,
                               policy=FCFSPolicy(), clock=clock, job_inference=True,
                               job_inference_max_age_s=300.0)
    runner = FakeRunner(4)
    first = _turn("first", PROMPT, job=None, ttl_s=3600.0, max_tokens=2)
    _finish(scheduler, runner, first)
    pin = scheduler.pins.get(first.job_id)
    assert pin is not None and pin.ttl_s == 3600.0 and pin.source == "client"
    clock.advance(1800.0)
    scheduler.sweep()
    assert scheduler.pins.get(first.job_id) is pin
    second = _turn("second", [*first.all_token_ids, 70, 71], job=None, ttl_s=3600.0,
                   max_tokens=1)
    _finish(scheduler, runner, second)
    assert second.job_id == first.job_id and second.num_cached_tokens >= 32  # the breakpoint
    clock.advance(3601.0)
    scheduler.sweep()  # the hour is up: the pin and the job end
    assert len(scheduler.pins) == 0
