"""Grammars waiting for the compile thread, taken by tenants in turn.

The engine core compiles one grammar at a time (`manager.py`). Taken first come first
served, a tenant that sends thirty slow grammars at once would put every other tenant's next
grammar behind all thirty; taken in turn, another tenant's next grammar waits for the
compile running and at most one compile of each tenant ahead of it, whatever their backlogs.
"""

from __future__ import annotations

import threading
from collections import OrderedDict, deque
from collections.abc import Callable
from typing import Generic, TypeVar

_Item = TypeVar("_Item")


class CompileQueue(Generic[_Item]):
    """Items (compiles) by tenant (None: requests without one). Tenants take turns: `take`
    returns the head of the first tenant in turn order with a live item, and sends that
    tenant to the back; a tenant seen for the first time comes first, so a tenant that has
    just had its turn goes behind every other waiting tenant. Within a tenant, items come out
    in the order they were added. An item may wait in several tenants' queues (a grammar two
    tenants asked for): it comes out in the earlier turn, and `take` skips it afterwards, as
    it skips every item that `is_live` rejects (a compile cancelled, or already started from
    another tenant's queue). Holds every tenant it has seen (as many as the server's API
    keys, and None).

    Thread-safe for one taker: the engine core's thread adds, the one compile thread takes
    (two takers could both take an item that waits in two queues; `is_live` is checked, not
    claimed, under the lock)."""

    def __init__(self, is_live: Callable[[_Item], bool]) -> None:
        self._is_live = is_live
        self._lock = threading.Lock()
        self._waiting: dict[str | None, deque[_Item]] = {}
        self._turns: OrderedDict[str | None, None] = OrderedDict()  # the next turn first

    def add(self, tenant: str | None, item: _Item) -> None:
        """Queues `item` behind `tenant`'s other items."""
        with self._lock:
            if tenant not in self._turns:
                self._turns[tenant] = None
                self._turns.move_to_end(tenant, last=False)
            self._waiting.setdefault(tenant, deque()).append(item)

    def take(self) -> _Item | None:
        """The next live item in the tenants' turns, or None when none waits; dead items
        passed on the way are dropped."""
        with self._lock:
            for tenant in list(self._turns):
                queue = self._waiting.get(tenant)
                while queue and not self._is_live(queue[0]):
                    queue.popleft()
                if not queue:
                    self._waiting.pop(tenant, None)
                    continue
                item = queue.popleft()
                if not queue:
                    del self._waiting[tenant]
                self._turns.move_to_end(tenant)
                return item
            return None

    def clear(self) -> list[_Item]:
        """Empties the queue; returns what waited (an item once however many queues held it)."""
        with self._lock:
            items = list({id(item): item for queue in self._waiting.values()
                          for item in queue}.values())
            self._waiting.clear()
            return items
