"""Each tenant's share of the running batch and of the KV pool, kept by preemption.

The waiting queue takes turns among tenants (`tenant_queue`), but a turn comes only when a
sequence slot and blocks are free. In `python -m lab flood` one tenant's completions
filled the batch and the KV pool, and another tenant's request, first in line, waited up to
9 s for one of them to finish. So, with requests of several tenants running or waiting, each
tenant's share is an equal part of `max_num_seqs` and of the KV pool; what a tenant holds is
the sequences and blocks of its running requests.

- A waiting request whose tenant would stay within its share once admitted, but which finds
  no free slot or no free blocks, preempts the latest admitted running request of the
  tenant furthest over its share, one at a time, while there is such a tenant that would
  still hold its share of sequences or of blocks without that request.
- When a running request needs blocks and the policy picks as victim a request of a tenant
  within its share, the latest admitted request of the tenant furthest over its share goes
  instead (the requester itself, if that is its own); with no tenant over its share, the
  requester's tenant's latest goes in place of another tenant's request if the blocks would
  take the requester's tenant past its share.
- A tenant whose next waiting request was preempted in the step, or cannot be admitted and
  would take it past its share, is passed over for the rest of the step; the others'
  requests are tried.

So a tenant within its share loses blocks to another tenant only if that tenant stays
within its own, and a tenant over its share gives them up, which keeps two tenants from
preempting each other back and forth. Alone, a tenant may use everything: nothing is
reserved for tenants that send nothing. With requests of one tenant only (or none: every
request's tenant None) nothing here runs and the policy's victims stand. Across tenants
this rule, not the policy's victim order, decides; within a tenant the policy's does.

A request counts the blocks it holds beyond the prefix it found cached when first
admitted, so that a prefix its tenant's requests share counts about once (a cached prefix
whose request has finished counts for no one).

A known cost of the rule that a tenant keeps its share without the request it gives up: a
tenant over its share with a few large requests keeps them, and another tenant's request
waits until they grow or one finishes.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass

from engine.request import Request


@dataclass(frozen=True, slots=True)
class TenantShares:
    """The running requests' use of the batch and the KV pool by tenant, at one moment.

    Built by the scheduler (`measure`) when it considers a preemption for fairness, and
    dropped after: the running list changes with every preemption."""

    num_tenants: int
    share_seqs: float
    share_blocks: float
    num_seqs: dict[str | None, int]
    num_blocks: dict[str | None, int]
    # Each tenant's latest admitted running request that may be preempted (none admitted
    # in the step being planned: a request is not admitted and preempted in one step).
    latest: dict[str | None, Request]
    latest_num_blocks: dict[str | None, int]  # the blocks each `latest` request counts for

    @classmethod
    def measure(cls, running: Sequence[Request], waiting_tenants: Iterable[str | None],
                num_blocks_of: Callable[[Request], int], *, max_num_seqs: int,
                num_kv_blocks: int, admitted_now: Collection[str] = (),
                pinned_blocks: Mapping[str | None, int] | None = None) -> TenantShares:
        """The shares of the tenants with requests running (in admission order, as the
        scheduler keeps them) or waiting, or blocks pinned (`pinned_blocks`, by tenant, which
        count toward their blocks); `num_blocks_of` gives the blocks a running request
        counts for, and `admitted_now` the ids of those admitted in the step being
        planned."""
        num_seqs: dict[str | None, int] = {}
        num_blocks: dict[str | None, int] = dict(pinned_blocks or {})
        latest: dict[str | None, Request] = {}
        latest_num_blocks: dict[str | None, int] = {}
        for request in running:
            tenant = request.tenant
            request_num_blocks = num_blocks_of(request)
            num_seqs[tenant] = num_seqs.get(tenant, 0) + 1
            num_blocks[tenant] = num_blocks.get(tenant, 0) + request_num_blocks
            if request.request_id not in admitted_now:
                latest[tenant] = request
                latest_num_blocks[tenant] = request_num_blocks
        num_tenants = len(set(num_seqs).union(waiting_tenants, num_blocks))
        divisor = max(1, num_tenants)
        return cls(num_tenants, max_num_seqs / divisor, num_kv_blocks / divisor,
                   num_seqs, num_blocks, latest, latest_num_blocks)

    def excess(self, tenant: str | None) -> float:
        """How far `tenant` is over its share, as a fraction of the share (the larger of its
        sequences' and its blocks'); 0 or less when within it."""
        return max(self.num_seqs.get(tenant, 0) / self.share_seqs,
                   self.num_blocks.get(tenant, 0) / self.share_blocks) - 1

    def fits_share(self, tenant: str | None, num_blocks_needed: int) -> bool:
        """Whether `tenant` stays within its share with one more request of
        `num_blocks_needed` blocks."""
        return (self.num_seqs.get(tenant, 0) + 1 <= self.share_seqs
                and self.num_blocks.get(tenant, 0) + num_blocks_needed <= self.share_blocks)

    def most_over(self, excluding: str | None) -> str | None:
        """The tenant furthest over its share other than `excluding`, among those that
        would still hold at least their share of sequences or of blocks without their
        latest request; None if there is none (or fewer than two tenants)."""
        if self.num_tenants < 2:
            return None
        over = [tenant for tenant in self.latest
                if tenant != excluding and self.excess(tenant) > 0
                and self._at_share_without_latest(tenant)]
        return max(over, key=self.excess, default=None)

    def _at_share_without_latest(self, tenant: str | None) -> bool:
        """Whether `tenant` holds at least its share of sequences or of blocks without its
        latest request: then preempting that request cannot leave it under its share, and
        it cannot take the room back at once."""
        return (self.num_seqs[tenant] - 1 >= self.share_seqs
                or self.num_blocks[tenant] - self.latest_num_blocks[tenant] >= self.share_blocks)

    def victim_for_waiting(self, request: Request, num_blocks_needed: int) -> Request | None:
        """The running request to preempt so that waiting `request` (of
        `num_blocks_needed` blocks) may run, or None: its tenant would pass its share, or no
        other tenant is over its own."""
        if self.num_tenants < 2 or not self.fits_share(request.tenant, num_blocks_needed):
            return None
        over = self.most_over(excluding=request.tenant)
        return None if over is None else self.latest[over]

    def victim_instead_of(self, chosen: Request, requester: Request,
                          num_blocks_needed: int) -> Request:
        """The running request to preempt in place of the policy's `chosen` victim, for
        running `requester`, which needs `num_blocks_needed` more blocks. `chosen` stands
        when its tenant is over its share. Otherwise the latest of the tenant furthest over
        its share goes instead; with none, `chosen` stands if it is of `requester`'s tenant,
        and else the latest of `requester`'s tenant (maybe `requester`) goes if the blocks
        would take that tenant past its share."""
        if self.num_tenants < 2 or self.excess(chosen.tenant) > 0:
            return chosen
        over = self.most_over(excluding=chosen.tenant)
        if over is not None:
            return self.latest[over]
        own_tenant = requester.tenant
        if (chosen.tenant != own_tenant
                and self.num_blocks.get(own_tenant, 0) + num_blocks_needed > self.share_blocks):
            return self.latest.get(own_tenant, requester)
        return chosen
