"""Program-level first-come-first-serve with bounded waiting: `job-fcfs`, and the base of the
Continuum policies (which add pins)."""

from __future__ import annotations

from continuum.job_aware import JobAwarePolicy
from continuum.options import ProgramOrderOptions
from continuum.queues import ProgramOrderQueue, QueueKey
from engine.request import Request
from engine.scheduler.policy import Victim


class JobFCFSPolicy(JobAwarePolicy):
    """Program-level FCFS, no pins (the first rung of the paper's ablation).

    - Waiting order, in tiers: requests that have waited `max_wait_s` (by arrival), then
      preempted requests, then turns of jobs holding a pin (none here; Continuum pins), then
      the rest; within a tier by program-level order: the job's first arrival, aged to at
      most `max_job_age_s` before the turn's own arrival, then the request's arrival.
    - Victims: the running request whose job arrived latest (a request without a job: its
      own arrival).
    """

    options_type = ProgramOrderOptions
    options: ProgramOrderOptions
    _waiting: ProgramOrderQueue

    def make_queue(self) -> ProgramOrderQueue:
        return ProgramOrderQueue(self._order_key, self.arrival, self._pinned_job_ids)

    def _order_key(self, request: Request) -> QueueKey:
        return self.job_order(request, self.options.max_job_age_s)

    def _pinned_job_ids(self) -> list[str]:
        return [pin.job_id for pin in self.scheduler.pins]

    def on_step_start(self, now_s: float) -> None:
        super().on_step_start(now_s)
        self._waiting.set_overdue_cutoff(now_s - self.options.max_wait_s)

    def select_victim(self, request: Request) -> Victim:
        return max(self.scheduler.running, key=self.victim_rank)

    def victim_rank(self, request: Request) -> QueueKey:
        """Running requests by how readily they are preempted: the largest goes first."""
        return (self.job_rank(request), self.arrival_order(request))
