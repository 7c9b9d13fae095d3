"""The HTTP layer's blocking work (parsing large bodies, checking grammars, rendering chats,
tokenizing, building large response bodies), on threads shared fairly among tenants, and the
pace at which each tenant's large response bodies are sent.

Work for a request with a large body (`background=True`) runs on threads of lower CPU
priority (niceness 10, about a tenth of the CPU when others want it): a large body's parse
(which waits for a child process that also renders and tokenizes a chat: seconds of CPU for
an 8 MB one, `json_body.BodyParser`) and the rest of its preparation would otherwise take
CPU from the engine core's steps and the event loop that streams every client's tokens.
Small requests' work keeps the normal priority, so that their time to first token does not
wait on the large ones'. At most `num_background_threads` such items run at once: by default
the usable cores less two (one for the engine core's busy loop, one for the event loop), at
least one and at most eight. That work is CPU-bound, so threads beyond the idle cores only
take turns on them and add to what preempts the engine core and the event loop
(docs/decisions/0018-large-body-preparation.md).

One pool serves the whole server. A tenant runs at most `max_threads_per_tenant` items at
once, so that a flood from one tenant (say chats of 10,000 messages, each taking seconds to
render and tokenize) always leaves threads to the others; when a thread frees, the next item
is taken from the tenants in turn, so one tenant's backlog delays another's next item by at
most one item's run. A tenant whose waiting items already number `max_waiting_per_tenant`
gets 429 for the next one: its queue, and the request bodies it holds, stay bounded.

Sending a large response body (a stored response retrieved, a completion with many logprobs)
costs the event loop and the kernel about a millisecond a megabyte, which no thread's priority
can lower, and asking for one costs its client next to nothing: a tenant that loops on
`GET /v1/responses/{id}` of a 5.5 MB response would otherwise take the cores the other
tenants' tokens need. Each tenant's large bodies are therefore sent at most
`large_body_bytes_per_s` (`pace_large_body`), after a burst of `LARGE_BODY_BURST_S` of it
(docs/decisions/0029-response-weight-and-tenant-queue.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from engine.clock import Clock
from engine.cpu_cores import usable_cores
from engine.entrypoints.openai.errors import APIError

_T = TypeVar("_T")

# As many as asyncio's default executor, which did this work before.
DEFAULT_PREPARATION_THREADS = min(32, (os.cpu_count() or 1) + 4)
DEFAULT_MAX_WAITING_PREPARATIONS = 64
DEFAULT_LARGE_BODY_BYTES_PER_S = 128 * 1024 * 1024
LARGE_BODY_BURST_S = 0.1


BACKGROUND_NICENESS = 10
# The server runs one body-parsing process for each background thread, each holding a copy
# of the tokenizer and what its last body left on its heap (about 100 MB or more): eight
# large bodies at once are plenty for a host of any size.
MAX_DEFAULT_BACKGROUND_THREADS = 8


def default_background_threads(num_threads: int) -> int:
    """The usable cores (`cpu_cores.usable_cores`) less two, at least 1, at most
    `num_threads` and `MAX_DEFAULT_BACKGROUND_THREADS`."""
    return max(1, min(num_threads, MAX_DEFAULT_BACKGROUND_THREADS, usable_cores() - 2))


@dataclass(eq=False)
class _Item:
    fn: Callable[..., Any]
    args: tuple[Any, ...]
    background: bool
    result: asyncio.Future[Any] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future())


class TenantWorkPool:
    """Threads for blocking work, shared fairly among tenants (see the module docstring).

    `run` is called from the event loop only; all bookkeeping happens there, so it needs no
    lock. `shutdown` is called once, when the server stops.
    """

    def __init__(self, num_threads: int = DEFAULT_PREPARATION_THREADS, *,
                 max_threads_per_tenant: int | None = None,
                 num_background_threads: int | None = None,
                 max_waiting_per_tenant: int = DEFAULT_MAX_WAITING_PREPARATIONS,
                 retry_after_s: int = 1,
                 large_body_bytes_per_s: float = DEFAULT_LARGE_BODY_BYTES_PER_S,
                 clock: Clock = time.monotonic,
                 sleep: Callable[[float], Awaitable[None]] = asyncio.sleep) -> None:
        if num_threads < 1 or max_waiting_per_tenant < 1:
            raise ValueError("num_threads and max_waiting_per_tenant must be at least 1")
        per_tenant = num_threads if max_threads_per_tenant is None else max_threads_per_tenant
        if not 1 <= per_tenant <= num_threads:
            raise ValueError(f"max_threads_per_tenant must be in [1, {num_threads}], got "
                             f"{per_tenant}")
        background = (default_background_threads(num_threads) if num_background_threads is None
                      else num_background_threads)
        if not 1 <= background <= num_threads:
            raise ValueError(f"num_background_threads must be in [1, {num_threads}], got "
                             f"{background}")
        if not large_body_bytes_per_s > 0:
            raise ValueError(f"large_body_bytes_per_s must be positive, got "
                             f"{large_body_bytes_per_s}")
        self.num_threads = num_threads
        self.max_threads_per_tenant = per_tenant
        self.num_background_threads = background
        self.max_waiting_per_tenant = max_waiting_per_tenant
        self.retry_after_s = retry_after_s
        self.large_body_bytes_per_s = large_body_bytes_per_s
        self._clock = clock
        self._sleep = sleep
        # When each tenant's large bodies sent so far are paid for, seconds on `clock`: one
        # entry a tenant that sent one.
        self._large_body_paid_until_s: dict[str | None, float] = {}
        self._executor = ThreadPoolExecutor(num_threads, thread_name_prefix="preparation")
        self._background_executor = ThreadPoolExecutor(
            background, thread_name_prefix="preparation-background",
            initializer=lower_thread_priority, initargs=(BACKGROUND_NICENESS,))
        self._num_running_background = 0
        self._waiting: dict[str | None, deque[_Item]] = {}
        # Every tenant seen, in the order of their next turns: one that starts an item goes
        # last, one never seen before goes first. As bounded as the server's API keys.
        self._turns: OrderedDict[str | None, None] = OrderedDict()
        # The same for the background threads: a tenant goes last once it starts a background
        # item, so that its small items do not cost its large ones their turn.
        self._background_turns: OrderedDict[str | None, None] = OrderedDict()
        self._running: dict[str | None, int] = {}
        self._closed = False

    @classmethod
    def for_tenants(cls, num_tenants: int, num_threads: int = DEFAULT_PREPARATION_THREADS,
                    **kwargs: Any) -> TenantWorkPool:
        """A pool in which, when there are several tenants, each may use at most half the
        threads (all of them when there is one)."""
        per_tenant = num_threads if num_tenants <= 1 else max(1, num_threads // 2)
        return cls(num_threads, max_threads_per_tenant=per_tenant, **kwargs)

    async def run(self, tenant: str | None, fn: Callable[..., _T], *args: Any,
                  background: bool = False) -> _T:
        """`fn(*args)` on a thread of the pool, in `tenant`'s turn; its result or exception.
        `background`: on a thread of lower CPU priority (work for a large body). APIError(429)
        if the tenant already has `max_waiting_per_tenant` items waiting. If the caller is
        cancelled while the item waits, the item is dropped; once it runs, it runs to its end
        and its result is discarded."""
        if self._closed:
            raise _shutting_down()
        queue = self._waiting.get(tenant)
        if queue is not None and len(queue) >= self.max_waiting_per_tenant:
            raise APIError(429, f"too many of this client's requests are being prepared "
                                f"({len(queue)} waiting); retry later", code="rate_limit_exceeded",
                           headers={"Retry-After": str(self.retry_after_s)})
        item = _Item(fn, args, background)
        for turns in (self._turns, self._background_turns):
            if tenant not in turns:
                turns[tenant] = None
                turns.move_to_end(tenant, last=False)
        self._waiting.setdefault(tenant, deque()).append(item)
        self._dispatch()
        try:
            return await item.result  # type: ignore[no-any-return]
        except asyncio.CancelledError:
            self._drop(tenant, item)
            raise
        finally:
            # An exception raised here stays in the item's future, and its traceback holds
            # this frame, which holds the item: a cycle that only the cyclic GC frees, and
            # with it everything the frames hold (a request's body of megabytes). Under a
            # stream of large bodies refused by their parse, those outlived the body
            # budget's count by the dozen (88 bodies, 1.3 GB, in 30 s).
            del item

    async def pace_large_body(self, tenant: str | None, num_bytes: int) -> None:
        """Returns once `tenant` may send `num_bytes` more of its large response bodies: at
        once within its burst (`LARGE_BODY_BURST_S` at `large_body_bytes_per_s`), else when
        the bytes it sent before them are paid for at that pace. The tenant's bodies sent at
        once share its pace in the order their pieces come."""
        now_s = self._clock()
        start_s = now_s - LARGE_BODY_BURST_S
        start_s = max(start_s, self._large_body_paid_until_s.get(tenant, start_s))
        paid_until_s = start_s + num_bytes / self.large_body_bytes_per_s
        self._large_body_paid_until_s[tenant] = paid_until_s
        if paid_until_s > now_s:
            await self._sleep(paid_until_s - now_s)

    def num_waiting(self, tenant: str | None) -> int:
        """How many of `tenant`'s items wait for a thread."""
        return len(self._waiting.get(tenant, ()))

    def num_running(self, tenant: str | None) -> int:
        """How many of `tenant`'s items run now."""
        return self._running.get(tenant, 0)

    def shutdown(self) -> None:
        """Stops taking items: waiting ones (and later calls) fail with 503; items already
        running finish on their threads."""
        self._closed = True
        for queue in self._waiting.values():
            for item in queue:
                if not item.result.done():
                    item.result.set_exception(_shutting_down())
        self._waiting.clear()
        self._executor.shutdown(wait=False, cancel_futures=True)
        self._background_executor.shutdown(wait=False, cancel_futures=True)

    def _dispatch(self) -> None:
        """Starts waiting items while threads are free: a background thread's next item comes
        from the tenants in their background turns, any other thread's from the tenants in
        turn; each tenant's items of a kind start in the order they came."""
        while (startable := self._startable()) is not None:
            tenant, item = startable
            queue = self._waiting[tenant]
            queue.remove(item)
            if not queue:
                del self._waiting[tenant]
            self._turns.move_to_end(tenant)
            if item.background:
                self._background_turns.move_to_end(tenant)
            self._start(tenant, item)

    def _startable(self) -> tuple[str | None, _Item] | None:
        """The next item that may start now, with its tenant; None if none may."""
        if self._closed or sum(self._running.values()) >= self.num_threads:
            return None
        if self._num_running_background < self.num_background_threads:
            found = self._first_item(self._background_turns, background=True)
            if found is not None:
                return found
        return self._first_item(self._turns, background=False)

    def _first_item(self, turns: OrderedDict[str | None, None], *,
                    background: bool) -> tuple[str | None, _Item] | None:
        """The first waiting item of the kind, of the first tenant in `turns` below its
        thread cap that has one."""
        for tenant in turns:
            if self._running.get(tenant, 0) >= self.max_threads_per_tenant:
                continue
            for item in self._waiting.get(tenant, ()):
                if item.background == background:
                    return tenant, item
        return None

    def _start(self, tenant: str | None, item: _Item) -> None:
        self._running[tenant] = self._running.get(tenant, 0) + 1
        self._num_running_background += item.background
        loop = asyncio.get_running_loop()
        executor = self._background_executor if item.background else self._executor
        work = executor.submit(item.fn, *item.args)
        work.add_done_callback(
            lambda done: loop.call_soon_threadsafe(self._finished, tenant, item, done))

    def _finished(self, tenant: str | None, item: _Item, done: Future[Any]) -> None:
        self._running[tenant] -= 1
        self._num_running_background -= item.background
        if not self._running[tenant]:
            del self._running[tenant]
        if done.cancelled():
            item.result.cancel()
        elif not item.result.done():
            error = done.exception()
            if error is None:
                item.result.set_result(done.result())
            else:
                item.result.set_exception(error)
        self._dispatch()

    def _drop(self, tenant: str | None, item: _Item) -> None:
        queue = self._waiting.get(tenant)
        if queue is not None and any(waiting is item for waiting in queue):
            queue.remove(item)
            if not queue:
                del self._waiting[tenant]


def _shutting_down() -> APIError:
    return APIError(503, "the server is shutting down", code="server_shutting_down")


def lower_thread_priority(niceness: int) -> None:
    """Raises the calling thread's niceness to `niceness` (Linux sets it per thread; elsewhere
    nothing changes)."""
    with contextlib.suppress(AttributeError, OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), niceness)
