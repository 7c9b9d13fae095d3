"""The job books learn everything from the scheduler's events: arrivals, admissions, finishes,
retention decisions, pin releases and ended jobs."""

from __future__ import annotations

from continuum.ledger import JobLedger
from engine.kv_cache.pins import PinReleaseReason
from engine.request import RequestStatus
from engine.scheduler import events
from engine.scheduler.retention import RetentionInputs
from tests.continuum.test_victims import StubPins, StubView
from tests.engine.helpers import make_request


def test_the_books_follow_a_jobs_turns_from_the_events() -> None:
    ledger = JobLedger(job_idle_timeout_s=60.0)
    ledger.scheduler = StubView([], StubPins())  # type: ignore[assignment]
    first = make_request("t1", [1, 2, 3], job_id="J")
    plain = make_request("p", [4, 5])
    assert ledger.record(events.RequestArrived(first, 1.0)) is None
    ledger.record(events.RequestArrived(plain, 2.0))
    assert ledger.arrival(first) == (1.0, 0) and ledger.arrival(plain) == (2.0, 1)
    assert ledger.job_rank(plain) == 1 and ledger.is_plain(plain) and not ledger.is_plain(first)
    job = ledger.job_of(first)
    assert job is not None and (job.num_turns_arrived, job.num_unfinished_turns) == (1, 1)

    first.status = RequestStatus.FINISHED_STOPPED
    first.num_cached_tokens = 0
    ledger.record(events.RequestFinished(first, 3.0))
    assert (job.num_turns_finished, job.num_unfinished_turns) == (1, 0)
    assert job.attained_service_tokens == first.num_tokens and ledger.job_of(first) is None
    ledger.record(events.RetentionDecided(first, None, RetentionInputs(0.0, "test", "ls"), 3.0))
    assert (job.last_tool_name, job.num_pins_created) == ("ls", 0)

    aborted = make_request("t2", [1, 2, 3, 9], job_id="J")
    ledger.record(events.RequestArrived(aborted, 4.0))
    aborted.status = RequestStatus.FINISHED_ABORTED
    ledger.record(events.RequestFinished(aborted, 5.0))
    assert (job.num_turns_arrived, job.num_turns_finished) == (2, 1)  # an abort is no turn

    ended = ledger.record(events.JobEnded("J", PinReleaseReason.RELEASE.value, 6.0))
    assert ended is job and ledger.jobs.get("J") is None and len(ledger.jobs) == 0


def test_idle_jobs_leave_the_books_but_not_while_pinned() -> None:
    ledger = JobLedger(job_idle_timeout_s=10.0)
    ledger.scheduler = StubView([], StubPins())  # type: ignore[assignment]
    turn = make_request("t", [1], job_id="J")
    ledger.record(events.RequestArrived(turn, 0.0))
    turn.status = RequestStatus.FINISHED_STOPPED
    ledger.record(events.RequestFinished(turn, 1.0))
    assert ledger.pop_idle_jobs(10.5) == []
    [job] = ledger.pop_idle_jobs(11.5)
    assert job.job_id == "J" and len(ledger.jobs) == 0
