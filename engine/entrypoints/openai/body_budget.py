"""The bytes of request bodies a server holds at once, and each tenant's share of them.

A server holds the body of every request in progress: it reads the body whole, and a route's
request keeps it until the response ends (a stream's for as long as the stream). With only a
per-body limit, one client that opens many connections, each sending a body of up to
`max_request_body_bytes` and stopping one byte short, makes the server hold all of them:
60 such bodies of 15.9 MB grew `continuum serve` by 1.05 GB in 4.5 s, and the connection
cap (1,024) would let about 18 GB in.

`BodyByteBudget` counts the body bytes that requests in progress hold. A request reserves
its body's bytes as they arrive and gives them back once its response has ended; bytes a
client only announced cost nothing, so connections that send headers and no body cannot
fill the budget. A body whose declared `Content-Length` does not fit in what is free now is
refused before any of it is read. With several tenants each may hold at most half the total
(at least one body of the largest size): past its share a tenant's request gets 429, so one
tenant's bodies leave room for the others' (unless the total is under two largest bodies).
Past the total a request gets 503; with one tenant (a server without keys, or with one key)
all clients share the whole budget and only that 503 applies. Both say `Retry-After`.

Bodies that arrive at once grow together, so refusing whichever chunk comes when the room
runs out could refuse a body almost all received for one that had just begun. Instead the
oldest bodies go on: a chunk that does not fit takes back the bytes of bodies still
arriving whose first bytes came after its body's, youngest first (its tenant's, for its
tenant's share; for the total, its tenant's, then those of tenants holding more than its
tenant), and those requests are refused, as the chunk's would have been, at once, even
while they wait for their client's next bytes. Only when that would not make room is the
chunk's own request refused. A body's age counts from its first bytes, not its headers,
which cost nothing.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import TypeVar

from engine.entrypoints.openai.errors import APIError

DEFAULT_MAX_BODY_BYTES_IN_FLIGHT = 256 * 1024 * 1024
# More digits than any length an HTTP server accepts (h11 allows at most 20).
_MAX_CONTENT_LENGTH_DIGITS = 20

T = TypeVar("T")


def parse_content_length(value: bytes | str) -> int | None:
    """The length a `Content-Length` header value declares; None unless it is 1 to 20 ASCII
    digits."""
    text = value.decode("latin-1") if isinstance(value, bytes) else value
    if not 0 < len(text) <= _MAX_CONTENT_LENGTH_DIGITS or not text.isascii():
        return None
    return int(text) if text.isdigit() else None


class BodyRefused(APIError):
    """A request refused because its body has no room in a `BodyByteBudget`: 429 past its
    tenant's share, 503 past the total, both with `Retry-After`."""


