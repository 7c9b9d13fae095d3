"""Refusals answered late to a tenant that sends again before its `Retry-After` has passed.

A refused request costs its client little: it may send again at once, ignoring the
`Retry-After` it was given. The Responses attack of `python -m lab bodies` does exactly that,
about 90 times a second from 12 clients; each attempt opens a connection and writes megabytes into a
socket that the server then closes, and that churn, not the server's work, took the CPU the
other tenant's requests wanted.

`RefusalPacer` answers such a refusal only after the `Retry-After` delay: a tenant's refusal
that comes less than `delay_s` after the same tenant's previous refusal was answered waits
`delay_s` before it is sent, its connection held and its body left unread meanwhile, so that
its client stalls instead of sending again. Only refusals made before any of the body is
read (a declared `Content-Length` that does not fit) are paced: holding one made midway
would hold what was read. A tenant whose clients wait out `Retry-After` gets each refusal at
once; several clients of one tenant refused within `delay_s` of each other get all but the
first refusal `delay_s` late (they are told to wait that long anyway). At most
`max_waiting_per_tenant` refusals of a tenant wait at once (each holds a connection and the
kernel's buffer of its unread bytes); past that they are answered at once. On a server
without keys every client is one tenant (`None`). A client that goes away while its refusal
waits gives its place up within `PEER_CHECK_INTERVAL_S` where the server's protocol can see
it go (`PEER_CLOSED_EXTENSION`, set by `continuum serve`'s: a client that sent little of its
body, one waiting for `100 Continue` say, or that reset its connection; not one that closes
with megabytes still unsent, whose close waits behind them): the refusal is then answered
at once and not counted as paced. Otherwise, and behind the replicated ingress, it keeps
its place until the delay ends.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

from engine.clock import Clock

DEFAULT_MAX_PACED_REFUSALS_PER_TENANT = 32
# The ASGI scope's extension (under `scope["extensions"]`) that a server protocol may set to a
# callable saying whether the request's client has closed its side of the connection.
PEER_CLOSED_EXTENSION = "continuum.peer_closed"
# How often a waiting refusal looks whether its client went away, seconds.
PEER_CHECK_INTERVAL_S = 0.05


def peer_closed_check(scope: dict[str, Any]) -> Callable[[], bool] | None:
    """The request's `PEER_CLOSED_EXTENSION` callable, if its server set one."""
    extensions = scope.get("extensions") or {}
    check = extensions.get(PEER_CLOSED_EXTENSION)
    return check if callable(check) else None


class RefusalPacer:
    """When to answer a tenant's refusals (`None` is the tenant of a server without keys).

    Owned by the server (or the replicated ingress) and called from its event loop only;
    `clock` (seconds, monotonic) and `sleep` are injected for tests."""

    def __init__(self, delay_s: float,
                 max_waiting_per_tenant: int = DEFAULT_MAX_PACED_REFUSALS_PER_TENANT, *,
                 clock: Clock = time.monotonic,
                 sleep: Callable[[float], Awaitable[None]] = asyncio.sleep) -> None:
        if delay_s < 0 or max_waiting_per_tenant < 0:
            raise ValueError(f"delay_s and max_waiting_per_tenant must be at least 0, got "
                             f"{delay_s} and {max_waiting_per_tenant}")
        self.delay_s = delay_s
        self.max_waiting_per_tenant = max_waiting_per_tenant
        self._clock = clock
        self._sleep = sleep
        # When each tenant's latest refusal was answered (or made, while it waits), seconds
        # on `clock`: one entry a tenant ever refused (tenants are the server's keys).
        self._last_answer_s: dict[str | None, float] = {}
        self._waiting: Counter[str | None] = Counter()
        # Refusals answered late so far: what /metrics reports.
        self.num_paced = 0

    def waiting(self, tenant: str | None) -> int:
        """How many of `tenant`'s refusals wait now."""
        return self._waiting[tenant]

    async def pace(self, tenant: str | None,
                   peer_closed: Callable[[], bool] | None = None) -> bool:
        """Called once a request of `tenant` is refused, before any of its body is read and
        before the refusal is answered; returns when it may be answered: at once if the
        tenant's previous refusal was answered at least `delay_s` ago (or never), or if
        `max_waiting_per_tenant` of its refusals already wait; else after `delay_s`, or as
        soon as `peer_closed` (looked at every `PEER_CHECK_INTERVAL_S`) says the client went
        away. Returns whether it waited the whole delay."""
        now_s = self._clock()
        previous_s = self._last_answer_s.get(tenant)
        self._last_answer_s[tenant] = now_s
        if (previous_s is None or now_s - previous_s >= self.delay_s
                or self._waiting[tenant] >= self.max_waiting_per_tenant):
            return False
        self._waiting[tenant] += 1
        try:
            waited = await self._wait(now_s + self.delay_s, peer_closed)
        finally:
            self._waiting[tenant] -= 1
            if not self._waiting[tenant]:
                del self._waiting[tenant]
        if not waited:
            return False
        # A client that sends again as soon as this answer comes is paced again.
        self._last_answer_s[tenant] = max(self._last_answer_s[tenant], self._clock())
        self.num_paced += 1
        return True

    async def _wait(self, until_s: float, peer_closed: Callable[[], bool] | None) -> bool:
        """Sleeps until `until_s` on the clock; False if `peer_closed` said so first."""
        if peer_closed is None:
            await self._sleep(self.delay_s)
            return True
        while (left_s := until_s - self._clock()) > 0:
            if peer_closed():
                return False
            await self._sleep(min(left_s, PEER_CHECK_INTERVAL_S))
        return True
