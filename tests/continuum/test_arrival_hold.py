"""`arrival_hold=until-admitted`: a job's next turn that arrives without a pin has the prefix it
finds cached held as its job's pin while it waits, so that blocks freed after it cannot push it
out of the free queue first; under pressure such holds are the first pins to go."""

from __future__ import annotations

import pytest

from continuum.af226d3 import ContinuumAf226d3Policy
from continuum.options import ArrivalHold, ContinuumAf226d3Options, ContinuumOptions
from continuum.policy import ContinuumPolicy
from engine.kv_cache.pins import Pin, PinReleaseReason
from engine.scheduler import events
from estimator.base import ConstantTTLEstimator
from tests.continuum.harness import Harness, tokens
from tests.continuum.test_victims import bind, describe
from tests.engine.helpers import make_request

BLOCK_SIZE = 4


class QueueingSpy(ConstantTTLEstimator):
    """Never pins; keeps the queueing delays the policy reports (Eq. 2's T)."""

    def __init__(self) -> None:
        super().__init__(0.0)
        self.delays_s: list[float] = []

    def observe_queueing_delay(self, delay_s: float) -> None:
        self.delays_s.append(delay_s)


class Retentions:
    """A subscriber keeping the sources of the retention decisions that pinned."""

    def __init__(self) -> None:
        self.sources: list[tuple[str, str]] = []

    def started(self, event: events.SchedulerStarted) -> None:
        pass

    def receive(self, event: events.SchedulerEvent) -> bool:
        if isinstance(event, events.RetentionDecided) and event.pin is not None:
            self.sources.append((event.request.request_id, event.inputs.source))
        return True

    def close(self) -> None:
        pass


def run_with_a_turn_waiting_behind_a_big_request(
        arrival_hold: ArrivalHold) -> tuple[Harness, QueueingSpy, Retentions]:
    """One request runs at a time in a pool of 20 blocks of 4 tokens. Job J's first turn
    (12 prompt tokens: 3 cached blocks) is not pinned; a plain request runs and frees its
    blocks behind J's; J's next turn arrives while a big request runs whose blocks reach past
    the free blocks never used: without a hold it evicts J's blocks before those freed later."""
    spy = QueueingSpy()
    h = Harness(ContinuumPolicy(ContinuumOptions(arrival_hold=arrival_hold), estimator=spy),
                num_blocks=20, block_size=BLOCK_SIZE, max_num_seqs=1)
    retentions = Retentions()
    h.scheduler.subscribe(retentions)
    h.add("t1", tokens(1, 12), job="J", max_tokens=2)
    h.run_until_finished("t1")
    h.add("p1", tokens(200, 12), max_tokens=2)
    h.run_until_finished("p1")
    h.add("big", tokens(300, 40), max_tokens=20)
    h.step()
    assert h.running_ids == ["big"]
    h.clock.advance(1.0)
    h.next_turn("t2", "t1", tokens(50, 3))
    h.step(dt_s=0.5)
    h.run_until_finished("big", "t2")
    return h, spy, retentions


def test_a_held_prefix_outlives_the_blocks_freed_after_it() -> None:
    held, spy, retentions = run_with_a_turn_waiting_behind_a_big_request("until-admitted")
    assert held.requests["t2"].num_cached_tokens == 12
    assert retentions.sources == [("t2", "arrival-hold")]
    assert held.scheduler.pins.num_released[PinReleaseReason.REUSED] == 1
    assert (held.scheduler.pins.num_created, held.scheduler.pins.num_holds_created) == (1, 1)
    assert held.pin("J") is None
    # The job's books count the pins its finished turns left, not the hold.
    job = held.policy.jobs.get("J")
    assert job is not None and job.num_pins_created == 0 and not job.pins_released
    # The turn came back without a pin all the same: its wait counts in Eq. 2's T.
    assert spy.delays_s == [0.5]
    unheld, _, none = run_with_a_turn_waiting_behind_a_big_request("none")
    assert unheld.requests["t2"].num_cached_tokens == BLOCK_SIZE  # the big request evicted two
    assert none.sources == []
    assert unheld.scheduler.pins.num_holds_created == 0


def test_the_hold_lasts_at_most_the_wait_bound() -> None:
    h, _, _ = run_with_a_turn_waiting_behind_a_big_request("until-admitted")
    policy = h.policy
    assert isinstance(policy, ContinuumPolicy)
    turn = h.add("t3", h.requests["t2"].all_token_ids + tokens(60, 3), job="J")
    assert policy.arrival_hold_s(turn, 12, h.clock()) == policy.options.max_wait_s
    first_turn = h.add("k1", tokens(400, 12), job="K")
    assert policy.arrival_hold_s(first_turn, 12, h.clock()) is None
    plain = h.add("plain", tokens(500, 12))
    assert policy.arrival_hold_s(plain, 12, h.clock()) is None


