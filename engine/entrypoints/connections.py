"""Client connections of `continuum serve`: how long a client may take to send its request,
how many connections the server holds at once, and what happens when descriptors run out.

uvicorn's h11 protocol (one instance per connection, owned by uvicorn's server) is extended
through its documented extension point, `uvicorn.Config(http=<protocol class>)`:

* header timeout: a connection must deliver complete request headers within
  `header_timeout_s` seconds of being accepted; on a keep-alive connection, within
  `header_timeout_s` of the first byte of its next request (the idle wait before that byte
  is bounded by uvicorn's `timeout_keep_alive`). Otherwise it gets 408 and is closed.
* body timeout: once the headers are in, the whole body must arrive within `body_timeout_s`
  seconds. Otherwise the request is answered 408 (if nothing of its response was sent; the
  app then sees the client as gone) and the connection closed. The timer is off once the
  body is complete, so waits for `http.disconnect` (streams, `cancel_on_disconnect`) are
  never cut.
* connection cap: a connection accepted while `max_connections` are open takes the place of
  the oldest connection with no request in progress (one still waiting for request headers,
  which gets 408, or one idling between requests, which is closed), so that clients too
  slow to send a request, or holding connections open, cannot lock out prompt ones; when
  every open connection is busy with a request, the new one gets an immediate 503 with
  `Connection: close` and is closed, so it holds no descriptor.
* peer close: each request's scope carries `PEER_CLOSED_EXTENSION`, a callable that says
  whether the client has shut its side of the connection: uvicorn saw it, or (Linux) the
  socket shows it (`poll` for `POLLRDHUP`) while uvicorn has paused reading a connection
  whose body the app leaves unread (a paced refusal waits so: `refusal_pacing`). A close
  travels behind the bytes the client had still to send, so it is seen for a client that
  sent little of its body (one waiting for `100 Continue`, say) or reset its connection, not
  for one that closes with more unsent than the socket buffers take.

Both 408 and 503 carry OpenAI error bodies. `setup_connection_guards` also raises the soft
open-file limit to the hard one, lowers the cap to fit the limit, and rate-limits the log
messages that a flood of connections or descriptor exhaustion would repeat (asyncio logs a
failed accept once per backlog slot, thousands of times a second).
"""

from __future__ import annotations

import asyncio
import errno
import http
import json
import logging
import resource
import select
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

import h11
from uvicorn.config import Config
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.server import ServerState

from engine.config import setting
from engine.entrypoints.openai.errors import error_body
from engine.entrypoints.openai.refusal_pacing import PEER_CLOSED_EXTENSION

logger = logging.getLogger("continuum.connections")

DEFAULT_HEADER_TIMEOUT_S = 10.0
DEFAULT_BODY_TIMEOUT_S = 30.0
# Below the 4,096 soft limit common on servers and far below container hard limits
# (1,048,576); each connection held costs one descriptor and about 5 KiB of server memory
# (`python -m lab connections`: +17 MiB RSS while 3,500 were held).
DEFAULT_MAX_CONNECTIONS = 1024
# Descriptors kept for everything but client connections (the listening socket, the engine
# core's sockets and pipes, log files, imports), when the cap is fitted to the limit.
RESERVED_DESCRIPTORS = 128
# What `poll` reports for a client that closed its side or whose connection broke (POLLRDHUP
# is Linux's; elsewhere only a whole close or an error is seen).
_PEER_CLOSED_EVENTS = getattr(select, "POLLRDHUP", 0) | select.POLLHUP | select.POLLERR
# The soft limit sought when the hard limit is unlimited (Linux refuses RLIM_INFINITY).
_UNLIMITED_TARGET_DESCRIPTORS = 65536
DEFAULT_LOG_INTERVAL_S = 10.0
_RESOURCE_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
_RESOURCE_MARKERS = ("out of system resource", "Too many open files")


