"""Waiting queues: the order in which waiting requests are considered for admission.

A policy builds the queues (`SchedulingPolicy.new_waiting_queue`, its order: one for each
tenant with waiting requests, among which the scheduler's `tenant_queue.TenantFairQueue`
takes turns); the scheduler owns them: only the scheduler adds, removes and tells them the
time, and policies read the whole through `SchedulerView.waiting`. Every queue counts its
requests per job.
"""

from __future__ import annotations

import heapq
from collections import Counter, deque
from collections.abc import Callable, Collection, Iterable, Iterator
from typing import Any, Protocol

from engine.request import Request


class WaitingRequests(Protocol):
    """What a policy may read of the waiting queue. Iteration yields requests in admission
    order."""

    def peek_request(self) -> Request:
        """The next request to admit (IndexError if none waits)."""
        ...

    def num_waiting(self, job_id: str) -> int:
        """Waiting requests of the job."""
        ...

    def __len__(self) -> int: ...

    def __iter__(self) -> Iterator[Request]: ...


class RequestQueue(WaitingRequests, Protocol):
    """A waiting queue owned by the scheduler, ordered by its policy; only the scheduler
    changes it.

    `prepend_request` is used for preempted requests, which FCFS puts back at the head.
    """

    def add_request(self, request: Request) -> None: ...

    def prepend_request(self, request: Request) -> None: ...

    def remove_request(self, request: Request) -> None: ...

    def remove_requests(self, requests: Collection[Request]) -> None: ...

    def advance_to(self, now_s: float) -> None:
        """The scheduler's clock at the start of a step (seconds), before its first peek: a
        queue whose order changes as requests wait (wait bounds, aging) reorders here."""
        ...


class JobCountingQueue:
    """What every queue shares: waiting requests counted per job, and an order that does not
    change with time (`advance_to` does nothing). Subclasses call `_count` / `_uncount` as
    requests enter and leave."""

    def __init__(self) -> None:
        self._job_counts: Counter[str] = Counter()

    def advance_to(self, now_s: float) -> None:
        pass

    def num_waiting(self, job_id: str) -> int:
        return self._job_counts.get(job_id, 0)

    def _count(self, request: Request) -> None:
        if request.job_id is not None:
            self._job_counts[request.job_id] += 1

    def _uncount(self, request: Request) -> None:
        job_id = request.job_id
        if job_id is not None:
            self._job_counts[job_id] -= 1
            if not self._job_counts[job_id]:
                del self._job_counts[job_id]


class FCFSRequestQueue(JobCountingQueue):
    """First come, first served; preempted requests go back to the head."""

    def __init__(self) -> None:
        super().__init__()
        self._queue: deque[Request] = deque()

    def add_request(self, request: Request) -> None:
        self._queue.append(request)
        self._count(request)

    def prepend_request(self, request: Request) -> None:
        self._queue.appendleft(request)
        self._count(request)

    def peek_request(self) -> Request:
        if not self._queue:
            raise IndexError("peek from an empty queue")
        return self._queue[0]

    def remove_request(self, request: Request) -> None:
        if self._queue and self._queue[0] is request:
            self._queue.popleft()
        else:
            self._queue.remove(request)
        self._uncount(request)

    def remove_requests(self, requests: Collection[Request]) -> None:
        doomed = {id(request) for request in requests}
        kept: deque[Request] = deque()
        for request in self._queue:
            if id(request) in doomed:
                self._uncount(request)
            else:
                kept.append(request)
        self._queue = kept

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)


QueueKey = tuple[Any, ...]
KeyFunction = Callable[[Request], QueueKey]
KeyedEntry = tuple[QueueKey, int, Request]


class KeyedHeap:
    """Requests by (key, insertion): O(log n) push and peek; removal marks the entry stale.
    Equal keys keep insertion order."""

    def __init__(self) -> None:
        self._heap: list[KeyedEntry] = []
        self._live: dict[int, KeyedEntry] = {}
        self._num_pushed = 0

    def push(self, key: QueueKey, request: Request) -> None:
        entry = (key, self._num_pushed, request)
        self._num_pushed += 1
        self._live[id(request)] = entry
        heapq.heappush(self._heap, entry)

    def discard(self, request: Request) -> bool:
        """Removes `request`; whether it was there."""
        if self._live.pop(id(request), None) is None:
            return False
        if len(self._heap) > 2 * len(self._live) + 64:
            # Stale entries keep removed requests alive: drop them once they dominate.
            self._heap = list(self._live.values())
            heapq.heapify(self._heap)
        return True

    def peek(self) -> KeyedEntry | None:
        heap = self._heap
        while heap and self._live.get(id(heap[0][2])) is not heap[0]:
            heapq.heappop(heap)
        return heap[0] if heap else None

    def entries(self) -> Iterable[KeyedEntry]:
        """The live entries, in no order."""
        return self._live.values()

    def sorted_entries(self, excluded: Collection[int] = ()) -> list[KeyedEntry]:
        """The live entries in pop order, without the requests whose `id`s are `excluded`."""
        return sorted((entry for entry in self._live.values() if id(entry[2]) not in excluded),
                      key=lambda entry: entry[:2])

    def __len__(self) -> int:
        return len(self._live)


class RekeyingQueue(JobCountingQueue):
    """A queue ordered by keys: a request that re-enters (`prepend_request`, after a
    preemption or when the scheduler passes it over) is a fresh entry, keyed anew."""

    def add_request(self, request: Request) -> None:
        raise NotImplementedError

    def remove_request(self, request: Request) -> None:
        raise NotImplementedError

    def prepend_request(self, request: Request) -> None:
        self.add_request(request)

    def remove_requests(self, requests: Collection[Request]) -> None:
        for request in requests:
            self.remove_request(request)


class KeyedRequestQueue(RekeyingQueue):
    """Smallest `key` first (computed as a request enters), equal keys in insertion order."""

    def __init__(self, key: KeyFunction) -> None:
        super().__init__()
        self._key = key
        self._heap = KeyedHeap()

    def add_request(self, request: Request) -> None:
        self._heap.push(self._key(request), request)
        self._count(request)

    def peek_request(self) -> Request:
        head = self._heap.peek()
        if head is None:
            raise IndexError("peek from an empty queue")
        return head[2]

    def remove_request(self, request: Request) -> None:
        if not self._heap.discard(request):
            raise ValueError(f"{request} is not waiting")
        self._uncount(request)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return (entry[2] for entry in self._heap.sorted_entries())


def priority_order(request: Request) -> QueueKey:
    """vLLM's priority order: lowest `priority` value first, then earliest arrival."""
    return (request.priority, request.arrival_time_s, request.request_id)
