"""The request-level policies of stock vLLM V1: FCFS and priority."""

from __future__ import annotations

from engine.request import Request, RequestStatus
from engine.scheduler.policy import BasePolicy, Victim
from engine.scheduler.request_queue import FCFSRequestQueue, KeyedRequestQueue, priority_order


class FCFSPolicy(BasePolicy):
    """Stock V1: admit in arrival order (preempted requests first), preempt the most recently
    admitted running request, never retain a finished request's blocks."""

    def new_waiting_queue(self) -> FCFSRequestQueue:
        return FCFSRequestQueue()


class PriorityPolicy(BasePolicy):
    """Stock V1 priority scheduling: lower `priority` first, then earlier arrival; the victim is
    the running request that sorts last by the same key.

    Ties go to the most recently admitted request (V1 takes the first in running order, which
    lets two equal requests preempt each other forever as each re-admission reorders them).
    """

    def new_waiting_queue(self) -> KeyedRequestQueue:
        return KeyedRequestQueue(priority_order)

    def select_victim(self, request: Request, now_s: float) -> Victim | None:
        if request.status is not RequestStatus.RUNNING:
            return super().select_victim(request, now_s)
        running = self.scheduler.running
        index = max(
            range(len(running)),
            key=lambda i: (running[i].priority, running[i].arrival_time_s, i),
        )
        return running[index]
