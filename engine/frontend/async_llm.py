"""`AsyncLLM`: the asyncio engine API (the HTTP server's), over a core process.

Each request gets its own queue of outputs, read by the `generate` async generator that the
caller iterates. One output-handler task reads the core's outputs, turns them into request
outputs, and routes them to those queues. A caller that stops iterating (or is cancelled)
aborts its request; when the core dies, every caller gets `EngineDeadError`.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import AsyncIterator, Sequence
from typing import Any

import msgspec
import zmq

from engine.config import EngineConfig
from engine.core.client import AsyncMPClient, EngineDeadError
from engine.core.wire import EngineStats, JobState
from engine.engine_args import EngineArgs
from engine.frontend.output_processor import OutputProcessor
from engine.frontend.processor import ProcessedRequest, Prompt
from engine.frontend.request_outputs import RequestOutput, RequestRejected
from engine.frontend.startup import start_with_processor
from engine.frontend.stats import RequestStatsObserver
from engine.request import JobInfo
from engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

_OutputQueue = asyncio.Queue[RequestOutput | BaseException]


class QueueFullError(Exception):
    """Queueing the requests would take the waiting queue past its limit."""

    def __init__(self, num_waiting: int, num_new: int, limit: int) -> None:
        super().__init__(
            f"{num_waiting} engine requests wait and this request adds {num_new} (prompts x "
            f"n), over the limit of {limit}")
        self.num_waiting = num_waiting
        self.num_new = num_new
        self.limit = limit


class AsyncLLM:
    """Starts the core process on construction; `shutdown()` stops it. All methods must be
    called from one event loop."""

    def __init__(
        self,
        config: EngineConfig,
        *,
        tokenizer: Any = None,
        startup_timeout_s: float = 600.0,
        stats_observer: RequestStatsObserver | None = None,
    ) -> None:
        self.config = config
        self.processor, self.client = start_with_processor(
            config, tokenizer, lambda check: AsyncMPClient(
                config, startup_timeout_s=startup_timeout_s, startup_check=check))
        self.tokenizer = self.processor.tokenizer
        self.output_processor = OutputProcessor(self.tokenizer, stats_observer=stats_observer)
        self._output_handler: asyncio.Task[None] | None = None
        # Each unfinished request's job, resolved at its first output (None: it ended first).
        self._jobs: dict[str, asyncio.Future[str | None]] = {}
        self._request_counter = itertools.count()
        self._background_aborts: set[asyncio.Task[None]] = set()
        self._refusal: Exception | None = None  # set by fail_requests

    @classmethod
    def from_engine_args(cls, args: EngineArgs, **kwargs: Any) -> AsyncLLM:
        return cls(args.to_engine_config(), **kwargs)

    @property
    def is_dead(self) -> bool:
        return self.client.is_dead

    @property
    def num_waiting_requests(self) -> int:
        """Requests waiting for the core to admit them (as of its latest report, plus those
        on their way to it); one per completion, so a request with `n=4` counts 4."""
        return self.client.num_waiting_requests

    @property
    def num_unfinished_requests(self) -> int:
        """Requests submitted whose final output their caller has not yet been handed."""
        return len(self.output_processor)

    async def generate(
        self,
        prompt: Prompt,
        sampling_params: SamplingParams,
        request_id: str | None = None,
        *,
        job: JobInfo | None = None,
        priority: int = 0,
    ) -> AsyncIterator[RequestOutput]:
        """Streams the request's outputs (per its `output_kind`) until the finished one.

        ValueError if the request is invalid (raised before anything is queued) or the core
        rejected it; EngineDeadError if the core died. `request_id` must not repeat the id of
        an aborted request (the core may still be dropping it); the default ids are unique.
        """
        if request_id is None:
            request_id = f"async-{next(self._request_counter)}"
        processed = self.processor.process(request_id, prompt, sampling_params, job=job,
                                           priority=priority)
        async with contextlib.aclosing(self.stream(processed)) as outputs:
            async for output in outputs:
                yield output

    async def stream(self, processed: ProcessedRequest) -> AsyncIterator[RequestOutput]:
        """Like `generate`, for a request already validated by `self.processor.process`."""
        (outputs,) = self.submit([processed])
        async with contextlib.aclosing(outputs) as stream:  # type: ignore[type-var]
            async for output in stream:
                yield output

    def submit(
        self, requests: Sequence[ProcessedRequest], *, max_waiting_requests: int | None = None
    ) -> list[AsyncIterator[RequestOutput]]:
        """Queues validated requests with the core, all or none, and returns their output
        streams in order (the HTTP server validates before it starts a response).

        Synchronous, so that no other caller queues between the check and the queueing:
        QueueFullError if their completions would take `num_waiting_requests` past
        `max_waiting_requests`; ValueError if a request id is in use; EngineDeadError if the
        core died. Closing a stream before its final output aborts its request.
        """
        if self._refusal is not None:
            raise self._refusal
        self.check_queue_room(sum(len(processed.core_requests) for processed in requests),
                              max_waiting_requests)
        self.client.check_alive()
        self._ensure_output_handler()
        queues = self._register(requests)
        try:
            for processed in requests:
                for core_request in processed.core_requests:
                    self.client.add_request_nowait(core_request)
        except (EngineDeadError, zmq.ZMQError) as error:
            # The core is gone (what was sent dies with it): nothing of the batch stays.
            self.output_processor.abort_requests([processed.request_id for processed in requests])
            raise EngineDeadError(f"cannot reach the engine core: {error}") from error
        return [self._outputs(processed.request_id, queue)
                for processed, queue in zip(requests, queues, strict=True)]

    def check_queue_room(self, num_new: int, max_waiting_requests: int | None) -> None:
        """QueueFullError if `num_new` more core requests would take `num_waiting_requests`
        past `max_waiting_requests` (None: no limit)."""
        num_waiting = self.num_waiting_requests
        if max_waiting_requests is not None and num_waiting + num_new > max_waiting_requests:
            raise QueueFullError(num_waiting, num_new, max_waiting_requests)

    def _register(self, requests: Sequence[ProcessedRequest]) -> list[_OutputQueue]:
        """One output queue per request, registered with the output processor (all or
        none: ValueError on an id in use)."""
        queues: list[_OutputQueue] = []
        try:
            for processed in requests:
                queue: _OutputQueue = asyncio.Queue()
                self.output_processor.add_request(processed, queue)
                queues.append(queue)
                self._jobs[processed.request_id] = asyncio.get_running_loop().create_future()
        except ValueError:
            self.output_processor.abort_requests(
                [processed.request_id for processed in requests[:len(queues)]])
            raise
        return queues

    async def _outputs(self, request_id: str, queue: _OutputQueue
                       ) -> AsyncIterator[RequestOutput]:
        finished = False
        try:
            while not finished:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                if item.error is not None:
                    raise RequestRejected(item.error, item.error_param)
                finished = item.finished
                yield item
        finally:
            self._settle_job(request_id, None)
            if not finished:
                # No await here: a cancelled caller (a client that disconnected) may not be
                # able to await again, and the core must still hear of the abort.
                self.abort_nowait(request_id)

    def job_of(self, request_id: str) -> asyncio.Future[str | None]:
        """The engine's id of the job of submitted request `request_id`, once its first
        output names it (the client's job, or the one the scheduler inferred); None if it
        ends first, or names none. Take it before the request's stream ends."""
        future = self._jobs.get(request_id)
        if future is None:
            future = asyncio.get_running_loop().create_future()
            future.set_result(None)
        return future

    def _propagate(self, error: BaseException) -> None:
        """Hands `error` to every request in flight; none of them will name its job now."""
        self.output_processor.propagate_error(error)
        for request_id in list(self._jobs):
            self._settle_job(request_id, None)

    def _settle_job(self, request_id: str, job_id: str | None) -> None:
        future = self._jobs.pop(request_id, None)
        if future is not None and not future.done():
            future.set_result(job_id)

    def fail_requests(self, error: Exception) -> None:
        """Ends every request in flight, and refuses every later one, with `error`: a stream
        raises it, and the core stops the request (the server's drain, once its time is
        up)."""
        self._refusal = error
        self._propagate(error)

    async def abort(self, request_id: str) -> None:
        """Stops the request (if unfinished) and frees its KV blocks in the core; its stream
        ends with a finished output whose completions have reason "abort"."""
        core_ids = self.output_processor.abort_requests([request_id])
        self._settle_job(request_id, None)
        if core_ids and not self.client.is_dead:
            await self._abort_core_requests(core_ids)

    def abort_nowait(self, request_id: str) -> None:
        """`abort` without awaiting: the request ends at once here, and a background task
        tells the core. For code that may not await (a `finally` of a cancelled task)."""
        core_ids = self.output_processor.abort_requests([request_id])
        self._settle_job(request_id, None)
        if not core_ids or self.client.is_dead:
            return
        task = asyncio.get_running_loop().create_task(self._abort_core_requests(core_ids))
        self._background_aborts.add(task)
        task.add_done_callback(self._background_aborts.discard)

    async def _abort_core_requests(self, core_ids: list[str]) -> None:
        with contextlib.suppress(EngineDeadError):
            await self.client.abort_requests_async(core_ids)

    async def get_stats(self) -> EngineStats:
        """A snapshot of the core's queues, KV pool, pins and step timings."""
        return msgspec.convert(await self.client.call_utility_async("stats"), EngineStats)

    async def reset_prefix_cache(self) -> bool:
        """Forgets cached prefixes; False (no change) while any block is in use."""
        return bool(await self.client.call_utility_async("reset_prefix_cache"))

    async def release_job(self, job_id: str) -> bool:
        """Ends the job's state in the core, releasing its pin; True if it held one."""
        return bool(await self.client.call_utility_async("release_job", job_id))

    async def job_state(self, job_id: str) -> JobState | None:
        """The job's unfinished turns and pin in the core; None if it holds nothing for it."""
        return msgspec.convert(await self.client.call_utility_async("job_state", job_id),
                               JobState | None)

    async def prepare_grammars(self) -> bool:
        """Has the core build its grammars' tokenizer for the EOS this frontend gives
        requests (`EngineCore.prepare_grammars`); the server calls it at start-up, before it
        takes requests. Whether it was built."""
        return bool(await self.client.call_utility_async("prepare_grammars",
                                                         self.processor.eos_token_id))

    async def check_invariants(self) -> None:
        """Asks the core to check its scheduler and KV invariants (AssertionError -> failure)."""
        await self.client.call_utility_async("check_invariants")

    def shutdown(self) -> None:
        """Stops the core process; every request in flight fails with EngineDeadError."""
        self._propagate(EngineDeadError("the engine was shut down"))
        if self._output_handler is not None and not self._output_handler.done():
            self._output_handler.cancel()
        self.client.shutdown()

    def _ensure_output_handler(self) -> None:
        if self._output_handler is None:
            self._output_handler = asyncio.get_running_loop().create_task(
                self._handle_outputs(), name="async-llm-outputs"
            )

    async def _handle_outputs(self) -> None:
        try:
            while True:
                core_outputs = await self.client.get_output_async()
                processed = self.output_processor.process_outputs(core_outputs)
                for request_id, job_id in processed.job_ids.items():
                    self._settle_job(request_id, job_id)
                for request_id in processed.finished:
                    self._settle_job(request_id, None)
                if processed.core_requests_to_abort:
                    await self.client.abort_requests_async(processed.core_requests_to_abort)
        except EngineDeadError as error:
            self._propagate(error)
        except Exception as error:
            logger.exception("output processing failed; failing every request in flight")
            self._propagate(error)
            self.client.shutdown()
