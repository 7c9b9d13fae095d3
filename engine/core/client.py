"""Clients of the engine core: in-process, and multiprocess (sync and asyncio) over ZMQ.

A client owns its core: the in-process client holds an `EngineCore`; a multiprocess client
starts an `EngineCoreProc`, performs the startup handshake, and shuts the process down. Every
call comes from one thread (the asyncio client: from its event loop).
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import multiprocessing
import os
import shutil
import tempfile
import time
import uuid
import weakref
from collections.abc import Callable
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from engine.config import EngineConfig
from engine.core.core_proc import POLL_INTERVAL_MS, run_engine_core
from engine.core.cpu_threads import for_core_process
from engine.core.engine_core import EngineCore
from engine.core.wire import (
    AbortRequests,
    CoreEvent,
    CoreFailed,
    CoreHello,
    CoreReady,
    CoreStartupFailed,
    EngineCoreOutputs,
    EngineCoreRequest,
    Shutdown,
    UtilityCall,
    UtilityResult,
)
from engine.outputs import EngineCoreOutput


class EngineDeadError(RuntimeError):
    """The engine core is gone (its process died or its loop failed); nothing in flight will
    finish."""


class InprocClient:
    """Drives an `EngineCore` in the caller's thread: `get_output` runs one step.

    `add_request` raises `ValueError` at once for a request the core rejects. A step or
    sweep that raises leaves the core's books half-updated (a step may have been scheduled
    and not applied, or with async scheduling applied while the next is out), so, like a
    core process whose loop failed, the core is dead then: the failing call raises the
    error, and every later call but `abort_requests` and `shutdown` raises `EngineDeadError`
    naming it. A KeyboardInterrupt inside a step counts as such a failure.
    """

    def __init__(self, config: EngineConfig, **core_kwargs: Any) -> None:
        self.core = EngineCore(config, **core_kwargs)
        self.num_kv_blocks = self.core.executor.num_kv_blocks
        self._failure: str | None = None  # the error that killed the core (not its frames)

    def add_request(self, request: EngineCoreRequest) -> None:
        """Queues the request in the core; ValueError (and no change) if it is rejected."""
        self._check_alive()
        self.core.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        if self._failure is None:
            self.core.abort_requests(request_ids)

    def get_output(self) -> list[EngineCoreOutput]:
        """Runs one core step and returns its outputs; with no work, sweeps instead (pins
        and idle jobs expire) and returns []."""
        self._check_alive()
        try:
            if self.core.has_work():
                return self.core.step()
            self.core.sweep()
        except BaseException as error:
            self._failure = repr(error)
            raise
        return []

    def call_utility(self, method: str, *args: Any) -> Any:
        if method not in EngineCore.UTILITIES:
            raise ValueError(f"unknown utility {method!r}")
        self._check_alive()
        return getattr(self.core, method)(*args)

    def _check_alive(self) -> None:
        if self._failure is not None:
            raise EngineDeadError(f"the engine core failed in a step: {self._failure}")

    def shutdown(self) -> None:
        self.core.shutdown()


StartupCheck = Callable[[], BaseException | None]
"""Asked while a core process starts (every `POLL_INTERVAL_MS`): an error to stop the start
with and raise, or None to go on waiting."""


class _CoreProcess:
    """The core process and the frontend's ends of its sockets (bound here, before it starts).

    Binds a ROUTER (input) and a PULL (output) socket on IPC paths in a private directory,
    starts the process (spawned, so no threads or CUDA state are forked), and waits for its
    `CoreReady`; raises RuntimeError with the core's message if it failed to start, or the
    error `startup_check` returned (the process then stopped).
    """

    def __init__(
        self, config: EngineConfig, context: zmq.Context, startup_timeout_s: float,
        startup_check: StartupCheck | None = None,
    ) -> None:
        self._directory = tempfile.mkdtemp(prefix="continuum-core-")
        input_address = f"ipc://{self._directory}/input"
        output_address = f"ipc://{self._directory}/output"
        self.input_socket = context.socket(zmq.ROUTER)
        self.input_socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.input_socket.bind(input_address)
        self.output_socket = context.socket(zmq.PULL)
        self.output_socket.bind(output_address)
        self.identity = uuid.uuid4().bytes
        self.process = multiprocessing.get_context("spawn").Process(
            target=run_engine_core, name="EngineCore", daemon=True,
            args=(msgspec.msgpack.encode(for_core_process(config)), input_address, output_address,
                  self.identity, os.getpid()),
        )
        self.process.start()
        try:
            self.ready = self._handshake(startup_timeout_s, startup_check)
        except BaseException:
            self.close()
            raise

    def _handshake(self, timeout_s: float, startup_check: StartupCheck | None) -> CoreReady:
        decoder = msgspec.msgpack.Decoder(CoreHello)
        deadline_s = time.monotonic() + timeout_s
        while not self.input_socket.poll(POLL_INTERVAL_MS):
            stop = None if startup_check is None else startup_check()
            if stop is not None:
                raise stop
            if self.process.exitcode is not None:
                raise RuntimeError(
                    f"the engine core process exited during startup "
                    f"(exit code {self.process.exitcode})"
                )
            if time.monotonic() > deadline_s:
                raise RuntimeError(f"the engine core did not start within {timeout_s} s")
        _identity, payload = self.input_socket.recv_multipart()
        hello = decoder.decode(payload)
        if isinstance(hello, CoreStartupFailed):
            raise RuntimeError(f"the engine core failed to start: {hello.error}")
        return hello

    def death_message(self) -> str | None:
        """Why the core is unusable, or None while its process lives."""
        code = self.process.exitcode
        return None if code is None else f"the engine core process died (exit code {code})"

    def close(self) -> None:
        """Stops the process (asking first, if it lives), closes the sockets. Idempotent."""
        if self.process.exitcode is None:
            try:
                self.input_socket.send_multipart(
                    [self.identity, msgspec.msgpack.encode(Shutdown())], flags=zmq.NOBLOCK
                )
            except zmq.ZMQError:
                pass  # not connected yet (still starting): there is no one to ask
            else:
                self.process.join(timeout=5)
        if self.process.exitcode is None:
            self.process.terminate()
            self.process.join(timeout=5)
        if self.process.exitcode is None:
            self.process.kill()
            self.process.join()
        self.input_socket.close(linger=0)
        self.output_socket.close(linger=0)
        shutil.rmtree(self._directory, ignore_errors=True)


class _MPClientBase:
    """Shared by the multiprocess clients: the process, encoding, and the dead-core state."""

    def __init__(self, config: EngineConfig, *, startup_timeout_s: float = 600.0,
                 startup_check: StartupCheck | None = None) -> None:
        self._context = zmq.Context()
        try:
            self._proc = _CoreProcess(config, self._context, startup_timeout_s, startup_check)
        except BaseException:
            self._context.term()
            raise
        self.num_kv_blocks = self._proc.ready.num_kv_blocks
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(CoreEvent)
        self._call_ids = itertools.count()
        self._dead_message: str | None = None
        self._finalizer = weakref.finalize(self, _close_process, self._proc, self._context)

    @property
    def process(self) -> multiprocessing.process.BaseProcess:
        return self._proc.process

    @property
    def is_dead(self) -> bool:
        """Whether the core is unusable; checks its process, so it is current when asked."""
        if self._dead_message is None:
            self._dead_message = self._proc.death_message()
        return self._dead_message is not None

    def check_alive(self) -> None:
        """EngineDeadError if the core is unusable."""
        if self._dead_message is None:
            self._dead_message = self._proc.death_message()
        if self._dead_message is not None:
            raise EngineDeadError(self._dead_message)

    def _mark_dead(self, message: str) -> EngineDeadError:
        self._dead_message = self._dead_message or message
        return EngineDeadError(self._dead_message)

    def _payload(self, message: msgspec.Struct) -> list[bytes]:
        return [self._proc.identity, self._encoder.encode(message)]

    def _utility_call(self, method: str, args: tuple[Any, ...]) -> UtilityCall:
        return UtilityCall(call_id=next(self._call_ids), method=method, args=list(args))

    def shutdown(self) -> None:
        """Stops the core process (cleanly if it answers) and closes the sockets. Idempotent."""
        self._finalizer()


def _close_process(proc: _CoreProcess, context: zmq.Context) -> None:
    proc.close()
    context.term()


class SyncMPClient(_MPClientBase):
    """Blocking client of a core process; `get_output` waits for the next step's outputs."""

    def __init__(self, config: EngineConfig, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        self._pending_outputs: collections.deque[list[EngineCoreOutput]] = collections.deque()
        self._utility_results: dict[int, UtilityResult] = {}

    def add_request(self, request: EngineCoreRequest) -> None:
        """Sends the request; a rejection comes back as an output with `error` set."""
        self._send(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        self._send(AbortRequests(request_ids))

    def get_output(self, timeout_s: float | None = None) -> list[EngineCoreOutput]:
        """The outputs of the next step that produced any; [] after `timeout_s` without one."""
        deadline_s = None if timeout_s is None else time.monotonic() + timeout_s
        while not self._pending_outputs:
            if not self._receive(deadline_s):
                return []
        return self._pending_outputs.popleft()

    def call_utility(self, method: str, *args: Any) -> Any:
        """Runs a core utility and returns its result; ValueError with the core's message if
        it raised."""
        call = self._utility_call(method, args)
        self._send(call)
        while call.call_id not in self._utility_results:
            self._receive(None)
        result = self._utility_results.pop(call.call_id)
        if result.error is not None:
            raise ValueError(result.error)
        return result.result

    def _send(self, message: msgspec.Struct) -> None:
        self.check_alive()
        try:
            self._proc.input_socket.send_multipart(self._payload(message))
        except zmq.ZMQError as error:
            raise self._mark_dead(f"cannot reach the engine core: {error}") from error

    def _receive(self, deadline_s: float | None) -> bool:
        """Receives one event (False if the deadline passed first); raises if the core died."""
        socket = self._proc.output_socket
        while not socket.poll(POLL_INTERVAL_MS):
            self.check_alive()
            if deadline_s is not None and time.monotonic() > deadline_s:
                return False
        event = self._decoder.decode(socket.recv())
        if isinstance(event, EngineCoreOutputs):
            if event.outputs:
                self._pending_outputs.append(event.outputs)
        elif isinstance(event, UtilityResult):
            self._utility_results[event.call_id] = event
        elif isinstance(event, CoreFailed):
            raise self._mark_dead(f"the engine core failed: {event.error}")
        return True


class AsyncMPClient(_MPClientBase):
    """asyncio client of a core process. A reader task (started on first use, in the running
    loop) routes step outputs to `get_output_async` and utility results to their callers;
    when the core dies, every waiter gets `EngineDeadError`."""

    def __init__(self, config: EngineConfig, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        self._input = zmq.asyncio.Socket.from_socket(self._proc.input_socket)
        self._output = zmq.asyncio.Socket.from_socket(self._proc.output_socket)
        self._outputs: asyncio.Queue[list[EngineCoreOutput] | EngineDeadError] | None = None
        self._utility_futures: dict[int, asyncio.Future[Any]] = {}
        self._reader: asyncio.Task[None] | None = None
        self._num_requests_sent = 0
        self._num_waiting_reported = 0
        self._num_received_reported = 0

    @property
    def num_waiting_requests(self) -> int:
        """Requests waiting in the core's queue as it last reported, plus those sent since
        that it had not yet received."""
        in_transit = self._num_requests_sent - self._num_received_reported
        return self._num_waiting_reported + max(0, in_transit)

    async def add_request_async(self, request: EngineCoreRequest) -> None:
        await self._send(request)
        self._num_requests_sent += 1

    def add_request_nowait(self, request: EngineCoreRequest) -> None:
        """Queues `request` for sending, in order with every other message, without waiting:
        it counts as waiting at once. EngineDeadError if the core is dead; a send that fails
        later marks the core dead."""
        self.check_alive()
        sent = self._input.send_multipart(self._payload(request))
        sent.add_done_callback(self._check_sent)
        self._num_requests_sent += 1

    def _check_sent(self, sent: asyncio.Future[Any]) -> None:
        error = None if sent.cancelled() else sent.exception()
        if error is not None:
            self._fail_waiters(self._mark_dead(f"cannot reach the engine core: {error}"))

    async def abort_requests_async(self, request_ids: list[str]) -> None:
        await self._send(AbortRequests(request_ids))

    async def get_output_async(self) -> list[EngineCoreOutput]:
        """The outputs of the next step that produced any; EngineDeadError if the core died."""
        item = await self._ensure_reader().get()
        if isinstance(item, EngineDeadError):
            self._ensure_reader().put_nowait(item)  # every later caller learns it too
            raise item
        return item

    async def call_utility_async(self, method: str, *args: Any) -> Any:
        self._ensure_reader()
        call = self._utility_call(method, args)
        future = asyncio.get_running_loop().create_future()
        self._utility_futures[call.call_id] = future
        try:
            await self._send(call)
            return await future
        finally:
            self._utility_futures.pop(call.call_id, None)

    def shutdown(self) -> None:
        """Stops the core process; pending utility calls fail with EngineDeadError."""
        if self._reader is not None and not self._reader.done():
            self._reader.cancel()
        self._fail_waiters(self._mark_dead("the engine core was shut down"))
        super().shutdown()

    def _ensure_reader(self) -> asyncio.Queue[list[EngineCoreOutput] | EngineDeadError]:
        if self._outputs is None:
            self._outputs = asyncio.Queue()
            self._reader = asyncio.get_running_loop().create_task(self._read_events())
        return self._outputs

    async def _send(self, message: msgspec.Struct) -> None:
        self.check_alive()
        try:
            await self._input.send_multipart(self._payload(message))
        except zmq.ZMQError as error:
            raise self._mark_dead(f"cannot reach the engine core: {error}") from error

    async def _read_events(self) -> None:
        try:
            while True:
                if not await self._output.poll(POLL_INTERVAL_MS):
                    self.check_alive()
                    continue
                self._dispatch(self._decoder.decode(await self._output.recv()))
        except EngineDeadError as error:
            self._fail_waiters(error)
        except (zmq.ZMQError, msgspec.DecodeError) as error:
            self._fail_waiters(self._mark_dead(f"the link to the engine core broke: {error}"))

    def _dispatch(self, event: CoreEvent) -> None:
        assert self._outputs is not None
        if isinstance(event, EngineCoreOutputs):
            self._num_waiting_reported = event.num_waiting
            self._num_received_reported = event.num_requests_received
            if event.outputs:
                self._outputs.put_nowait(event.outputs)
        elif isinstance(event, UtilityResult):
            future = self._utility_futures.get(event.call_id)
            if future is not None and not future.done():
                if event.error is None:
                    future.set_result(event.result)
                else:
                    future.set_exception(ValueError(event.error))
        elif isinstance(event, CoreFailed):
            raise self._mark_dead(f"the engine core failed: {event.error}")

    def _fail_waiters(self, error: EngineDeadError) -> None:
        if self._outputs is not None:
            self._outputs.put_nowait(error)
        for future in self._utility_futures.values():
            if not future.done():
                future.set_exception(error)
