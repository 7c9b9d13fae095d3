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
"""

from __future__ import annotations

from collections import Counter

from engine.entrypoints.openai.errors import APIError

DEFAULT_MAX_BODY_BYTES_IN_FLIGHT = 256 * 1024 * 1024
# More digits than any length an HTTP server accepts (h11 allows at most 20).
_MAX_CONTENT_LENGTH_DIGITS = 20


def parse_content_length(value: bytes | str) -> int | None:
    """The length a `Content-Length` header value declares; None unless it is 1 to 20 ASCII
    digits."""
    text = value.decode("latin-1") if isinstance(value, bytes) else value
    if not 0 < len(text) <= _MAX_CONTENT_LENGTH_DIGITS or not text.isascii():
        return None
    return int(text) if text.isdigit() else None


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
        # Requests refused so far, by status (429 or 503): what /metrics reports.
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
        if refusal is not None:
            self.num_refused[refusal.status_code] += 1
            raise refusal

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

    def _refusal(self, tenant: str | None, num_bytes: int) -> APIError | None:
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

    def _error(self, status: int, message: str, code: str) -> APIError:
        return APIError(status, f"{message}; retry later", code=code,
                        headers={"Retry-After": str(self.retry_after_s), "Connection": "close"})


class BodyReservation:
    """The bytes one request's body holds in a `BodyByteBudget` for `tenant`. Made by
    whoever reads the request's body, on the budget's event loop; `release` is called once
    the body is no longer held (and may be called again: it then releases nothing)."""

    def __init__(self, budget: BodyByteBudget, tenant: str | None) -> None:
        self.budget = budget
        self.tenant = tenant
        self.num_bytes = 0

    def check_declared(self, num_bytes: int) -> None:
        """APIError 429 or 503 if a body of `num_bytes` (its declared length) could not be
        held now; holds nothing, so that a client cannot fill the budget by announcing
        bodies it does not send."""
        self.budget.check_room(self.tenant, max(0, num_bytes - self.num_bytes))

    def cover(self, num_bytes_read: int) -> None:
        """Holds what has been read of the body (`num_bytes_read`, growing); APIError 429 or
        503, holding nothing more, if the budget has no room for the rest."""
        if num_bytes_read > self.num_bytes:
            self.budget.reserve(self.tenant, num_bytes_read - self.num_bytes)
            self.num_bytes = num_bytes_read

    def release(self) -> None:
        """Gives back everything held."""
        self.budget.release(self.tenant, self.num_bytes)
        self.num_bytes = 0
