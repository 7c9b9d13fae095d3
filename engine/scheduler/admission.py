"""Admission control: what a waiting request must find before the scheduler admits it, and
what tenants may hold.

Two rules beside the blocks of this step's chunk: tenants' shares of the batch and of the KV
pool (`tenant_shares`, from the moment requests of two tenants were seen), pins counting
toward their tenant's blocks, and the room the policy wants reserved for a prompt's later
chunks (`SchedulingPolicy.reservation`). While tenants compete, a tenant's pins hold at most
its share of the pool, and a request short of blocks takes the pins of another tenant over
its share before any the policy would give up. Owned by `Scheduler`, which asks before each
admission attempt and allocation and carries out the preemptions and releases this module
names; it changes nothing itself.
"""

from __future__ import annotations

from engine.kv_cache.manager import KVCacheManager, PrefixHit
from engine.kv_cache.pins import Pin, PinTable
from engine.request import Request
from engine.scheduler.policy import SchedulerView, SchedulingPolicy
from engine.scheduler.step_plan import StepPlan
from engine.scheduler.tenant_shares import TenantShares

# How long a tenant that sent a request counts toward the number of tenants sharing the KV
# pool's pins, seconds: longer than a tool call between an agent's turns
# (docs/decisions/0031-tenant-pin-share.md).
TENANT_WINDOW_S = 300.0


