"""The scheduler's hands on pins: it carries out what a policy decides, refuses what a policy
may not ask, and reports every change to the event stream."""

from __future__ import annotations

import pytest

from engine.kv_cache.pins import Pin, PinReleaseReason
from engine.request import RequestStatus
from engine.scheduler import events
from engine.scheduler.retention import Retention, RetentionInputs
from tests.engine.helpers import FakeRunner, PinningPolicy, make_request, make_scheduler, run_step


class Names:
    """A subscriber keeping each event's name."""

    def __init__(self) -> None:
        self.names: list[str] = []

    def started(self, event: events.SchedulerStarted) -> None:
        pass

    def receive(self, event: events.SchedulerEvent) -> bool:
        self.names.append(type(event).__name__)
        return True

    def close(self) -> None:
        pass


def _pinned_turn():
    scheduler = make_scheduler(num_blocks=16, block_size=4, policy=PinningPolicy(ttl_s=5.0))
    names = Names()
    scheduler.subscribe(names)
    runner = FakeRunner(4)
    scheduler.add_request(make_request("t1", list(range(10)), max_tokens=2, job_id="J"))
    while scheduler.has_unfinished_requests():
        run_step(scheduler, runner)
    return scheduler, names


def test_a_retained_turn_is_pinned_and_its_decision_emitted() -> None:
    scheduler, names = _pinned_turn()
    pin = scheduler.pins.get("J")
    assert pin is not None and pin.ttl_s == 5.0 and pin.request_id == "t1"
    assert names.names.index("RetentionDecided") == names.names.index("RequestFinished") + 1


def test_ending_a_job_releases_its_pin_and_emits_the_end() -> None:
    scheduler, names = _pinned_turn()
    pin = scheduler.end_job("J", PinReleaseReason.RELEASE, now_s=1.0)
    assert pin is not None and pin.release_reason is PinReleaseReason.RELEASE
    assert names.names[-2:] == ["PinReleased", "JobEnded"]
    assert scheduler.end_job("J") is None  # nothing left: ending again releases nothing


def test_a_policy_may_not_release_a_pin_that_is_not_live() -> None:
    scheduler, _ = _pinned_turn()
    ghost = Pin("J", "ghost", [], pinned_at_s=0.0, ttl_s=1.0)
    with pytest.raises(RuntimeError, match="not live"):
        scheduler._pin_keeper.release_chosen((ghost,), PinReleaseReason.EXPIRED, 1.0)
    assert scheduler.pins.get("J") is not None


def test_a_policy_may_not_retain_an_aborted_turn() -> None:
    scheduler, _ = _pinned_turn()
    aborted = make_request("t2", list(range(10)), job_id="J")
    aborted.status = RequestStatus.FINISHED_ABORTED
    retention = Retention(5.0, RetentionInputs(ttl_s=5.0, source="test"))
    with pytest.raises(RuntimeError, match="aborted"):
        scheduler._pin_keeper.retain(aborted, retention, 1.0)
