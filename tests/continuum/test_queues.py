"""The job-aware waiting queues: keyed order, program-order tiers and the overdue bound,
removal, per-job counts."""

from __future__ import annotations

import pytest

from continuum.queues import ProgramOrderQueue
from engine.request import Request, RequestStatus
from engine.scheduler.request_queue import KeyedRequestQueue
from tests.engine.helpers import make_request


def request(request_id: str, job: str | None = None, *, preempted: bool = False) -> Request:
    made = make_request(request_id, [1, 2], job_id=job)
    if preempted:
        made.status = RequestStatus.PREEMPTED
    return made


def test_keyed_queue_orders_by_key_and_rekeys_on_reentry() -> None:
    keys = {"a": 3, "b": 1, "c": 2}
    queue = KeyedRequestQueue(lambda r: (keys[r.request_id],))
    a, b, c = (request(name, job="J" if name != "c" else None) for name in "abc")
    for item in (a, b, c):
        queue.add_request(item)
    assert [r.request_id for r in queue] == ["b", "c", "a"]
    assert queue.peek_request() is b and queue.num_waiting("J") == 2 and len(queue) == 3
    queue.remove_request(b)
    keys["a"] = 0
    queue.remove_request(a)
    queue.prepend_request(a)
    assert queue.peek_request() is a and [r.request_id for r in queue] == ["a", "c"]
    queue.remove_requests([a, c])
    assert len(queue) == 0 and queue.num_waiting("J") == 0
    with pytest.raises(IndexError):
        queue.peek_request()
    with pytest.raises(ValueError):
        queue.remove_request(a)


def test_equal_keys_keep_insertion_order_even_after_reentry() -> None:
    queue = KeyedRequestQueue(lambda r: (0,))
    a, b = request("a"), request("b")
    queue.add_request(a)
    queue.add_request(b)
    queue.remove_request(a)
    queue.add_request(a)  # the stale entry of `a` and the new one share a key
    assert [queue.peek_request().request_id, *[r.request_id for r in queue]] == ["b", "b", "a"]


def program_queue(order: dict[str, int], pinned: set[str] | None = None,
                  arrival_s: dict[str, float] | None = None, *,
                  plain_by_arrival: bool = True) -> ProgramOrderQueue:
    """A queue keyed by `order`; with `plain_by_arrival`, requests without a job are plain.
    Requests are overdue after MAX_WAIT_S, plain ones after MAX_PLAIN_WAIT_S."""
    arrival_s = arrival_s or {}
    return ProgramOrderQueue(
        lambda r: (order[r.request_id],),
        lambda r: (arrival_s.get(r.request_id, 0.0), order[r.request_id]),
        lambda: sorted(pinned or ()),
        lambda now_s: (now_s - MAX_WAIT_S, now_s - MAX_PLAIN_WAIT_S),
        is_plain=(lambda r: r.job_id is None) if plain_by_arrival else None,
    )


MAX_WAIT_S = 10.0
MAX_PLAIN_WAIT_S = 5.0


def test_program_order_queue_puts_preempted_then_pinned_jobs_first() -> None:
    pinned: set[str] = set()
    queue = program_queue({name: index for index, name in enumerate("abcde")}, pinned)
    a, b = request("a", job="A"), request("b")
    c, d = request("c", job="C"), request("d", job="D")
    e = request("e", job="C", preempted=True)
    for item in (a, b, c, d):
        queue.add_request(item)
    assert [r.request_id for r in queue] == ["a", "b", "c", "d"]
    pinned.update({"D", "C"})
    assert queue.peek_request() is c and [r.request_id for r in queue] == ["c", "d", "a", "b"]
    queue.prepend_request(e)
    assert queue.peek_request() is e and [r.request_id for r in queue][:2] == ["e", "c"]
    assert queue.num_waiting("C") == 2
    for item in (e, c, d):
        assert queue.peek_request() is item
        queue.remove_request(item)
    pinned.clear()
    assert [r.request_id for r in queue] == ["a", "b"] and queue.num_waiting("C") == 0
    queue.remove_requests([a, b])
    assert len(queue) == 0
    with pytest.raises(IndexError):
        queue.peek_request()


def test_requests_past_the_overdue_cutoff_go_first_in_arrival_order() -> None:
    # Keys put the old job's turns j1, j2 ahead; arrival order is p, j1, j2, q.
    order = {"j1": 0, "j2": 1, "p": 2, "q": 3}
    arrival_s = {"p": 1.0, "j1": 2.0, "j2": 3.0, "q": 4.0}
    queue = program_queue(order, set(), arrival_s, plain_by_arrival=False)
    items = {name: request(name, job="J" if name.startswith("j") else None) for name in order}
    for name in ("q", "j2", "p", "j1"):
        queue.add_request(items[name])
    assert [r.request_id for r in queue] == ["j1", "j2", "p", "q"]
    queue.advance_to(12.5)  # p (1.0) and j1 (2.0) have waited past the bound
    assert queue.peek_request() is items["p"]
    assert [r.request_id for r in queue] == ["p", "j1", "j2", "q"]
    queue.remove_request(items["p"])
    assert queue.peek_request() is items["j1"]
    queue.advance_to(15.0)  # everyone is overdue: pure arrival order
    queue.remove_request(items["j1"])
    assert [r.request_id for r in queue] == ["j2", "q"] and queue.peek_request() is items["j2"]


def test_removed_requests_do_not_pile_up_behind_a_stuck_head() -> None:
    queue = KeyedRequestQueue(lambda r: (int(r.request_id),))
    head = request("0")
    queue.add_request(head)
    for index in range(1, 1001):
        item = request(str(index))
        queue.add_request(item)
        queue.remove_request(item)
    assert len(queue._heap._heap) <= 2 * len(queue) + 65
    assert queue.peek_request() is head and list(queue) == [head]


def test_a_request_without_a_job_goes_ahead_of_turns_that_arrived_after_it() -> None:
    # Keys (program order) put the old job's turns first; p arrived between j1 and j2.
    order = {"j1": 0, "j2": 1, "j3": 2, "p": 3, "q": 4}
    arrival_s = {"j1": 1.0, "p": 2.0, "j2": 3.0, "q": 4.0, "j3": 5.0}
    queue = program_queue(order, set(), arrival_s)
    items = {name: request(name, job="J" if name.startswith("j") else None) for name in order}
    for name in ("q", "j3", "j2", "p", "j1"):
        queue.add_request(items[name])
    assert [r.request_id for r in queue] == ["j1", "p", "j2", "q", "j3"]
    assert queue.peek_request() is items["j1"]
    queue.remove_request(items["j1"])
    assert queue.peek_request() is items["p"]
    # Its own bound: once past it, a request without a job goes ahead of every other tier.
    queue.advance_to(9.0)  # p (2.0) and q (4.0) waited 5 s; no turn waited 10 s
    assert [r.request_id for r in queue] == ["p", "q", "j2", "j3"]
    queue.remove_request(items["p"])
    assert queue.peek_request() is items["q"]
