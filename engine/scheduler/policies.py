"""The request-level policies of stock vLLM V1: FCFS and priority."""

from __future__ import annotations

from engine.request import Request
from engine.scheduler.policy import BasePolicy, Victim
from engine.scheduler.request_queue import FCFSRequestQueue, PriorityRequestQueue


class FCFSPolicy(BasePolicy):
    """Stock V1: admit in arrival order (preempted requests first), preempt the most recently
    admitted running request, never retain a finished request's blocks."""

    def new_waiting_queue(self) -> FCFSRequestQueue:
        return FCFSRequestQueue()

    def select_victim(self, request: Request, now_s: float) -> Victim:
        return self.scheduler.running[-1]


class PriorityPolicy(BasePolicy):
    """Stock V1 priority scheduling: lower `priority` first, then earlier arrival; the victim is
    the running request that sorts last by the same key.

    Ties go to the most recently admitted request (V1 takes the first in running order, which
    lets two equal requests preempt each other forever as each re-admission reorders them).
    """

    def new_waiting_queue(self) -> PriorityRequestQueue:
        return PriorityRequestQueue()

    def select_victim(self, request: Request, now_s: float) -> Victim:
        running = self.scheduler.running
        index = max(
            range(len(running)),
            key=lambda i: (running[i].priority, running[i].arrival_time_s, i),
        )
        return running[index]
