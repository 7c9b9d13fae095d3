"""The scheduler's event stream: every subscriber gets each event once, in order; one that
wants no more is dropped and closed; the scheduler decides the same with or without any."""

from __future__ import annotations

import pytest

from continuum.presets import CONTINUUM
from engine.scheduler import events
from estimator.ttl_estimator import ConstantTTLEstimator
from tests.continuum.harness import Harness, tokens
from tests.engine.helpers import FakeClock


class Recorder:
    """A subscriber that keeps the name of every event (and its step-start state)."""

    def __init__(self, stop_after: int | None = None, refuse: bool = False) -> None:
        self.stop_after = stop_after
        self.refuse = refuse
        self.state: events.SchedulerStarted | None = None
        self.names: list[str] = []
        self.closed = False

    def started(self, event: events.SchedulerStarted) -> None:
        if self.refuse:
            raise ValueError("refused")
        self.state = event

    def receive(self, event: events.SchedulerEvent) -> bool:
        self.names.append(type(event).__name__)
        return self.stop_after is None or len(self.names) < self.stop_after

    def close(self) -> None:
        self.closed = True


def run_two_turns(h: Harness) -> None:
    h.add("t1", tokens(1, 10), job="J", max_tokens=2)
    h.run_until_finished("t1")
    h.next_turn("t2", "t1", tokens(50, 3), last=True)
    h.run_until_finished("t2")


def test_a_subscriber_sees_each_step_in_order_and_the_pin_it_made() -> None:
    h = Harness(CONTINUUM.build(estimator=ConstantTTLEstimator(5.0)))
    recorder = Recorder()
    h.scheduler.subscribe(recorder)
    assert recorder.state is not None and recorder.state.first_step == h.scheduler.step_id
    assert recorder.state.policy_name == "continuum"
    run_two_turns(h)
    names = recorder.names
    assert names[:4] == ["RequestArrived", "StepStarted", "Admitted", "StepPlanned"]
    steps = [index for index, name in enumerate(names) if name == "StepStarted"]
    assert len(steps) == names.count("StepEnded") == h.scheduler.step_id
    # t1 finished, was pinned, and t2's admission reused (released) the pin.
    finished = names.index("RequestFinished")
    assert names[finished + 1] == "RetentionDecided"
    assert names.index("PinReleased") > names.index("RequestArrived", finished)
    assert names[-1] == "StepEnded" and names.count("JobEnded") == 1
    h.scheduler.close_subscribers()
    assert recorder.closed


def test_a_subscriber_that_wants_no_more_is_dropped_and_scheduling_is_unchanged() -> None:
    alone = Harness(CONTINUUM.build(estimator=ConstantTTLEstimator(5.0)))
    run_two_turns(alone)
    h = Harness(CONTINUUM.build(estimator=ConstantTTLEstimator(5.0)))
    quitter, keeper = Recorder(stop_after=3), Recorder()
    h.scheduler.subscribe(quitter)
    h.scheduler.subscribe(keeper)
    with pytest.raises(ValueError, match="refused"):
        h.scheduler.subscribe(Recorder(refuse=True))
    run_two_turns(h)
    assert len(quitter.names) == 3 and quitter.closed and not keeper.closed
    learner = alone.scheduler.events.subscribers[0]  # the policy's, subscribed at binding
    assert h.scheduler.events.subscribers[1:] == (keeper,)
    assert type(h.scheduler.events.subscribers[0]) is type(learner)
    assert [o.num_scheduled_tokens for o in h.outputs] == [
        o.num_scheduled_tokens for o in alone.outputs]


class TickingClock(FakeClock):
    """A clock that moves a millisecond each time it is read, as a real one does."""

    def __call__(self) -> float:
        self.now_s += 0.001
        return self.now_s


class TimeRecorder(Recorder):
    """Keeps (event name, request or job, time) of finishes, pin releases and job ends."""

    def __init__(self) -> None:
        super().__init__()
        self.times: list[tuple[str, str, float]] = []

    def receive(self, event: events.SchedulerEvent) -> bool:
        match event:
            case events.RequestFinished():
                self.times.append(("finished", event.request.request_id, event.now_s))
            case events.PinReleased() if event.pin.released_at_s is not None:
                self.times.append((event.pin.release_reason.value, event.pin.job_id,
                                   event.pin.released_at_s))
            case events.JobEnded():
                self.times.append(("job ended", event.job_id, event.now_s))
        return super().receive(event)


def test_what_one_call_finishes_and_releases_shares_its_time() -> None:
    """A turn aborted while its job's pin waits for it, and a job's last turn: the finish,
    the pin's release and the job's end carry the one time of the call that did them."""
    h = Harness(CONTINUUM.build(estimator=ConstantTTLEstimator(5.0)), clock=TickingClock())
    recorder = TimeRecorder()
    h.scheduler.subscribe(recorder)
    h.add("t1", tokens(1, 10), job="J", max_tokens=2)
    h.run_until_finished("t1")
    h.next_turn("t2", "t1", tokens(50, 3))
    h.scheduler.finish_requests(["t2"])
    h.add("u1", tokens(1, 10), job="K", max_tokens=2, last=True)
    h.run_until_finished("u1")
    by_name = {(name, who): time_s for name, who, time_s in recorder.times}
    assert by_name[("abort", "J")] == by_name[("finished", "t2")]
    assert by_name[("job ended", "K")] == by_name[("finished", "u1")]
    h.scheduler.close_subscribers()
