"""Waiting queues: the order in which waiting requests are considered for admission.

A policy creates the queue the scheduler uses (`SchedulingPolicy.new_waiting_queue`).
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Collection, Iterator
from typing import Protocol

from engine.request import Request


class RequestQueue(Protocol):
    """A waiting queue owned by the scheduler, ordered by its policy.

    `prepend_request` is used for preempted requests, which FCFS puts back at the head.
    Iteration yields requests in admission order.
    """

    def add_request(self, request: Request) -> None: ...

    def prepend_request(self, request: Request) -> None: ...

    def peek_request(self) -> Request: ...

    def remove_request(self, request: Request) -> None: ...

    def remove_requests(self, requests: Collection[Request]) -> None: ...

    def __len__(self) -> int: ...

    def __iter__(self) -> Iterator[Request]: ...


class FCFSRequestQueue:
    """First come, first served; preempted requests go back to the head."""

    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def add_request(self, request: Request) -> None:
        self._queue.append(request)

    def prepend_request(self, request: Request) -> None:
        self._queue.appendleft(request)

    def peek_request(self) -> Request:
        if not self._queue:
            raise IndexError("peek from an empty queue")
        return self._queue[0]

    def remove_request(self, request: Request) -> None:
        if self._queue and self._queue[0] is request:
            self._queue.popleft()
        else:
            self._queue.remove(request)

    def remove_requests(self, requests: Collection[Request]) -> None:
        doomed = {id(request) for request in requests}
        self._queue = deque(r for r in self._queue if id(r) not in doomed)

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)


class PriorityRequestQueue:
    """Lowest `priority` value first, then earliest arrival (vLLM's priority order).

    Preempted requests re-enter by their key like any other.
    """

    def __init__(self) -> None:
        self._heap: list[tuple[int, float, str, Request]] = []

    @staticmethod
    def _entry(request: Request) -> tuple[int, float, str, Request]:
        return (request.priority, request.arrival_time_s, request.request_id, request)

    def add_request(self, request: Request) -> None:
        heapq.heappush(self._heap, self._entry(request))

    def prepend_request(self, request: Request) -> None:
        self.add_request(request)

    def peek_request(self) -> Request:
        if not self._heap:
            raise IndexError("peek from an empty queue")
        return self._heap[0][3]

    def remove_request(self, request: Request) -> None:
        if self._heap and self._heap[0][3] is request:
            heapq.heappop(self._heap)
            return
        self.remove_requests([request])

    def remove_requests(self, requests: Collection[Request]) -> None:
        doomed = {id(request) for request in requests}
        self._heap = [entry for entry in self._heap if id(entry[3]) not in doomed]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return (entry[3] for entry in sorted(self._heap, key=lambda e: e[:3]))
