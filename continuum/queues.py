"""The program-level waiting queue of the job-aware policies: tiers, each ordered by keys
the policy computes (`engine.scheduler.request_queue.KeyedHeap`; the plain keyed queue is
`KeyedRequestQueue` there).

Keys are computed when a request enters the queue (`add_request`, or `prepend_request` after
a preemption or when the scheduler passes a request over); equal keys keep insertion order.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator

from engine.request import Request, RequestStatus
from engine.scheduler.request_queue import KeyedEntry, KeyedHeap, KeyFunction, RekeyingQueue


class ProgramOrderQueue(RekeyingQueue):
    """The order of the program-level policies, in tiers: requests that have waited past the
    bound (by arrival), plain requests that have waited past theirs (by arrival),
    preempted requests, then the rest; by key within each tier, except that a request of a
    job that holds a live pin sorts `pin_lead_s` seconds earlier than its key's time (its
    first element; inf: ahead of every request without one).

    `arrival(request)` gives the request's (arrival time, arrival rank) on the policy's
    clock; a request whose arrival time is at or before the overdue cutoff is overdue, and a
    plain request at or before the plain one. `overdue_cutoffs(now_s)` gives both cutoffs
    at a time; the scheduler tells the queue the time at each step start (`advance_to`).
    Pinned jobs are read at peek time
    from `pinned_job_ids`, so a pin that is created, expires or is broken while its job's
    turn waits moves that turn without re-keying.

    Requests for which `is_plain` holds (requests without a job, as the policy defines
    them) are not keyed: in the last tier each goes ahead of every job's turn that arrived
    after it (as under FCFS), so that turns of older jobs cannot pass it, and their own
    cutoff applies. With `is_plain` None, every request is keyed alike.
    """

    def __init__(
        self,
        key: KeyFunction,
        arrival: Callable[[Request], tuple[float, int]],
        pinned_job_ids: Callable[[], Iterable[str]],
        overdue_cutoffs: Callable[[float], tuple[float, float]],
        *,
        is_plain: Callable[[Request], bool] | None = None,
        pin_lead_s: float = math.inf,
    ) -> None:
        super().__init__()
        self._key = key
        self._pin_lead_s = pin_lead_s
        self._arrival = arrival
        self._overdue_cutoffs = overdue_cutoffs
        self._pinned_job_ids = pinned_job_ids
        self._is_plain = is_plain
        self._overdue_cutoff_s = -math.inf
        self._plain_overdue_cutoff_s = -math.inf
        self._by_arrival = KeyedHeap()
        self._preempted = KeyedHeap()
        self._rest = KeyedHeap()
        self._plain = KeyedHeap()  # by arrival; only with is_plain
        self._by_job: dict[str, KeyedHeap] = {}

    def advance_to(self, now_s: float) -> None:
        self._overdue_cutoff_s, self._plain_overdue_cutoff_s = self._overdue_cutoffs(now_s)

    def add_request(self, request: Request) -> None:
        arrival = self._arrival(request)
        self._by_arrival.push(arrival, request)
        if request.status is RequestStatus.PREEMPTED:
            self._preempted.push(self._key(request), request)
        elif self._is_plain is not None and self._is_plain(request):
            self._plain.push(arrival, request)
        else:
            key = self._key(request)
            self._rest.push(key, request)
            if request.job_id is not None:
                self._by_job.setdefault(request.job_id, KeyedHeap()).push(key, request)
        self._count(request)

    def peek_request(self) -> Request:
        head = (self._overdue_head() or self._plain_overdue_head() or self._preempted.peek()
                or self._pinned_or_merged_head())
        if head is None:
            raise IndexError("peek from an empty queue")
        return head[2]

    def _overdue_head(self) -> KeyedEntry | None:
        head = self._by_arrival.peek()
        return head if head is not None and head[0][0] <= self._overdue_cutoff_s else None

    def _plain_overdue_head(self) -> KeyedEntry | None:
        head = self._plain.peek()
        return head if head is not None and head[0][0] <= self._plain_overdue_cutoff_s else None

    def _pinned_head(self) -> KeyedEntry | None:
        heads = [
            head for job_id in self._pinned_job_ids()
            if (heap := self._by_job.get(job_id)) is not None and (head := heap.peek())
        ]
        return min(heads, key=lambda head: head[:2], default=None)

    def _pinned_or_merged_head(self) -> KeyedEntry | None:
        pinned, merged = self._pinned_head(), self._merged_head()
        if pinned is None or merged is None:
            return pinned or merged
        return pinned if self._pinned_goes_first(pinned, merged) else merged

    def _pinned_goes_first(self, pinned: KeyedEntry, other: KeyedEntry) -> bool:
        """Whether the pinned job's `pinned` entry sorts before `other` (keyed, or a plain
        request's arrival): by their times, the pinned one `pin_lead_s` earlier."""
        return pinned[0][0] - self._pin_lead_s <= other[0][0]

    def _merged_head(self) -> KeyedEntry | None:
        """The first of the keyed rest and the requests without a job: the plain head goes
        first if it arrived before the keyed head did."""
        plain, rest = self._plain.peek(), self._rest.peek()
        if plain is None or rest is None:
            return plain or rest
        return plain if plain[0] <= self._arrival(rest[2]) else rest

    def remove_request(self, request: Request) -> None:
        if not self._by_arrival.discard(request):
            raise ValueError(f"{request} is not waiting")
        if not (self._preempted.discard(request) or self._plain.discard(request)):
            self._rest.discard(request)
            self._discard_from_job(request)
        self._uncount(request)

    def _discard_from_job(self, request: Request) -> None:
        job_id = request.job_id
        heap = None if job_id is None else self._by_job.get(job_id)
        if heap is not None:
            heap.discard(request)
            if not heap:
                del self._by_job[job_id]  # type: ignore[arg-type]

    def __len__(self) -> int:
        return len(self._by_arrival)

    def __iter__(self) -> Iterator[Request]:
        """The requests in the order `peek_request` would give them if none changed tier."""
        overdue = sorted((arrival, order, request) for arrival, order, request
                         in self._by_arrival.entries() if arrival[0] <= self._overdue_cutoff_s)
        taken = {id(entry[2]) for entry in overdue}
        plain = self._plain.sorted_entries(taken)
        plain_overdue = [entry for entry in plain if entry[0][0] <= self._plain_overdue_cutoff_s]
        taken |= {id(entry[2]) for entry in plain_overdue}
        pinned_job_ids = set(self._pinned_job_ids())
        rest = self._rest.sorted_entries(taken)
        pinned = [entry for entry in rest if entry[2].job_id in pinned_job_ids]
        merged = self._merge([entry for entry in plain if id(entry[2]) not in taken],
                             [entry for entry in rest if entry[2].job_id not in pinned_job_ids])
        tiers = [overdue, plain_overdue, self._preempted.sorted_entries(taken),
                 self._merge_pinned(pinned, merged)]
        return (entry[2] for tier in tiers for entry in tier)

    def _merge_pinned(self, pinned: list[KeyedEntry], rest: list[KeyedEntry]) -> list[KeyedEntry]:
        merged: list[KeyedEntry] = []
        pinned_index = rest_index = 0
        while pinned_index < len(pinned) and rest_index < len(rest):
            if self._pinned_goes_first(pinned[pinned_index], rest[rest_index]):
                merged.append(pinned[pinned_index])
                pinned_index += 1
            else:
                merged.append(rest[rest_index])
                rest_index += 1
        return merged + pinned[pinned_index:] + rest[rest_index:]

    def _merge(self, plain: list[KeyedEntry], rest: list[KeyedEntry]) -> list[KeyedEntry]:
        merged: list[KeyedEntry] = []
        plain_index = rest_index = 0
        while plain_index < len(plain) and rest_index < len(rest):
            if plain[plain_index][0] <= self._arrival(rest[rest_index][2]):
                merged.append(plain[plain_index])
                plain_index += 1
            else:
                merged.append(rest[rest_index])
                rest_index += 1
        return merged + plain[plain_index:] + rest[rest_index:]
