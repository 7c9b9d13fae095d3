"""Admission control: what a waiting request must find before the scheduler admits it.

Two rules beside the blocks of this step's chunk: tenants' shares of the batch and of the KV
pool (`tenant_shares`, from the moment requests of two tenants were seen), and the room the
policy wants reserved for a prompt's later chunks (`SchedulingPolicy.reservation`). Owned
by `Scheduler`, which asks before each admission attempt and carries out the preemptions
this module names; it changes nothing itself.
"""

from __future__ import annotations

from engine.kv_cache.manager import KVCacheManager, PrefixHit
from engine.kv_cache.pins import PinTable
from engine.request import Request
from engine.scheduler.policy import SchedulerView, SchedulingPolicy
from engine.scheduler.step_plan import StepPlan
from engine.scheduler.tenant_shares import TenantShares


class Admission:
    """Reads the scheduler (`view`), its KV cache manager and pins; remembers up to two of
    the tenants seen (None among them): shares apply from two on."""

    def __init__(self, view: SchedulerView, kv_cache_manager: KVCacheManager, pins: PinTable,
                 policy: SchedulingPolicy, *, max_num_seqs: int) -> None:
        self._view = view
        self._kv_cache_manager = kv_cache_manager
        self._pins = pins
        self._policy = policy
        self._max_num_seqs = max_num_seqs
        self._tenants_seen: set[str | None] = set()

    def note_arrival(self, request: Request) -> None:
        """Called for every request the scheduler queues."""
        if len(self._tenants_seen) < 2:
            self._tenants_seen.add(request.tenant)

    @property
    def tenants_compete(self) -> bool:
        """Whether requests of two tenants were ever seen: tenants' shares apply then."""
        return len(self._tenants_seen) > 1

    def passes_share(self, request: Request, plan: StepPlan) -> bool:
        """Whether tenants compete and waiting `request` would take its tenant past its
        share."""
        return self.tenants_compete and not self._shares(plan).fits_share(
            request.tenant, self._num_blocks_for(request.num_tokens))

    def share_victim(self, request: Request, plan: StepPlan) -> Request | None:
        """The running request to preempt for waiting `request`: the latest of the tenant
        furthest over its share, if `request`'s tenant stays within its own once admitted
        and it may run this step; else None."""
        if not self.tenants_compete or plan.num_new_tokens(request, 0) == 0:
            return None
        return self._shares(plan).victim_for_waiting(
            request, self._num_blocks_for(request.num_tokens))

    def victim_instead_of(self, victim: Request, requester: Request, num_new_tokens: int,
                          plan: StepPlan) -> Request:
        """The running request to preempt in place of the policy's `victim` for running
        `requester` (`TenantShares.victim_instead_of`); `victim` while tenants do not
        compete."""
        if not self.tenants_compete:
            return victim
        return self._shares(plan).victim_instead_of(
            victim, requester, self._num_blocks_for(num_new_tokens))

    def has_reserved_room(self, request: Request, hit: PrefixHit, num_new_tokens: int,
                          now_s: float) -> bool:
        """Whether the blocks of the tokens the policy wants reserved beyond this step's chunk
        are free or held by the pins it names (`SchedulingPolicy.reservation`). Always True
        while nothing runs: nothing else could free blocks for it then."""
        reservation = self._policy.reservation(request, hit.num_tokens, num_new_tokens, now_s)
        if reservation.num_tokens <= num_new_tokens or not self._view.running:
            return True
        num_needed = self._kv_cache_manager.num_free_blocks_needed(
            request, reservation.num_tokens, hit)
        num_reservable_blocks = 0
        for pin in reservation.pins:
            if self._pins.get(pin.job_id) is not pin or pin.job_id == request.job_id:
                raise RuntimeError(f"policy counted the pin of job {pin.job_id!r} as room for "
                                   f"{request.request_id!r}: not live, or its own job's")
            num_reservable_blocks += pin.num_blocks
        num_free_blocks = self._kv_cache_manager.block_pool.num_free_blocks
        return num_needed <= num_free_blocks + num_reservable_blocks

    def _num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self._view.block_size)

    def _shares(self, plan: StepPlan) -> TenantShares:
        """The running requests' use of the batch and KV pool by tenant, now: a request's
        blocks are those it holds beyond the prefix it found cached at its first admission,
        so that a prefix its tenant's requests share counts about once."""
        req_to_blocks = self._kv_cache_manager.req_to_blocks
        block_size = self._view.block_size

        def num_blocks_of(request: Request) -> int:
            num_held = len(req_to_blocks.get(request.request_id, ()))
            return max(0, num_held - (request.num_cached_tokens or 0) // block_size)

        return TenantShares.measure(
            self._view.running, self._view.waiting.tenants(), num_blocks_of,
            max_num_seqs=self._max_num_seqs, num_kv_blocks=self._view.num_kv_blocks,
            admitted_now={request.request_id for request in plan.admitted})
