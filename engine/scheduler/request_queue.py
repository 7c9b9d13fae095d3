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
from collections.abc import Collection, Iterator
from typing import Protocol

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


class PriorityRequestQueue(JobCountingQueue):
    """Lowest `priority` value first, then earliest arrival (vLLM's priority order).

    Preempted requests re-enter by their key like any other.
    """

    def __init__(self) -> None:
        super().__init__()
        self._heap: list[tuple[int, float, str, Request]] = []

    @staticmethod
    def _entry(request: Request) -> tuple[int, float, str, Request]:
        return (request.priority, request.arrival_time_s, request.request_id, request)

    def add_request(self, request: Request) -> None:
        heapq.heappush(self._heap, self._entry(request))
        self._count(request)

    def prepend_request(self, request: Request) -> None:
        self.add_request(request)

    def peek_request(self) -> Request:
        if not self._heap:
            raise IndexError("peek from an empty queue")
        return self._heap[0][3]

    def remove_request(self, request: Request) -> None:
        if self._heap and self._heap[0][3] is request:
            heapq.heappop(self._heap)
            self._uncount(request)
            return
        self.remove_requests([request])

    def remove_requests(self, requests: Collection[Request]) -> None:
        doomed = {id(request) for request in requests}
        for entry in self._heap:
            if id(entry[3]) in doomed:
                self._uncount(entry[3])
        self._heap = [entry for entry in self._heap if id(entry[3]) not in doomed]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return (entry[3] for entry in sorted(self._heap, key=lambda e: e[:3]))
