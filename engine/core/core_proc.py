"""`EngineCoreProc`: the engine core in its own process, behind ZMQ.

Three threads: an input thread reads and decodes messages from the DEALER socket into a queue,
the busy loop (main thread) applies them and steps the core, and an output thread encodes and
pushes events on the PUSH socket. Each socket is used by one thread only. A message that cannot
be decoded, or a request the core rejects, is answered with an error and never stops the loop.
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import sys
import threading
import traceback
from collections.abc import Callable
from typing import Any

import msgspec
import zmq

from engine.config import EngineConfig
from engine.core.engine_core import EngineCore
from engine.core.gc_heap import freeze_startup_heap
from engine.core.malloc_thresholds import keep_large_buffers_in_heap
from engine.core.wire import (
    AbortRequests,
    CoreEvent,
    CoreFailed,
    CoreInput,
    CoreReady,
    CoreStartupFailed,
    EngineCoreOutputs,
    EngineCoreRequest,
    Shutdown,
    UtilityCall,
    UtilityResult,
)
from engine.outputs import EngineCoreOutput
from engine.request import FinishReason

logger = logging.getLogger(__name__)

POLL_INTERVAL_MS = 100  # how often blocked socket waits check for shutdown or a dead peer
_LINGER_MS = 2000
_THREAD_JOIN_TIMEOUT_S = 5.0


class EngineCoreProc:
    """Runs `core` until a `Shutdown` message arrives or the parent process is gone.

    Built by `run_engine_core` after the handshake; owns both sockets from then on. While no
    request is unfinished the loop runs no step: it waits up to `IDLE_WAIT_S` for input, and
    sweeps the core (`EngineCore.sweep`: pin TTLs, idle jobs) at most every
    `SWEEP_INTERVAL_S` seconds of the core's clock.
    """

    IDLE_WAIT_S = 0.5
    SWEEP_INTERVAL_S = 0.5

    def __init__(
        self, core: EngineCore, input_socket: zmq.Socket, output_socket: zmq.Socket,
        parent_pid: int,
    ) -> None:
        self.core = core
        self.input_socket = input_socket
        self.output_socket = output_socket
        self.parent_pid = parent_pid
        self.input_queue: queue.Queue[CoreInput] = queue.Queue()
        self.output_queue: queue.Queue[CoreEvent | None] = queue.Queue()
        self._stop_reading = threading.Event()
        self._io_failure: str | None = None  # set by an IO thread that died
        self._running = True
        self.num_requests_received = 0
        self._reported_queue = (0, 0)  # (waiting, received) as last sent to the frontend
        self._last_sweep_s = core.clock()  # a step sweeps too

    def run(self) -> None:
        """The busy loop; returns after a clean shutdown, raises if the core failed."""
        reader = threading.Thread(target=self._guarded, args=(self._read_inputs,),
                                  name="core-input", daemon=True)
        writer = threading.Thread(target=self._guarded, args=(self._write_outputs,),
                                  name="core-output", daemon=True)
        reader.start()
        writer.start()
        try:
            while self._running:
                self._apply_inputs(block=not self.core.has_work())
                self._check_health()
                if self._running and self.core.has_work():
                    self._step()
                elif self._running:
                    self._sweep_when_due()
                self._report_queue_change()
        except Exception:
            self.output_queue.put(CoreFailed(traceback.format_exc()))
            raise
        finally:
            self._stop_reading.set()
            self.output_queue.put(None)
            writer.join(_THREAD_JOIN_TIMEOUT_S)  # a frontend that stopped reading cannot block exit
            reader.join(_THREAD_JOIN_TIMEOUT_S)
            self.core.shutdown()

    def _check_health(self) -> None:
        """Stops serving when the frontend process is gone; raises if an IO thread died."""
        if os.getppid() != self.parent_pid:
            logger.warning("the frontend process is gone; the engine core stops")
            self._running = False
        if self._io_failure is not None:
            raise RuntimeError(f"an engine-core IO thread failed: {self._io_failure}")

    def _guarded(self, io_loop: Callable[[], None]) -> None:
        try:
            io_loop()
        except Exception:
            self._io_failure = traceback.format_exc()

    def _step(self) -> None:
        outputs = self.core.step()
        self._last_sweep_s = self.core.clock()
        if outputs:
            self.output_queue.put(self._outputs_event(outputs))

    def _sweep_when_due(self) -> None:
        """Sweeps the idle core if `SWEEP_INTERVAL_S` passed since the last sweep or step, so
        that pins and idle jobs expire with no request arriving (and no model step)."""
        now_s = self.core.clock()
        if now_s - self._last_sweep_s < self.SWEEP_INTERVAL_S:
            return
        self._last_sweep_s = now_s
        sweep = self.core.sweep()
        if sweep:
            logger.debug("idle sweep: released %d pins, forgot %d jobs",
                         len(sweep.released_pins), len(sweep.forgotten_job_ids))

    def _outputs_event(self, outputs: list[EngineCoreOutput]) -> EngineCoreOutputs:
        """The event carrying `outputs` and the queue as it stands now (marked as reported)."""
        self._reported_queue = (self.core.num_waiting_requests, self.num_requests_received)
        return EngineCoreOutputs(outputs=outputs, timestamp_s=self.core.clock(),
                                 num_waiting=self._reported_queue[0],
                                 num_requests_received=self._reported_queue[1])

    def _report_queue_change(self) -> None:
        """Tells the frontend the queue's length when it changed without any output (the
        frontend limits the waiting queue's depth by it)."""
        if (self.core.num_waiting_requests, self.num_requests_received) != self._reported_queue:
            self.output_queue.put(self._outputs_event([]))

    def _apply_inputs(self, *, block: bool) -> None:
        """Applies every queued message; when idle, first waits a while for one."""
        if block:
            try:
                self._apply(self.input_queue.get(timeout=self.IDLE_WAIT_S))
            except queue.Empty:
                return
        while self._running:
            try:
                message = self.input_queue.get_nowait()
            except queue.Empty:
                return
            self._apply(message)

    def _apply(self, message: CoreInput) -> None:
        if isinstance(message, EngineCoreRequest):
            self._add_request(message)
        elif isinstance(message, AbortRequests):
            self.core.abort_requests(message.request_ids)
        elif isinstance(message, UtilityCall):
            self.output_queue.put(self._call_utility(message))
        elif isinstance(message, Shutdown):
            self._running = False

    def _add_request(self, request: EngineCoreRequest) -> None:
        self.num_requests_received += 1
        try:
            self.core.add_request(request)
        except ValueError as error:
            self._reject(request.request_id, str(error))
        except Exception as error:  # a failing plugin (policy) must not take the loop down
            logger.exception("adding request %r failed", request.request_id)
            self.core.abort_requests([request.request_id])
            self._reject(request.request_id, f"internal error: {type(error).__name__}: {error}")

    def _call_utility(self, call: UtilityCall) -> UtilityResult:
        if call.method not in EngineCore.UTILITIES:
            return UtilityResult(call_id=call.call_id, error=f"unknown utility {call.method!r}")
        try:
            result = getattr(self.core, call.method)(*call.args)
        except Exception as error:  # a failed check or bad arguments answer the caller only
            return UtilityResult(call_id=call.call_id, error=f"{type(error).__name__}: {error}")
        return UtilityResult(call_id=call.call_id, result=result)

    def _reject(self, request_id: str, error: str) -> None:
        rejection = EngineCoreOutput(request_id=request_id, new_token_ids=[],
                                     finish_reason=FinishReason.ABORT, error=error)
        self.output_queue.put(self._outputs_event([rejection]))

    # IO threads.
    def _read_inputs(self) -> None:
        decoder = msgspec.msgpack.Decoder(CoreInput)
        while not self._stop_reading.is_set():
            if not self.input_socket.poll(POLL_INTERVAL_MS):
                continue
            raw = self.input_socket.recv()
            try:
                message = decoder.decode(raw)
            except msgspec.DecodeError as error:
                self._answer_malformed(raw, error)
                continue
            self.input_queue.put(message)
            self.core.wake()

    def _answer_malformed(self, raw: bytes, error: Exception) -> None:
        """Tells the sender what was wrong, when the message says who is waiting for it."""
        logger.warning("dropped a malformed engine-core message: %s", error)
        try:
            fields: Any = msgspec.msgpack.decode(raw)
        except msgspec.DecodeError:
            return
        if not isinstance(fields, dict):
            return
        reason = f"malformed message: {error}"
        request_id, call_id = fields.get("request_id"), fields.get("call_id")
        if fields.get("type") == "add" and isinstance(request_id, str) and request_id:
            self._reject(request_id, reason)
        elif fields.get("type") == "utility" and isinstance(call_id, int):
            self.output_queue.put(UtilityResult(call_id=call_id, error=reason))

    def _write_outputs(self) -> None:
        encoder = msgspec.msgpack.Encoder()
        while (event := self.output_queue.get()) is not None:
            self.output_socket.send(encoder.encode(event))


