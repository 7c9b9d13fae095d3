"""`continuum-af226d3`: the Continuum policy as commit af226d3 ran it on the H100, kept to
compare the simulator with those measured runs and to ablate what changed since.

What differs from `continuum` (`ContinuumPolicy`):
- Victims: running requests are preempted before any pin is released (the latest job's
  request, requests of jobs holding a pin last, prefilling or not, however often it was
  preempted before); pins are released, latest job first, only when the request that needs
  blocks would preempt itself.
- Admission: pins give way to a blocked waiting head only when nothing runs, or once the
  head has waited `pin_yield_wait_s` or `max_wait_s`, whichever is shorter.
- Expiry: a pin past its deadline lives on while a turn of its job waits.
- Order: requests without a job are ordered like turns (by their own arrival in program
  order), with no bound of their own; pins hold at most 80 % of the pool.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from continuum.options import ContinuumAf226d3Options
from continuum.policy import ContinuumPolicy
from continuum.queues import ProgramOrderQueue, QueueKey
from engine.kv_cache.pins import Pin
from engine.request import Request
from engine.scheduler.policy import Victim


class ContinuumAf226d3Policy(ContinuumPolicy):
    """Continuum with the victims, pin yielding, expiry and order of commit af226d3."""

    options_type = ContinuumAf226d3Options
    options: ContinuumAf226d3Options

    def new_waiting_queue(self) -> ProgramOrderQueue:
        return ProgramOrderQueue(self._order_key, self.arrival, self._pinned_job_ids,
                                 self.overdue_cutoffs)

    def overdue_cutoffs(self, now_s: float) -> tuple[float, float]:
        return (now_s - self.options.max_wait_s, -math.inf)

    def expired_pins(self, now_s: float) -> Sequence[Pin]:
        return ()

    def select_victim(self, request: Request, now_s: float) -> Victim:
        victim = max(self.scheduler.running, key=self._victim_rank)
        if victim is request:
            pin = self.latest_job_pin(exclude_job_id=request.job_id)
            if pin is not None:
                return pin
        return victim

    def _victim_rank(self, request: Request) -> QueueKey:
        return (not self.holds_pin(request.job_id), self.job_rank(request),
                self.arrival_order(request))

    def select_pin_to_release(self, request: Request, now_s: float) -> Pin | None:
        if not self.scheduler.running:
            return self.latest_job_pin(exclude_job_id=request.job_id)
        waited_s = now_s - self.arrival(request)[0]
        if waited_s < min(self.options.pin_yield_wait_s, self.options.max_wait_s):
            return None
        pin = self.latest_job_pin(exclude_job_id=request.job_id)
        return None if pin is None or pin.job_id == request.job_id else pin