@dataclass(frozen=True)
class ConnectionSettings:
    """Limits on client connections: timeouts in seconds, the cap in connections."""

    header_timeout_s: float = field(default=DEFAULT_HEADER_TIMEOUT_S, metadata=setting(
        "seconds for request headers", group="server", metavar="S"))
    body_timeout_s: float = field(default=DEFAULT_BODY_TIMEOUT_S, metadata=setting(
        "seconds for a request body", group="server", metavar="S"))
    max_connections: int = field(default=DEFAULT_MAX_CONNECTIONS, metadata=setting(
        "most open client connections", group="server"))

    def __post_init__(self) -> None:
        if not self.header_timeout_s > 0:
            raise ValueError(f"header_timeout_s must be positive, got {self.header_timeout_s}")
        if not self.body_timeout_s > 0:
            raise ValueError(f"body_timeout_s must be positive, got {self.body_timeout_s}")
        if self.max_connections < 1:
            raise ValueError(f"max_connections must be at least 1, got {self.max_connections}")


def error_response_bytes(
    status: int, message: str, code: str, default_headers: Iterable[tuple[bytes, bytes]] = (),
) -> bytes:
    """A complete HTTP/1.1 response with an OpenAI error body and `Connection: close`, for
    writing straight to a transport (h11 cannot answer before it has parsed a request)."""
    body = json.dumps(error_body(status, message, code=code), separators=(",", ":")).encode()
    headers = [*default_headers, (b"content-type", b"application/json"),
               (b"content-length", str(len(body)).encode()), (b"connection", b"close")]
    head = [f"HTTP/1.1 {status} {http.HTTPStatus(status).phrase}".encode()]
    head += [name + b": " + value for name, value in headers]
    return b"\r\n".join(head) + b"\r\n\r\n" + body


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with the header and body timeouts and the connection cap of
    `settings` (a class attribute: `guarded_protocol` makes a subclass per settings, since
    uvicorn builds protocols from the class alone). One instance per connection."""

    settings: ClassVar[ConnectionSettings] = ConnectionSettings()
    # The connections with no request in progress (waiting for headers, or idle between
    # requests), oldest first (a dict as an ordered set); one per server, as
    # `guarded_protocol` makes a class per server.
    evictable: ClassVar[dict[GuardedH11Protocol, None]] = {}

    def __init__(
        self, config: Config, server_state: ServerState, app_state: dict[str, Any],
        _loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        super().__init__(config, server_state, app_state, _loop)
        self._header_timer: asyncio.TimerHandle | None = None
        self._body_timer: asyncio.TimerHandle | None = None
        self._rejected = False

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        if len(self.connections) >= self.settings.max_connections and not self._evict_slowest():
            self._reject(transport)
            return
        super().connection_made(transport)
        self._arm_header_timer()

    def _evict_slowest(self) -> bool:
        """Closes the oldest connection with no request in progress (one waiting for its
        headers gets 408, as if its header timeout had passed); False if there is none."""
        for connection in self.evictable:
            waiting_for_headers = connection._header_timer is not None
            connection._cancel_header_timer()
            if waiting_for_headers:
                connection._time_out_headers("the server needed this connection for "
                                             "another client before the request headers "
                                             "arrived")
            else:
                connection.transport.close()
            return True
        return False

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
            self.evictable[self] = None  # idle between requests

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_timer()
        self._cancel_body_timer()
        if not self._rejected:
            super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._header_timer is None and self.conn.their_state is h11.IDLE:
            self._arm_header_timer()  # the first byte of a keep-alive connection's next request
        super().data_received(data)

    def handle_events(self) -> None:
        cycle = self.cycle
        super().handle_events()
        if self.cycle is not None and self.cycle is not cycle:
            # A new request, whose app task uvicorn has just created: the task runs once
            # this call returns (the event loop's default task factory), so it sees the
            # check. Wrapping `self.app` instead would tie each protocol into a cycle of its
            # own, freed only by the cyclic collector.
            extensions = self.cycle.scope.setdefault("extensions", {})
            extensions[PEER_CLOSED_EXTENSION] = self.peer_closed
        state = self.conn.their_state
        if state is not h11.IDLE:
            self._cancel_header_timer()
        if state is h11.SEND_BODY:
            if self._body_timer is None:
                self._body_timer = self.loop.call_later(self.settings.body_timeout_s,
                                                        self._on_body_timeout)
        else:
            self._cancel_body_timer()

    def peer_closed(self) -> bool:
        """Whether the client has closed its side of the connection, or the connection is
        gone: uvicorn saw it, or the socket shows it while uvicorn has paused reading. A
        client's close arrives behind the bytes it still had to send, so one that closes with
        more of its body unsent than the socket's buffers take is not seen."""
        if self.transport.is_closing():
            return True
        sock = self.transport.get_extra_info("socket")
        if sock is None or sock.fileno() < 0:
            return False
        poller = select.poll()
        poller.register(sock.fileno(), _PEER_CLOSED_EVENTS)
        return bool(poller.poll(0))

    def _reject(self, transport: asyncio.Transport) -> None:
        self._rejected = True
        self.transport = transport
        logger.warning("refused a connection: %d connections are open (--max-connections)",
                       len(self.connections))
        message = (f"the server holds its maximum of {self.settings.max_connections} "
                   "connections; retry later")
        transport.write(error_response_bytes(503, message, "too_many_connections",
                                             self.server_state.default_headers))
        transport.close()

    def _arm_header_timer(self) -> None:
        self._header_timer = self.loop.call_later(self.settings.header_timeout_s,
                                                  self._on_header_timeout)
        self.evictable.pop(self, None)  # to the back: its wait starts now
        self.evictable[self] = None

    def _cancel_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None
        self.evictable.pop(self, None)

    def _cancel_body_timer(self) -> None:
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None

    def _on_header_timeout(self) -> None:
        self._cancel_header_timer()
        self._time_out_headers(f"the request headers did not arrive within "
                               f"{self.settings.header_timeout_s:g} s")

    def _time_out_headers(self, message: str) -> None:
        if self.transport.is_closing():
            return
        logger.debug("closed a connection: %s", message)
        if self.cycle is None or self.cycle.response_complete:
            self.transport.write(error_response_bytes(408, message, "request_timeout",
                                                      self.server_state.default_headers))
        self.transport.close()

    def _on_body_timeout(self) -> None:
        self._body_timer = None
        if self.transport.is_closing():
            return
        logger.debug("closed a connection: the request body did not arrive within %s s",
                     self.settings.body_timeout_s)
        cycle = self.cycle
        if cycle is not None and not cycle.response_started:
            # The app's receive() now returns http.disconnect and its response is dropped.
            cycle.disconnected = True
            cycle.message_event.set()
            message = (f"the request body did not arrive within "
                       f"{self.settings.body_timeout_s:g} s")
            self.transport.write(error_response_bytes(408, message, "request_timeout",
                                                      self.server_state.default_headers))
        self.transport.close()


