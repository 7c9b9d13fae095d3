"""Bounded waiting under the program-level policies: no request waits unboundedly behind
other jobs, with a fake clock."""

from __future__ import annotations

import math

import pytest

from continuum.options import ContinuumOptions, ProgramOrderOptions
from continuum.presets import CONTINUUM, JOB_FCFS
from engine.kv_cache.pins import PinReleaseReason
from engine.scheduler.policy import SchedulingPolicy
from estimator.base import ConstantTTLEstimator
from eval.policy_variants import CONTINUUM_AF226D3, Af226d3Options
from tests.continuum.harness import Harness, tokens

UNBOUNDED = {"max_job_age_s": math.inf, "max_wait_s": math.inf, "max_plain_wait_s": math.inf}
STEP_S = 0.05


def flood_until_admitted(policy: SchedulingPolicy, *, duration_s: float) -> float | None:
    """An old job keeps four non-final turns in flight (each a fresh 24-token prompt, one
    output token); 1 s in, a plain 40-token request arrives. Returns how long the plain
    request waited before admission, or None if the flood outlasted `duration_s` first."""
    h = Harness(policy, num_blocks=32, max_num_batched_tokens=64)
    serial = 0
    plain = None
    while h.clock() < duration_s:
        unfinished = [r for r in h.requests.values() if r.job_id == "old" and not r.is_finished]
        for _ in range(4 - len(unfinished)):
            h.add(f"old#{serial}", tokens(1000 + 100 * serial, 24), job="old", max_tokens=1)
            serial += 1
        if plain is None and h.clock() >= 1.0:
            plain = h.add("plain", tokens(50, 40), max_tokens=2)
        h.step(dt_s=STEP_S)
        if plain is not None and "plain" in h.admitted():
            return h.clock() - STEP_S - plain.arrival_time_s
    return None


def af226d3(options: dict) -> SchedulingPolicy:
    return CONTINUUM_AF226D3.build(Af226d3Options(**options),
                                   estimator=ConstantTTLEstimator(5.0))


def test_af226d3_starved_a_plain_request_without_its_bounds() -> None:
    # Without the bounds, the old job's turns always sorted first: the plain request starved.
    assert flood_until_admitted(af226d3(UNBOUNDED), duration_s=20.0) is None
    # With them, it headed the queue once it waited max_wait_s, and pins gave way to it.
    bounded = {"max_job_age_s": 60.0, "max_wait_s": 2.0}
    waited_s = flood_until_admitted(af226d3(bounded), duration_s=20.0)
    assert waited_s is not None and waited_s <= 2.0 + 4 * STEP_S


@pytest.mark.parametrize("make_policy", [
    lambda options: CONTINUUM.build(ContinuumOptions(**options),
                                    estimator=ConstantTTLEstimator(5.0)),
    lambda options: JOB_FCFS.build(ProgramOrderOptions(**options)),
], ids=["continuum", "job-fcfs"])
def test_a_plain_request_goes_ahead_of_the_turns_that_arrive_after_it(make_policy) -> None:
    # Even with every bound off, the old job's later turns cannot pass it.
    waited_s = flood_until_admitted(make_policy(UNBOUNDED), duration_s=20.0)
    assert waited_s is not None and waited_s <= 4 * STEP_S


def test_with_the_default_bounds_a_plain_request_waits_at_most_its_own_bound() -> None:
    # The old job always holds a pin, so its turns are in the pinned tier and its pins would
    # keep memory from a later plain request: both give way once it waited max_plain_wait_s.
    policy = CONTINUUM.build(estimator=ConstantTTLEstimator(5.0))
    waited_s = flood_until_admitted(policy, duration_s=40.0)
    assert waited_s is not None and waited_s <= 10.0 + 4 * STEP_S


def test_aging_caps_how_far_ahead_an_old_jobs_turn_sorts() -> None:
    policy = JOB_FCFS.build(ProgramOrderOptions(max_job_age_s=3.0, max_wait_s=math.inf))
    h = Harness(policy, max_num_seqs=1)
    h.add("old#0", tokens(1, 8), job="old", max_tokens=1)
    h.run_until_finished("old#0")
    h.clock.advance(10.0)
    h.add("busy", tokens(100, 8), max_tokens=50)
    h.step()  # busy runs alone (max_num_seqs 1); the rest waits behind it
    h.add("new", tokens(200, 8), job="new", max_tokens=1)  # a new job at 10 s
    h.clock.advance(2.0)
    h.add("old#1", tokens(300, 8), job="old", max_tokens=1)  # 12 s: sorts as of 9 s
    h.clock.advance(2.0)
    h.add("old#2", tokens(400, 8), job="old", max_tokens=1)  # 14 s: sorts as of 11 s
    assert h.waiting_ids == ["old#1", "new", "old#2"]


def test_pins_hold_at_most_their_share_of_the_pool_later_jobs_first() -> None:
    # 32 blocks, pins capped at half: each job's turn pins 3 blocks.
    policy = CONTINUUM.build(ContinuumOptions(max_pinned_fraction=0.5),
                             estimator=ConstantTTLEstimator(100.0))
    h = Harness(policy, num_blocks=32)
    for index in range(6):
        h.add(f"j{index}#0", tokens(100 * (index + 1), 10), job=f"j{index}", max_tokens=3)
        h.run_until_finished(f"j{index}#0")
    assert [f"j{i}" in h.scheduler.pins for i in range(6)] == [True] * 5 + [False]
    assert h.scheduler.pins.num_pinned_blocks == 15 <= 16
    # An older job's new pin pushes out the latest job's.
    h.next_turn("j0#1", "j0#0", tokens(900, 8), max_tokens=3)  # pins 5 blocks
    h.run_until_finished("j0#1")
    assert "j0" in h.scheduler.pins and "j4" not in h.scheduler.pins
    assert h.scheduler.pins.num_released[PinReleaseReason.PRESSURE] == 1
    assert h.scheduler.pins.num_pinned_blocks <= 16
