"""`LLMEngine`: the synchronous engine API, over an in-process or a multiprocess core."""

from __future__ import annotations

from typing import Any

import msgspec

from engine.config import EngineConfig
from engine.core.client import InprocClient, SyncMPClient
from engine.core.wire import EngineStats
from engine.engine_args import EngineArgs
from engine.frontend.output_processor import OutputProcessor
from engine.frontend.processor import InputProcessor, ProcessedRequest, Prompt
from engine.frontend.request_outputs import RequestOutput
from engine.frontend.startup import start_with_processor
from engine.request import JobInfo
from engine.sampling_params import SamplingParams


class LLMEngine:
    """Add requests, then call `step()` until `has_unfinished_requests()` is False.

    `multiprocess=False` runs the core in this thread (each `step` runs one core step);
    `multiprocess=True` runs it in its own process (each `step` waits for the next outputs).
    """

    def __init__(
        self, config: EngineConfig, *, multiprocess: bool = False, tokenizer: Any = None,
        **core_kwargs: Any,
    ) -> None:
        self.config = config
        self.client: InprocClient | SyncMPClient
        if multiprocess:
            self.processor, self.client = start_with_processor(
                config, tokenizer, lambda check: SyncMPClient(config, startup_check=check))
        else:
            self.processor = InputProcessor.for_config(config, tokenizer)
            self.client = InprocClient(config, **core_kwargs)
        self.tokenizer = self.processor.tokenizer
        self.output_processor = OutputProcessor(self.tokenizer)
        self._grammars_prepared = False

    @classmethod
    def from_engine_args(cls, args: EngineArgs, **kwargs: Any) -> LLMEngine:
        return cls(args.to_engine_config(), **kwargs)

    def add_request(
        self,
        request_id: str,
        prompt: Prompt,
        sampling_params: SamplingParams,
        *,
        job: JobInfo | None = None,
        priority: int = 0,
    ) -> None:
        """Queues a request; ValueError (and no change) if it is invalid."""
        self.add_processed_request(self.processor.process(
            request_id, prompt, sampling_params, job=job, priority=priority
        ))

    def add_processed_request(self, processed: ProcessedRequest) -> None:
        """Queues a request that `self.processor` has already validated; the first with a
        grammar has the core prepare its grammars first (`prepare_grammars`)."""
        if not self._grammars_prepared and any(
                core_request.sampling_params.structured_output is not None
                for core_request in processed.core_requests):
            self.prepare_grammars()
        self.output_processor.add_request(processed)
        try:
            for core_request in processed.core_requests:
                self.client.add_request(core_request)
        except BaseException:
            self.abort_requests([processed.request_id])
            raise

    def step(self) -> list[RequestOutput]:
        """Advances the engine by one core step; the outputs of requests that progressed."""
        processed = self.output_processor.process_outputs(self.client.get_output())
        if processed.core_requests_to_abort:
            self.client.abort_requests(processed.core_requests_to_abort)
        return processed.request_outputs

    def abort_requests(self, request_ids: list[str]) -> None:
        """Stops the requests (unknown or finished ids are ignored) and frees their blocks."""
        core_ids = self.output_processor.abort_requests(request_ids)
        if core_ids:
            self.client.abort_requests(core_ids)

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished_requests()

    def get_stats(self) -> EngineStats:
        """A snapshot of the core's queues, KV pool, pins and step timings."""
        return msgspec.convert(self.client.call_utility("stats"), EngineStats,
                               from_attributes=True)

    def prepare_grammars(self) -> bool:
        """Has the core build its grammars' tokenizer for the EOS this engine gives requests
        (`EngineCore.prepare_grammars`), here rather than on its compile thread beside the
        steps of requests without a grammar, which building it (holding the GIL for up to
        seconds) would stall. Called once, before the first request with a grammar is
        queued. Whether it was built (a failure is logged by the core; grammars then fail at
        compile)."""
        self._grammars_prepared = True
        return bool(self.client.call_utility("prepare_grammars", self.processor.eos_token_id))

    def reset_prefix_cache(self) -> bool:
        """Forgets cached prefixes; False (no change) while any block is in use."""
        return bool(self.client.call_utility("reset_prefix_cache"))

    def release_job(self, job_id: str) -> bool:
        """Ends the job's state in the core, releasing its pin; True if it held one."""
        return bool(self.client.call_utility("release_job", job_id))

    def shutdown(self) -> None:
        """Stops the core (and its process, if it has one)."""
        self.client.shutdown()