def run_engine_core(
    config_message: bytes, input_address: str, output_address: str, identity: bytes,
    parent_pid: int,
) -> None:
    """The core process's entry point: builds the core, answers the handshake, serves.

    `config_message` is the msgpack-encoded `EngineConfig`. Exits with status 1 if building
    the core or the busy loop fails (the frontend is told why first).
    """
    # Ctrl-C and SIGTERM are the frontend's to handle (a supervisor may signal the whole
    # process group): the frontend drains, then stops the core; the core also stops by
    # itself once the frontend is gone.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # A forward on the CPU allocates its activations anew each step, each one mapped and
    # faulted in page by page unless malloc keeps them in its heap.
    keep_large_buffers_in_heap()
    context = zmq.Context()
    input_socket = context.socket(zmq.DEALER)
    input_socket.setsockopt(zmq.IDENTITY, identity)
    input_socket.connect(input_address)
    output_socket = context.socket(zmq.PUSH)
    output_socket.connect(output_address)
    try:
        exit_code = _build_and_serve(config_message, input_socket, output_socket, parent_pid)
    finally:
        input_socket.close(linger=_LINGER_MS)
        output_socket.close(linger=_LINGER_MS)
        context.term()
    sys.exit(exit_code)


def _build_and_serve(
    config_message: bytes, input_socket: zmq.Socket, output_socket: zmq.Socket, parent_pid: int
) -> int:
    encoder = msgspec.msgpack.Encoder()
    try:
        config = msgspec.msgpack.decode(config_message, type=EngineConfig)
        core = EngineCore(config)
    except Exception as error:
        input_socket.send(encoder.encode(CoreStartupFailed(f"{type(error).__name__}: {error}")))
        return 1
    freeze_startup_heap()
    input_socket.send(encoder.encode(CoreReady(
        num_kv_blocks=core.executor.num_kv_blocks, vocab_size=core.vocab_size,
        max_model_len=config.scheduler.max_model_len,
    )))
    try:
        EngineCoreProc(core, input_socket, output_socket, parent_pid).run()
    except Exception:
        logger.exception("the engine core failed")
        return 1
    return 0