class Admission:
    """Reads the scheduler (`view`), its KV cache manager and pins; remembers when each
    tenant (None among them) last sent a request, for `TENANT_WINDOW_S` (seconds on the
    scheduler's clock): shares apply once two tenants were seen, and a tenant's pin cap is
    its equal share among the tenants seen within the window."""

    def __init__(self, view: SchedulerView, kv_cache_manager: KVCacheManager, pins: PinTable,
                 policy: SchedulingPolicy, *, max_num_seqs: int) -> None:
        self._view = view
        self._kv_cache_manager = kv_cache_manager
        self._pins = pins
        self._policy = policy
        self._max_num_seqs = max_num_seqs
        self._tenants_compete = False
        self._last_arrival_s: dict[str | None, float] = {}  # by tenant, oldest first

    def note_arrival(self, request: Request, now_s: float) -> None:
        """Called for every request the scheduler queues, at `now_s`."""
        arrivals = self._last_arrival_s
        arrivals.pop(request.tenant, None)
        arrivals[request.tenant] = now_s
        for tenant, arrived_s in list(arrivals.items()):
            if arrived_s >= now_s - TENANT_WINDOW_S:
                break
            del arrivals[tenant]
        self._tenants_compete = self._tenants_compete or len(arrivals) > 1

    @property
    def tenants_compete(self) -> bool:
        """Whether requests of two tenants were ever seen: tenants' shares apply then."""
        return self._tenants_compete

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

    def takes_share_back(self, request: Request, plan: StepPlan) -> bool:
        """Whether admitting waiting `request` would take its tenant's share back from a
        tenant over its own (there is a `share_victim` for it)."""
        return self.share_victim(request, plan) is not None

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
                          now_s: float, plan: StepPlan) -> bool:
        """Whether the blocks of the tokens the policy wants reserved beyond this step's chunk
        are free or held by the pins it names (`SchedulingPolicy.reservation`), by clients'
        pins of other jobs or by pins of other tenants over their share. Always True while
        nothing runs: nothing else could free blocks for it then."""
        reservation = self._policy.reservation(request, hit.num_tokens, num_new_tokens, now_s)
        if reservation.num_tokens <= num_new_tokens or not self._view.running:
            return True
        num_needed = self._kv_cache_manager.num_free_blocks_needed(
            request, reservation.num_tokens, hit)
        for pin in reservation.pins:
            if self._pins.get(pin.job_id) is not pin or pin.job_id == request.job_id:
                raise RuntimeError(f"policy counted the pin of job {pin.job_id!r} as room for "
                                   f"{request.request_id!r}: not live, or its own job's")
        client_pins = [pin for pin in self._client_pins_for(request, reservation.num_tokens, plan)
                       if pin.job_id != request.job_id]
        reservable = {pin.job_id: pin for pin in (*reservation.pins, *client_pins,
                                                  *self._pins_over_share(request, plan))}
        num_reservable_blocks = sum(pin.num_blocks for pin in reservable.values())
        num_free_blocks = self._kv_cache_manager.block_pool.num_free_blocks
        return num_needed <= num_free_blocks + num_reservable_blocks

    def over_share_pin(self, requester: Request, plan: StepPlan) -> Pin | None:
        """For `requester`, short of blocks: the pin to release before any the policy would
        give up, the latest of the tenant furthest over its share of the KV pool (its pins
        counted) among the other tenants; None while tenants do not compete, or with no
        such pin."""
        pins = self._pins_over_share(requester, plan)
        if not pins:
            return None
        shares = self._shares(plan)
        return max(pins, key=lambda pin: (shares.excess(pin.tenant), pin.pinned_at_s))

    def client_pin_for(self, requester: Request, num_new_tokens: int,
                       plan: StepPlan) -> Pin | None:
        """For `requester`, short of blocks for `num_new_tokens` more tokens once no tenant
        over its share has a pin to give (`over_share_pin`): the clients' pin to release
        before any the policy would give up, the one nearest its deadline of those it may
        take (`_client_pins_for`)."""
        return next(iter(self._client_pins_for(requester, num_new_tokens, plan)), None)

    def _client_pins_for(self, requester: Request, num_new_tokens: int,
                         plan: StepPlan) -> list[Pin]:
        """The clients' pins `requester` may take for `num_new_tokens` more tokens, in the
        order it takes them: its own tenant's first, then, if its tenant stays within its
        share with those tokens' blocks (or nothing runs), every other tenant's; each group
        nearest its deadline first (docs/decisions/0031-tenant-pin-share.md). So a tenant
        within its share never loses a client pin to a tenant that would go over its own."""
        client_pins = sorted((pin for pin in self._pins if pin.source == "client"),
                             key=lambda pin: pin.deadline_s)
        own = [pin for pin in client_pins if pin.tenant == requester.tenant]
        if len(own) == len(client_pins) or (
                self.tenants_compete and self._view.running
                and not self._stays_within_share(requester, num_new_tokens, plan)):
            return own
        return own + [pin for pin in client_pins if pin.tenant != requester.tenant]

    def _stays_within_share(self, requester: Request, num_new_tokens: int,
                            plan: StepPlan) -> bool:
        """Whether `requester`'s tenant holds at most its share of the pool with the blocks
        of `num_new_tokens` more tokens (a waiting request's whole prompt, from the start)."""
        shares = self._shares(plan)
        num_tokens = (num_new_tokens if requester in self._view.running
                      else max(num_new_tokens, requester.num_tokens))
        num_held = shares.num_blocks.get(requester.tenant, 0)
        return num_held + self._num_blocks_for(num_tokens) <= shares.share_blocks

    def _pins_over_share(self, requester: Request, plan: StepPlan) -> list[Pin]:
        if not self.tenants_compete or not any(
                pin.tenant != requester.tenant for pin in self._pins):
            return []
        shares = self._shares(plan)
        return [pin for pin in self._pins
                if pin.tenant != requester.tenant and shares.excess(pin.tenant) > 0]

    def pin_cap_blocks(self, tenant: str | None) -> float | None:
        """The most blocks `tenant`'s pins may hold: its equal share of the KV pool among the
        tenants seen within `TENANT_WINDOW_S` and those holding pins, itself included; None
        (no cap) while tenants do not compete."""
        if not self.tenants_compete:
            return None
        tenants = set(self._last_arrival_s)
        tenants.update((pin.tenant for pin in self._pins), (tenant,))
        return self._view.num_kv_blocks / len(tenants)

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

        pinned_blocks = {tenant: self._pins.num_tenant_blocks(tenant)
                         for tenant in {pin.tenant for pin in self._pins}}
        return TenantShares.measure(
            self._view.running, self._view.waiting.tenants(), num_blocks_of,
            max_num_seqs=self._max_num_seqs, num_kv_blocks=self._view.num_kv_blocks,
            admitted_now={request.request_id for request in plan.admitted},
            pinned_blocks=pinned_blocks)