def guarded_protocol(settings: ConnectionSettings) -> type[GuardedH11Protocol]:
    """A `GuardedH11Protocol` subclass bound to `settings`, for `uvicorn.Config(http=...)`."""
    return type("GuardedH11Protocol", (GuardedH11Protocol,),
                {"settings": settings, "evictable": {}})


def raise_open_file_limit(needed: int | None = None) -> int:
    """Raises this process's soft RLIMIT_NOFILE to `needed` descriptors (None: as many as
    allowed), within its hard limit (best effort: a failure is logged); the soft limit in
    force afterwards, in descriptors (RLIM_INFINITY if none)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else _UNLIMITED_TARGET_DESCRIPTORS
    if needed is not None:
        target = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
    if soft == resource.RLIM_INFINITY or soft >= target:
        return soft
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ValueError, OSError) as error:
        logger.warning("cannot raise the open-file limit from %d to %d: %s", soft, target, error)
        return soft
    return target


def fit_to_open_file_limit(settings: ConnectionSettings, limit: int) -> ConnectionSettings:
    """`settings` with the cap lowered (and a warning) if it and `RESERVED_DESCRIPTORS` do not
    fit `limit` descriptors."""
    room = max(1, limit - RESERVED_DESCRIPTORS)
    if limit == resource.RLIM_INFINITY or settings.max_connections <= room:
        return settings
    logger.warning("--max-connections %d does not fit the open-file limit of %d descriptors "
                   "(%d kept for the server itself); at most %d connections will be held",
                   settings.max_connections, limit, RESERVED_DESCRIPTORS, room)
    return replace(settings, max_connections=room)


def is_resource_exhaustion(record: logging.LogRecord) -> bool:
    """Whether a log record reports running out of descriptors, buffers or memory."""
    error = record.exc_info[1] if record.exc_info else None
    if isinstance(error, OSError) and error.errno in _RESOURCE_ERRNOS:
        return True
    text = record.getMessage()
    return any(marker in text for marker in _RESOURCE_MARKERS)


def is_flood_prone(record: logging.LogRecord) -> bool:
    """Whether a record is one that every bad connection repeats: a warning (uvicorn's
    "Invalid HTTP request received.", the cap's refusals) or a resource exhaustion."""
    return record.levelno == logging.WARNING or is_resource_exhaustion(record)


class RateLimitFilter(logging.Filter):
    """Lets through at most one record per `interval_s` seconds of each kind (logger name
    and first line of the message) among those `applies_to` selects, and adds to the next
    one let through how many were suppressed. Others pass untouched. `clock` gives seconds;
    the filter is owned by the loggers it is added to."""

    def __init__(
        self, interval_s: float = DEFAULT_LOG_INTERVAL_S, *,
        applies_to: Callable[[logging.LogRecord], bool] = lambda record: True,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__()
        self.interval_s = interval_s
        self.applies_to = applies_to
        self.clock = clock
        self._last_s: dict[tuple[str, str], float] = {}
        self._suppressed: dict[tuple[str, str], int] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        if not self.applies_to(record):
            return True
        kind = (record.name, str(record.msg).split("\n", 1)[0])
        now_s = self.clock()
        last_s = self._last_s.get(kind)
        if last_s is not None and now_s - last_s < self.interval_s:
            self._suppressed[kind] = self._suppressed.get(kind, 0) + 1
            return False
        suppressed = self._suppressed.pop(kind, 0)
        if suppressed and last_s is not None:
            record.msg = (f"{record.getMessage()} [{suppressed} more like this suppressed in "
                          f"the last {now_s - last_s:.0f} s]")
            record.args = None
        self._last_s[kind] = now_s
        return True


# The loggers a flood of connections or descriptor exhaustion repeats itself on, and which
# of their records are rate-limited.
_FLOOD_PRONE_LOGGERS: dict[str, Callable[[logging.LogRecord], bool]] = {
    "asyncio": is_resource_exhaustion,
    "uvicorn.error": is_flood_prone,
    logger.name: is_flood_prone,
}


def install_log_rate_limits(interval_s: float = DEFAULT_LOG_INTERVAL_S) -> None:
    """Adds a `RateLimitFilter` to each flood-prone logger (replacing one added before)."""
    for name, applies_to in _FLOOD_PRONE_LOGGERS.items():
        target = logging.getLogger(name)
        for old in [f for f in target.filters if isinstance(f, RateLimitFilter)]:
            target.removeFilter(old)
        target.addFilter(RateLimitFilter(interval_s, applies_to=applies_to))


def setup_connection_guards(settings: ConnectionSettings) -> type[GuardedH11Protocol]:
    """Process-wide preparation for serving with `settings`: raises the open-file limit,
    fits the cap to it, rate-limits flood-prone log messages; the protocol class to pass as
    `uvicorn.Config(http=...)`. Call after logging is configured."""
    fitted = fit_to_open_file_limit(settings, raise_open_file_limit())
    install_log_rate_limits()
    return guarded_protocol(fitted)
