"""The job-aware waiting queues: keyed order, Continuum's tiers, removal, per-job counts."""

from __future__ import annotations

import pytest

from continuum.queues import KeyedRequestQueue, TieredRequestQueue
from engine.request import Request, RequestStatus
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


def test_tiered_queue_puts_preempted_then_pinned_jobs_first() -> None:
    pinned: set[str] = set()
    order = {name: index for index, name in enumerate("abcde")}
    queue = TieredRequestQueue(lambda r: (order[r.request_id],), lambda: sorted(pinned))
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