def a_turn_waiting_with_a_hold() -> Harness:
    """J's next turn waits, its 12-token prefix held, while a big request runs alone."""
    h = Harness(ContinuumPolicy(ContinuumOptions(arrival_hold="until-admitted"),
                                estimator=QueueingSpy()),
                num_blocks=20, block_size=BLOCK_SIZE, max_num_seqs=1)
    h.add("t1", tokens(1, 12), job="J", max_tokens=2)
    h.run_until_finished("t1")
    h.add("big", tokens(300, 40), max_tokens=20)
    h.step()
    h.next_turn("t2", "t1", tokens(50, 3))
    h.step()
    pin = h.pin("J")
    assert h.waiting_ids == ["t2"] and pin is not None and pin.holds_waiting_turn
    assert len(pin.blocks) == 3
    return h


def assert_no_block_held(h: Harness) -> None:
    pool = h.scheduler.kv_cache_manager.block_pool
    assert pool.num_free_blocks == pool.num_blocks
    assert len(h.scheduler.pins) == 0


@pytest.mark.parametrize("end", ["abort", "job-end"])
def test_a_hold_goes_with_its_turn_or_its_job(end: str) -> None:
    h = a_turn_waiting_with_a_hold()
    if end == "abort":
        h.scheduler.finish_requests(["t2"])
        expected = PinReleaseReason.ABORT
    else:
        h.scheduler.end_job("J")
        expected = PinReleaseReason.RELEASE  # DELETE /v1/jobs/J
    assert h.pin("J") is None
    assert h.scheduler.pins.num_released[expected] == 1
    h.scheduler.check_invariants()
    h.run_until_finished("big", "t2")  # an ended job's waiting turn still runs
    assert_no_block_held(h)


def test_a_hold_ends_at_the_wait_bound_and_its_turn_still_runs() -> None:
    h = a_turn_waiting_with_a_hold()
    policy = h.policy
    assert isinstance(policy, ContinuumPolicy)
    h.step(dt_s=policy.options.max_wait_s + 1.0)
    h.step()
    assert h.pin("J") is None
    assert h.scheduler.pins.num_released[PinReleaseReason.EXPIRED] == 1
    h.run_until_finished("big", "t2")
    assert_no_block_held(h)


@pytest.mark.parametrize(("pins", "held_job", "expected"), [
    # Holds of waiting turns' prefixes go before any other pin, whichever job's...
    ("J0 J3 J1", "J0", "pin:J0"),
    ("J0 J3", "J3", "pin:J3"),
    # ...the latest job's hold first when there are several.
    ("J1 J2", "J1 J2", "pin:J2"),
])
def test_a_hold_is_the_first_pin_a_running_request_takes(
        pins: str, held_job: str, expected: str) -> None:
    policy = ContinuumPolicy(ContinuumOptions(arrival_hold="until-admitted"))
    requests = bind(policy, "R", pins)
    stub_pins = policy.scheduler.pins
    for job_id in held_job.split():
        # The prefix of J's turn that arrived in `bind` and has not finished.
        stub_pins.pins[job_id] = Pin(job_id, f"{job_id}-first", [None],  # type: ignore[list-item]
                                     pinned_at_s=0.0, ttl_s=30.0, holds_waiting_turn=True)
    assert describe(policy.select_victim(requests["R"], 0.0)) == expected


def test_a_new_pin_under_the_cap_takes_holds_first() -> None:
    """Under `max_pinned_fraction`, room for a new pin comes from other jobs' holds before
    any pin of a later job."""
    policy = ContinuumPolicy(ContinuumOptions(arrival_hold="until-admitted",
                                              max_pinned_fraction=0.25))  # 16 of 64 blocks
    bind(policy, "R@J1", "J3", pin_blocks={"J3": 8})
    policy.scheduler.pins.pins["J0"] = Pin("J0", "J0-first", [None] * 8,  # type: ignore[list-item]
                                           pinned_at_s=0.0, ttl_s=30.0, holds_waiting_turn=True)
    request = make_request("R2", [1] * 16, job_id="J1")
    request.num_computed_tokens = 16  # 4 blocks of 4
    assert policy._pins_to_make_room(request, "J1") == ("J0",)


def test_the_measured_policy_never_holds() -> None:
    policy = ContinuumAf226d3Policy()
    assert policy.options.arrival_hold == "none"
    with pytest.raises(ValueError, match="pin_expiry=hard"):
        ContinuumAf226d3Options(arrival_hold="until-admitted")
    with pytest.raises(ValueError, match="pin_expiry=hard"):
        ContinuumOptions(arrival_hold="until-admitted", pin_expiry="while-waiting")
