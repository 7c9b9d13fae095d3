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

    - Waiting order, in tiers: requests that have waited `max_wait_s` (by arrival), plain
      requests (`is_plain`: no job, or the first turn of an inferred one) that have waited
      `max_plain_wait_s` (by arrival), preempted requests, turns of jobs holding a pin (none
      here; Continuum pins), then the rest: turns by program-level order (the job's first
      arrival, aged to at most `max_job_age_s` before the turn's own arrival, then the
      turn's arrival), and each plain request ahead of every turn that arrived after it.
    - Victims (`victim_order`): the running request admitted most recently (the one with
      the least computed since, so the least to recompute), or with `latest-job` the one
      whose job arrived latest (a request without a job: its own arrival); a request
      preempted `max_preemptions` times only when no other can be.
      A request still prefilling never preempts another: while another running request is
      decoding (and will finish or free blocks) it waits, keeping its blocks, else it
      preempts itself.
    - Admission (`prefill_admission`): a prompt starts once the blocks of its first chunk
      can be had, or, with `whole-prompt`, those of all its chunks (free, or held by the
      pins its later chunks may take, `reservable_pins`: none here, Continuum pins), and
      `admission_headroom_blocks` more per running request (room for their next tokens).
    """

    options_type = ProgramOrderOptions
    options: ProgramOrderOptions

    def new_waiting_queue(self) -> ProgramOrderQueue:
        return ProgramOrderQueue(self._order_key, self.arrival, self._pinned_job_ids,
                                 self.overdue_cutoffs, is_plain=self.is_plain)

    def overdue_cutoffs(self, now_s: float) -> tuple[float, float]:
        """The arrival times at or before which a request, and a request without a job, are
        overdue at `now_s`."""
        return (now_s - self.options.max_wait_s, now_s - self.options.max_plain_wait_s)

    def _order_key(self, request: Request) -> QueueKey:
        return self.job_order(request, self.options.max_job_age_s)

    def _pinned_job_ids(self) -> list[str]:
        return [pin.job_id for pin in self.scheduler.pins]

    def num_tokens_to_reserve(self, request: Request, num_hit_tokens: int,
                              num_new_tokens: int) -> int:
        if self.options.prefill_admission == "whole-prompt":
            headroom = (self.options.admission_headroom_blocks * len(self.scheduler.running)
                        * self.scheduler.block_size)
            return max(num_new_tokens, request.num_tokens - num_hit_tokens + headroom)
        return num_new_tokens

    def select_victim(self, request: Request, now_s: float) -> Victim | None:
        running = self.scheduler.running
        if self.options.prefill_victims == "none" and is_prefilling(request):
            decoding = any(other is not request and not is_prefilling(other)
                           for other in running)
            return None if decoding else request
        index = max(range(len(running)), key=lambda i: self.victim_rank(running[i], i))
        return running[index]

    def victim_rank(self, request: Request, admission_index: int) -> QueueKey:
        """Running requests by how readily they are preempted, the largest first;
        `admission_index` is the request's place in the running list (admission order)."""
        spared = request.num_preemptions >= self.options.max_preemptions
        if self.options.victim_order == "latest-admitted":
            return (not spared, admission_index)
        return (not spared, self.job_rank(request), self.arrival_order(request))


def is_prefilling(request: Request) -> bool:
    """Whether a running request still has more than its next token to compute (a prompt,
    or a context recomputed after a preemption)."""
    return request.num_tokens - request.num_computed_tokens > 1
