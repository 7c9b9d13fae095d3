"""The server's graceful drain: what happens between SIGTERM and exit.

Once the HTTP server stops accepting connections it calls `Drain.begin`: new generation
requests (on connections still open) get 503, requests in flight may finish for up to
`timeout_s`, and then every request still running ends with `ServerShuttingDownError`, which a
stream reports as an error event followed by `[DONE]` and a non-streaming request as a 503.
"""

from __future__ import annotations

import asyncio
import logging

from engine.frontend.async_llm import AsyncLLM

logger = logging.getLogger(__name__)


class ServerShuttingDownError(Exception):
    """The server shut down before the request finished."""


class Drain:
    """The drain of one server; `begin` is called once, from the server's event loop, when it
    starts shutting down."""

    def __init__(self, timeout_s: float) -> None:
        if not timeout_s >= 0:
            raise ValueError(f"the drain timeout must be at least 0 s, got {timeout_s!r}")
        self.timeout_s = timeout_s
        self._deadline: asyncio.Task[None] | None = None

    @property
    def draining(self) -> bool:
        return self._deadline is not None

    def begin(self, engine: AsyncLLM | None) -> None:
        """Starts the drain: after `timeout_s`, `engine`'s requests still in flight end with
        ServerShuttingDownError. A second call changes nothing."""
        if self._deadline is not None:
            return
        logger.info("draining: requests in flight have %.1f s to finish", self.timeout_s)
        self._deadline = asyncio.get_running_loop().create_task(self._end_requests(engine))

    async def _end_requests(self, engine: AsyncLLM | None) -> None:
        await asyncio.sleep(self.timeout_s)
        if engine is None or engine.is_dead:
            return
        if engine.num_unfinished_requests:
            logger.warning("the drain timed out: ending %d request(s) still in flight",
                           engine.num_unfinished_requests)
        # Also when none is in flight: one still being prepared is refused when it arrives.
        engine.fail_requests(ServerShuttingDownError(
            f"the server is shutting down and this request did not finish within the "
            f"{self.timeout_s:g} s allowed"))

    async def wait_until_idle(self, engine: AsyncLLM, poll_s: float = 0.05) -> None:
        """Returns once `engine` has no request in flight (or has died); after `begin`, the
        drain ends the last ones after `timeout_s`."""
        while engine.num_unfinished_requests and not engine.is_dead:
            await asyncio.sleep(poll_s)

    def cancel(self) -> None:
        """Stops the deadline (the engine is shutting down anyway)."""
        if self._deadline is not None:
            self._deadline.cancel()
