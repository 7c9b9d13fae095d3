"""Each tenant's engine requests in flight, counted so that one tenant cannot fill the engine's
waiting queue: the cap of `ServerSettings.max_waiting_requests_per_tenant`.

An engine request is one completion (a call with 64 prompts and `n` 16 makes 1,024). It
counts from the moment it is queued until its HTTP response has ended (the handlers then
abort whatever of it still runs), so the count covers the requests waiting in the engine,
those running, and those whose output is still being sent.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from weakref import WeakKeyDictionary

from engine.frontend.processor import ProcessedRequest

# One book per engine, shared by the endpoint handlers that serve it.
_BOOKS: WeakKeyDictionary[object, TenantEngineRequests] = WeakKeyDictionary()


class TenantEngineRequests:
    """The engine requests of each tenant (None on a server without API keys) whose response
    has not ended. Called from the server's event loop only."""

    def __init__(self) -> None:
        self._tenant_and_count: dict[str, tuple[str | None, int]] = {}  # by request id
        self._counts: Counter[str | None] = Counter()

    @classmethod
    def of(cls, engine: object) -> TenantEngineRequests:
        """The book of `engine`'s requests, made on first use."""
        book = _BOOKS.get(engine)
        if book is None:
            book = _BOOKS[engine] = cls()
        return book

    def count(self, tenant: str | None) -> int:
        """How many of `tenant`'s engine requests are in flight."""
        return self._counts[tenant]

    def add(self, tenant: str | None, requests: Iterable[ProcessedRequest]) -> None:
        """Counts queued `requests` (each its `n` engine requests) toward `tenant`."""
        for processed in requests:
            num_requests = len(processed.core_requests)
            self._tenant_and_count[processed.request_id] = (tenant, num_requests)
            self._counts[tenant] += num_requests

    def release(self, requests: Iterable[ProcessedRequest]) -> None:
        """Stops counting `requests` (those counted; once each)."""
        for processed in requests:
            counted = self._tenant_and_count.pop(processed.request_id, None)
            if counted is None:
                continue
            tenant, num_requests = counted
            self._counts[tenant] -= num_requests
            if not self._counts[tenant]:
                del self._counts[tenant]