class BodyByteBudget:
    """Body bytes held by requests in progress: at most `max_bytes` in all and
    `max_bytes_per_tenant` for one tenant (`None` is the tenant of a server without keys).

    Owned by the server (or the replicated ingress); its methods are called from that
    server's event loop only, so it needs no lock. Requests hold bytes through a
    `BodyReservation` each, which gives them all back once.
    """

    def __init__(self, max_bytes: int, max_bytes_per_tenant: int | None = None, *,
                 retry_after_s: int = 1) -> None:
        per_tenant = max_bytes if max_bytes_per_tenant is None else max_bytes_per_tenant
        if max_bytes < 1 or not 1 <= per_tenant <= max_bytes:
            raise ValueError(f"max_bytes must be positive and max_bytes_per_tenant in "
                             f"[1, max_bytes], got {max_bytes} and {max_bytes_per_tenant}")
        self.max_bytes = max_bytes
        self.max_bytes_per_tenant = per_tenant
        self.retry_after_s = retry_after_s
        self._held_bytes = 0
        self._held_by_tenant: dict[str | None, int] = {}
        self._ages = itertools.count()
        # The reservations of bodies still arriving that hold bytes, by age: those a chunk of
        # an older body may take its room back from.
        self._arriving: dict[int, BodyReservation] = {}
        # Requests refused so far, by status (429 or 503), those revoked midway included:
        # what /metrics reports.
        self.num_refused: Counter[int] = Counter()

    @classmethod
    def for_tenants(cls, num_tenants: int, max_bytes: int, largest_body_bytes: int, *,
                    retry_after_s: int = 1) -> BodyByteBudget:
        """A budget in which, when there are several tenants, each may hold at most half of
        `max_bytes`, but at least `largest_body_bytes`; all of it when there is one.
        ValueError if `max_bytes` is below `largest_body_bytes`."""
        if max_bytes < largest_body_bytes:
            raise ValueError(f"the body bytes in flight ({max_bytes}) must be at least the "
                             f"largest request body ({largest_body_bytes})")
        per_tenant = max_bytes if num_tenants <= 1 else max(max_bytes // 2, largest_body_bytes)
        return cls(max_bytes, per_tenant, retry_after_s=retry_after_s)

    @property
    def held_bytes(self) -> int:
        """The bytes held now, by every tenant."""
        return self._held_bytes

    def tenant_held_bytes(self, tenant: str | None) -> int:
        """The bytes `tenant`'s requests hold now."""
        return self._held_by_tenant.get(tenant, 0)

    def check_room(self, tenant: str | None, num_bytes: int) -> None:
        """APIError 429 or 503 (see the module docstring) if `tenant` could not hold
        `num_bytes` more now; holds nothing either way (for a declared length)."""
        refusal = self._refusal(tenant, num_bytes)
        if refusal is None:
            return
        self.num_refused[refusal.status_code] += 1
        try:
            raise refusal
        finally:
            del refusal  # see `hold`

    def reserve(self, tenant: str | None, num_bytes: int) -> None:
        """Holds `num_bytes` more for a request of `tenant`; holds nothing and raises as
        `check_room` does if they do not fit."""
        self.check_room(tenant, num_bytes)
        if num_bytes:
            self._held_bytes += num_bytes
            self._held_by_tenant[tenant] = self.tenant_held_bytes(tenant) + num_bytes

    def release(self, tenant: str | None, num_bytes: int) -> None:
        """Gives back `num_bytes` that `tenant`'s request held; ValueError (changing
        nothing) if the tenant does not hold that many."""
        tenant_bytes = self.tenant_held_bytes(tenant)
        if not 0 <= num_bytes <= tenant_bytes:
            raise ValueError(f"releasing {num_bytes} bytes of a tenant that holds "
                             f"{tenant_bytes}")
        if num_bytes == tenant_bytes:
            self._held_by_tenant.pop(tenant, None)
        else:
            self._held_by_tenant[tenant] = tenant_bytes - num_bytes
        self._held_bytes -= num_bytes

    def reservation(self, tenant: str | None) -> BodyReservation:
        """A new request's reservation for `tenant`."""
        return BodyReservation(self, tenant)

    def hold(self, reservation: BodyReservation, num_bytes: int, *, arriving: bool
             ) -> list[BodyReservation]:
        """Holds `num_bytes` more for `reservation` (`arriving`: whether more of its body is
        to come). When they do not fit, revokes reservations of bodies still arriving that
        are younger than it, youngest first, until they do (see the module docstring), and
        returns those revoked. APIError 429 or 503, revoking and holding nothing, if even
        revoking all of them would leave no room."""
        if reservation.age is None and num_bytes > 0:
            reservation.age = next(self._ages)
        revoked: list[tuple[BodyReservation, BodyRefused]] = []
        refusal = self._refusal(reservation.tenant, num_bytes)
        if refusal is not None:
            planned = self._younger_to_revoke(reservation, num_bytes)
            if planned is None:
                self.forget(reservation)
                self.num_refused[refusal.status_code] += 1
                try:
                    raise refusal
                finally:
                    # Its traceback holds this frame: kept here, it would hold it back, a
                    # cycle through the reader's frames and the body read so far that only
                    # the cyclic collector frees.
                    del refusal
            revoked = planned
        for younger, its_refusal in revoked:
            self.forget(younger)
            self.release(younger.tenant, younger.num_bytes)
            self.num_refused[its_refusal.status_code] += 1
            younger.revoke(its_refusal)
        self.reserve(reservation.tenant, num_bytes)
        self.forget(reservation)
        if arriving and reservation.num_bytes + num_bytes > 0:
            self._arriving[reservation.age] = reservation
        return [younger for younger, _ in revoked]

    def is_arriving(self, reservation: BodyReservation) -> bool:
        """Whether `reservation` holds bytes of a body still arriving (and may be revoked)."""
        return reservation.age is not None and self._arriving.get(reservation.age) is reservation

    def forget(self, reservation: BodyReservation) -> None:
        """Stops counting `reservation` among the bodies arriving, which may be revoked (its
        body is complete, or its request is refused or ending)."""
        if self.is_arriving(reservation):
            del self._arriving[reservation.age]

    def _younger_to_revoke(self, reservation: BodyReservation, num_bytes: int
                           ) -> list[tuple[BodyReservation, BodyRefused]] | None:
        """The reservations to revoke, each with its refusal, so that `num_bytes` more fit
        for `reservation`, youngest first: for its tenant's share, its tenant's younger
        bodies; for the total, those left, then younger bodies of tenants holding more than
        its tenant. None if that would not make room."""
        tenant = reservation.tenant
        first_age = -1 if reservation.age is None else reservation.age
        younger = [other for age, other in sorted(self._arriving.items(), reverse=True)
                   if age > first_age]
        own = [other for other in younger if other.tenant == tenant]
        plan: list[tuple[BodyReservation, BodyRefused]] = []
        over_share = 0 if self.max_bytes_per_tenant == self.max_bytes else (
            self.tenant_held_bytes(tenant) + num_bytes - self.max_bytes_per_tenant)
        while over_share > 0 and len(plan) < len(own):
            other = own[len(plan)]
            plan.append((other, self._error(
                429, "an earlier request of this tenant needed the room its body held",
                "rate_limit_exceeded")))
            over_share -= other.num_bytes
        if over_share > 0:
            return None
        over_total = (self._held_bytes + num_bytes - self.max_bytes
                      - sum(other.num_bytes for other, _ in plan))
        tenant_bytes = self.tenant_held_bytes(tenant)
        larger = [other for other in younger if other.tenant != tenant
                  and self.tenant_held_bytes(other.tenant) > tenant_bytes]
        for other in own[len(plan):] + larger:
            if over_total <= 0:
                break
            plan.append((other, self._error(
                503, "an earlier request needed the room its body held", "server_busy")))
            over_total -= other.num_bytes
        return None if over_total > 0 else plan

    def _refusal(self, tenant: str | None, num_bytes: int) -> BodyRefused | None:
        if num_bytes < 0:
            raise ValueError(f"num_bytes must be at least 0, got {num_bytes}")
        tenant_bytes = self.tenant_held_bytes(tenant)
        if (self.max_bytes_per_tenant < self.max_bytes
                and tenant_bytes + num_bytes > self.max_bytes_per_tenant):
            return self._error(429, f"this tenant's requests in progress hold {tenant_bytes} "
                                    f"bytes of request bodies; {num_bytes} more would pass its "
                                    f"share of {self.max_bytes_per_tenant}",
                               "rate_limit_exceeded")
        if self._held_bytes + num_bytes > self.max_bytes:
            return self._error(503, f"the requests in progress hold {self._held_bytes} bytes "
                                    f"of request bodies; {num_bytes} more would pass the "
                                    f"server's {self.max_bytes}", "server_busy")
        return None

    def _error(self, status: int, message: str, code: str) -> BodyRefused:
        return BodyRefused(status, f"{message}; retry later", code=code,
                        headers={"Retry-After": str(self.retry_after_s), "Connection": "close"})


class BodyReservation:
    """The bytes one request's body holds in a `BodyByteBudget` for `tenant`; `age` orders
    reservations by when their bodies began to hold bytes (None before), set by the budget.
    Made by `BodyByteBudget.reservation` and used by whoever reads the request's body, on
    the budget's event loop; `release` is called once the body is no longer held (and may
    be called again: it then releases nothing).

    A reservation of a body still arriving may be revoked for an older one's room: it then
    holds nothing and `refusal` says why; the reader finds out from `unless_revoked` or
    `cover`, which raise it."""

    def __init__(self, budget: BodyByteBudget, tenant: str | None) -> None:
        self.budget = budget
        self.tenant = tenant
        self.age: int | None = None
        self.num_bytes = 0
        self.refusal: BodyRefused | None = None
        # Set while a reader waits in `unless_revoked`: `revoke` completes it.
        self._revoked: asyncio.Future[None] | None = None

    def check_declared(self, num_bytes: int) -> None:
        """APIError 429 or 503 if a body of `num_bytes` (its declared length) could not be
        held now; holds nothing, so that a client cannot fill the budget by announcing
        bodies it does not send."""
        self.budget.check_room(self.tenant, max(0, num_bytes - self.num_bytes))

    def cover(self, num_bytes_read: int, *, complete: bool) -> None:
        """Holds what has been read of the body (`num_bytes_read`, growing; `complete` once
        it is all read), revoking younger bodies' reservations if need be; APIError 429 or
        503, holding nothing more, if the budget has no room for the rest, or if this
        reservation was revoked."""
        if self.refusal is not None:
            raise self.refusal
        self.budget.hold(self, max(0, num_bytes_read - self.num_bytes), arriving=not complete)
        self.num_bytes = max(self.num_bytes, num_bytes_read)

    def stop_arriving(self) -> None:
        """Called by the reader that refuses the body itself (too large): it can no longer
        be revoked, nor counted as refused a second time."""
        self.budget.forget(self)

    async def unless_revoked(self, receive: Callable[[], Awaitable[T]]) -> T:
        """What `receive()` (the next piece of the body) returns, unless this reservation
        is revoked first, or was: then APIError, its refusal, and the piece is not awaited
        further."""
        if self.refusal is not None:
            raise self.refusal
        if not self.budget.is_arriving(self):
            return await receive()
        receiving = asyncio.ensure_future(receive())
        revoked = self._revoked = asyncio.get_running_loop().create_future()
        try:
            await asyncio.wait((receiving, revoked), return_when=asyncio.FIRST_COMPLETED)
        finally:
            self._revoked = None
            if not receiving.done():
                receiving.cancel()
        if self.refusal is not None:
            if receiving.done() and not receiving.cancelled():
                receiving.exception()  # retrieved: the refusal is the answer
            raise self.refusal
        return receiving.result()

    def revoke(self, refusal: BodyRefused) -> None:
        """Called by the budget, which has taken back this reservation's bytes: the request
        is refused with `refusal`, at once if its reader waits in `unless_revoked`."""
        self.num_bytes = 0
        self.refusal = refusal
        if self._revoked is not None and not self._revoked.done():
            self._revoked.set_result(None)

    def release(self) -> None:
        """Gives back everything held."""
        self.budget.forget(self)
        self.budget.release(self.tenant, self.num_bytes)
        self.num_bytes = 0
        # The refusal, once raised, holds the reader's frames (and the body read so far)
        # through its traceback, and they hold this reservation: without this, a cycle. The
        # refusal itself stays, should the reader call again.
        if self.refusal is not None:
            self.refusal.__traceback__ = None
