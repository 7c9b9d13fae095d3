"""Pins: the mechanism that keeps a finished turn's KV blocks on the device for its job.

A pin is a block holder, like a running request: it owns one reference on each of its blocks
until it is released. Policies decide *when* to pin and release; this module only keeps the
books, so that every release carries a reason and reference counts stay exact.
"""

from __future__ import annotations

import enum
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Literal

from engine.kv_cache.block import KVCacheBlock
from engine.kv_cache.block_pool import BlockPool

# Who asked for a pin: the scheduling policy (a finished turn kept for its job's next one) or
# the client (a prompt prefix under a cache breakpoint, `Request.cache_breakpoint`).
PinSource = Literal["policy", "client"]


class PinReleaseReason(str, enum.Enum):
    """Why a pin stopped holding its blocks."""

    REUSED = "reused"  # the job's next turn was admitted and took the blocks itself
    EXPIRED = "expired"  # the TTL ran out with no turn of the job waiting
    PRESSURE = "pressure"  # the policy gave it up: memory was needed, or room for a new pin
    CLIENT_PRESSURE = "client_pressure"  # a client's pin went for a request short of blocks
    TENANT_SHARE = "tenant_share"  # its tenant held more than its share of the pool
    JOB_END = "job_end"  # the job's last turn finished or the job timed out
    REPLACED = "replaced"  # a newer turn of the same job was pinned
    RELEASE = "release"  # a client released the job explicitly
    ABORT = "abort"  # the job's next turn was aborted


@dataclass(slots=True)
class Pin:
    """The blocks of one finished turn `request_id` of `tenant` (None without tenants), held
    for `job_id` until `deadline_s` (policy time), as `source` asked. `blocks` are the turn's
    prefix-cached blocks in sequence order (a client's pin: those of its breakpoint's prefix).
    """

    job_id: str
    request_id: str
    blocks: list[KVCacheBlock]
    pinned_at_s: float
    ttl_s: float
    release_reason: PinReleaseReason | None = None
    released_at_s: float | None = None
    tenant: str | None = None
    source: PinSource = "policy"

    @property
    def deadline_s(self) -> float:
        return self.pinned_at_s + self.ttl_s

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)


class PinTable:
    """At most one live pin per job, in pin order (oldest first).

    Owns the block references of live pins. Called by the scheduler: `add` when a policy
    retains a finished turn, `release` on admission of the job's next turn, under memory
    pressure, on expiry, job end, explicit release or abort. `on_released` is told of every
    release (a replaced pin's after its successor is added).
    """

    def __init__(
        self,
        block_pool: BlockPool,
        *,
        on_released: Callable[[Pin], None] | None = None,
    ) -> None:
        self._block_pool = block_pool
        self._on_released = on_released
        self._pins: dict[str, Pin] = {}
        # How many live pins hold each block (by id), over all pins and by tenant: pins of
        # turns that share a prefix share its blocks, which are counted once.
        self._num_holders: Counter[int] = Counter()
        self._num_holders_by_tenant: dict[str | None, Counter[int]] = {}
        self.num_created = 0
        self.num_created_by_source: Counter[str] = Counter()  # "policy", "client"
        self.num_released: Counter[PinReleaseReason] = Counter()

    def add(
        self,
        job_id: str,
        request_id: str,
        blocks: list[KVCacheBlock],
        *,
        now_s: float,
        ttl_s: float,
        tenant: str | None = None,
        source: PinSource = "policy",
    ) -> Pin:
        """Creates a pin of `tenant`'s that takes over the caller's references on `blocks`.

        A live pin of the same job is released with reason REPLACED (after the new one holds its
        blocks, so shared blocks never touch the free queue).
        """
        if not blocks:
            raise ValueError("a pin must hold at least one block")
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be positive, got {ttl_s}")
        previous = self._pins.pop(job_id, None)
        pin = Pin(job_id, request_id, blocks, pinned_at_s=now_s, ttl_s=ttl_s, tenant=tenant,
                  source=source)
        self._pins[job_id] = pin
        self._count_holders(pin, +1)
        self.num_created += 1
        self.num_created_by_source[source] += 1
        if previous is not None:
            self._drop(previous, PinReleaseReason.REPLACED, now_s)
        return pin

    def release(self, job_id: str, reason: PinReleaseReason, *, now_s: float) -> Pin | None:
        """Releases the job's pin, if any: its blocks become ordinary evictable cache."""
        pin = self._pins.pop(job_id, None)
        if pin is not None:
            self._drop(pin, reason, now_s)
        return pin

    @property
    def num_pinned_blocks(self) -> int:
        """The blocks live pins hold, each counted once however many pins share it."""
        return len(self._num_holders)

    def num_tenant_blocks(self, tenant: str | None) -> int:
        """The blocks `tenant`'s live pins hold, each counted once."""
        holders = self._num_holders_by_tenant.get(tenant)
        return 0 if holders is None else len(holders)

    def num_sole_blocks(self, pin: Pin) -> int:
        """The blocks of the live `pin` that no other pin of its tenant holds."""
        holders = self._num_holders_by_tenant[pin.tenant]
        return sum(holders[block.block_id] == 1 for block in pin.blocks)

    def get(self, job_id: str) -> Pin | None:
        return self._pins.get(job_id)

    def __contains__(self, job_id: object) -> bool:
        return job_id in self._pins

    def __len__(self) -> int:
        return len(self._pins)

    def __iter__(self) -> Iterator[Pin]:
        return iter(list(self._pins.values()))

    def _count_holders(self, pin: Pin, change: Literal[1, -1]) -> None:
        tenant_holders = self._num_holders_by_tenant.setdefault(pin.tenant, Counter())
        for holders in (self._num_holders, tenant_holders):
            for block in pin.blocks:
                holders[block.block_id] += change
                if not holders[block.block_id]:
                    del holders[block.block_id]
        if not tenant_holders:
            del self._num_holders_by_tenant[pin.tenant]

    def _drop(self, pin: Pin, reason: PinReleaseReason, now_s: float) -> None:
        self._count_holders(pin, -1)
        self.num_released[reason] += 1
        pin.release_reason = reason
        pin.released_at_s = now_s
        self._block_pool.free_blocks(reversed(pin.blocks))
        if self._on_released is not None:
            self._on_released(pin)

    def check_invariants(self) -> None:
        """Pins are keyed by their job, hold cached blocks, and the block counts are exact."""
        holders: Counter[int] = Counter()
        by_tenant: dict[str | None, Counter[int]] = {}
        for job_id, pin in self._pins.items():
            assert pin.job_id == job_id, f"pin of {pin.job_id} filed under {job_id}"
            assert pin.release_reason is None, f"released pin of {job_id} still live"
            for block in pin.blocks:
                assert block.ref_cnt > 0, f"pin of {job_id} holds unreferenced {block}"
                assert block.block_hash is not None, f"pin of {job_id} holds uncached {block}"
            ids = [block.block_id for block in pin.blocks]
            assert len(set(ids)) == len(ids), f"pin of {job_id} holds a block twice"
            holders.update(ids)
            by_tenant.setdefault(pin.tenant, Counter()).update(ids)
        assert holders == self._num_holders, "pinned block counts drifted"
        assert by_tenant == self._num_holders_by_tenant, "tenants' pinned block counts drifted"
        released = sum(self.num_released.values())
        assert self.num_created == released + len(self._pins), "pins created != released + live"
