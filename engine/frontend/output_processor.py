"""Output processing: core outputs (new token ids) -> `RequestOutput`s (text, tokens, logprobs).

Owns the frontend state of every unfinished request: detokenizers, stop-string matching, and
what has been reported so far for each output kind. Called by `LLMEngine` / `AsyncLLM` once
per batch of core outputs.

A streamed (delta) request keeps only the logprobs it has not reported yet: a position's 20
top logprobs weigh about a kilobyte, and kept for a whole stream they would hold the server's
memory for as long as its longest stream.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from engine.frontend.detokenizer import IncrementalDetokenizer, detokenize_once, make_decode_fn
from engine.frontend.processor import ProcessedRequest
from engine.frontend.request_outputs import CompletionOutput, RequestMetrics, RequestOutput
from engine.frontend.stats import FinishedCompletionStats, RequestStatsObserver
from engine.frontend.stop_strings import find_stop_string, num_held_back_chars
from engine.outputs import EngineCoreOutput, PromptLogprobs, TokenLogprobs
from engine.request import FinishReason
from engine.sampling_params import RequestOutputKind, SamplingParams


@dataclass
class _Completion:
    """Frontend state of one completion (one core request)."""

    index: int
    core_request_id: str
    detokenizer: IncrementalDetokenizer | None  # None: decoded once, at the end
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    # All of them, or for a delta request those after `num_sent_tokens` only.
    logprobs: list[TokenLogprobs] | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    num_sent_chars: int = 0
    num_sent_tokens: int = 0
    last_token_time_s: float | None = None
    finish_reported: bool = False
    num_hidden_tokens: int = 0  # the stop token that ended it is not part of the text

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class _PromptLogprobBook:
    """A request's prompt logprobs by prompt position, as the core reports them in runs (one
    per prefill step); `entries[0]` stays None, the first token has none."""

    entries: list[TokenLogprobs | None]
    num_missing: int
    reported: bool = False  # a delta output carried them

    @classmethod
    def for_prompt(cls, num_prompt_tokens: int) -> _PromptLogprobBook:
        return cls(entries=[None] * num_prompt_tokens, num_missing=num_prompt_tokens - 1)

    def add(self, run: PromptLogprobs) -> None:
        """Records a run; a position reported before (a prompt recomputed after a
        preemption) keeps its entry."""
        for position, entry in enumerate(run.entries, start=run.start_index):
            if 0 < position < len(self.entries) and self.entries[position] is None:
                self.entries[position] = entry
                self.num_missing -= 1


@dataclass
class _RequestState:
    processed: ProcessedRequest
    completions: list[_Completion]
    metrics: RequestMetrics
    queue: asyncio.Queue[Any] | None
    num_cached_tokens: int = 0
    error: str | None = None
    error_param: str | None = None
    prompt_logprobs: _PromptLogprobBook | None = None
    job_id: str | None = None
    job_reported: bool = False  # its first token came, naming its job or none

    @property
    def finished(self) -> bool:
        return all(completion.finished for completion in self.completions)


@dataclass
class ProcessedOutputs:
    """`request_outputs` for requests without a queue; `core_requests_to_abort`: completions
    that a stop string finished while the core is still generating them; `job_ids`: the
    jobs of the requests whose first token came in this batch, by request id (None: the
    request has no job); `finished`: the ids of the requests this batch finished."""

    request_outputs: list[RequestOutput] = field(default_factory=list)
    core_requests_to_abort: list[str] = field(default_factory=list)
    job_ids: dict[str, str | None] = field(default_factory=dict)
    finished: list[str] = field(default_factory=list)


class OutputProcessor:
    """Frontend state of unfinished requests, keyed by request id and by core request id.

    `stats_observer`, if given, is told each completion's latencies and end.
    """

    def __init__(
        self,
        tokenizer: Any,
        clock: Callable[[], float] = time.monotonic,
        stats_observer: RequestStatsObserver | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.clock = clock
        self.stats_observer = stats_observer
        # By (skip_special_tokens, special tokens kept anyway): a handful of entries.
        self._decode_fns: dict[tuple[bool, frozenset[int]], Callable[[list[int]], str]] = {}
        self._requests: dict[str, _RequestState] = {}
        self._by_core_id: dict[str, tuple[_RequestState, _Completion]] = {}

    def __len__(self) -> int:
        return len(self._requests)

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    def add_request(
        self, processed: ProcessedRequest, queue: asyncio.Queue[Any] | None = None
    ) -> None:
        """Starts tracking a request; its outputs go to `queue` if given, else are returned
        by `process_outputs`. ValueError if its id (or a core id of its completions) is in
        use."""
        core_ids = [core_request.request_id for core_request in processed.core_requests]
        if processed.request_id in self._requests or any(i in self._by_core_id for i in core_ids):
            raise ValueError(f"request id {processed.request_id!r} is already in use")
        params = processed.sampling_params
        state = _RequestState(
            processed=processed, completions=[],
            metrics=RequestMetrics(arrival_time_s=self.clock()), queue=queue,
            prompt_logprobs=None if params.prompt_logprobs is None
            else _PromptLogprobBook.for_prompt(len(processed.prompt_token_ids)),
        )
        for index, core_request in enumerate(processed.core_requests):
            completion = _Completion(
                index=index, core_request_id=core_request.request_id,
                detokenizer=self._detokenizer(processed),
                logprobs=[] if params.logprobs is not None else None,
            )
            state.completions.append(completion)
            self._by_core_id[core_request.request_id] = (state, completion)
        self._requests[processed.request_id] = state

    def abort_requests(self, request_ids: list[str]) -> list[str]:
        """Finishes the requests with reason "abort" (a queued request gets that final output)
        and forgets them; returns the core request ids of their unfinished completions."""
        core_ids = []
        for request_id in request_ids:
            state = self._requests.get(request_id)
            if state is None:
                continue
            self._forget(state)
            unfinished = [c for c in state.completions if not c.finished]
            core_ids.extend(c.core_request_id for c in unfinished)
            for completion in unfinished:
                completion.finish_reason = FinishReason.ABORT
            self._report_finished(state, unfinished, self.clock())
            if state.queue is not None:
                state.queue.put_nowait(self._request_output(state, unfinished, finished=True))
        return core_ids

    def _forget(self, state: _RequestState) -> None:
        del self._requests[state.processed.request_id]
        for completion in state.completions:
            del self._by_core_id[completion.core_request_id]

    def propagate_error(self, error: BaseException) -> None:
        """Hands `error` to every request with a queue (the engine died)."""
        for state in self._requests.values():
            if state.queue is not None:
                state.queue.put_nowait(error)

    def process_outputs(self, core_outputs: list[EngineCoreOutput]) -> ProcessedOutputs:
        """Applies one batch of core outputs; called once per batch the core sends."""
        result = ProcessedOutputs()
        now_s = self.clock()
        touched: dict[str, tuple[_RequestState, list[_Completion]]] = {}
        for core_output in core_outputs:
            entry = self._by_core_id.get(core_output.request_id)
            if entry is None:
                continue  # aborted by the frontend since
            state, completion = entry
            if completion.finished:
                continue  # a stop string ended it; the core had not heard yet
            if self._apply(state, completion, core_output, now_s):
                result.core_requests_to_abort.append(completion.core_request_id)
            if core_output.new_token_ids and not state.job_reported:
                # The core names the job with the first token, or names none then.
                state.job_reported = True
                state.job_id = core_output.job_id
                result.job_ids[state.processed.request_id] = core_output.job_id
            touched.setdefault(state.processed.request_id, (state, []))[1].append(completion)
        for state, completions in touched.values():
            self._report_finished(state, completions, now_s)
            self._emit(state, completions, now_s, result)
        return result

    def _observe_tokens(self, completion: _Completion, num_tokens: int, now_s: float,
                        arrival_time_s: float) -> None:
        observer = self.stats_observer
        if observer is not None:
            if completion.last_token_time_s is None:
                observer.on_first_token(now_s - arrival_time_s)
            else:
                observer.on_inter_token((now_s - completion.last_token_time_s) / num_tokens)
        completion.last_token_time_s = now_s

    def _report_finished(
        self, state: _RequestState, completions: list[_Completion], now_s: float
    ) -> None:
        observer = self.stats_observer
        for completion in completions:
            if not completion.finished or completion.finish_reported:
                continue
            completion.finish_reported = True
            if observer is not None:
                observer.on_completion_finished(FinishedCompletionStats(
                    finish_reason=str(completion.finish_reason),
                    e2e_latency_s=now_s - state.metrics.arrival_time_s,
                    num_prompt_tokens=len(state.processed.prompt_token_ids),
                    num_generation_tokens=len(completion.token_ids),
                    num_cached_tokens=state.num_cached_tokens,
                ))

    def _detokenizer(self, processed: ProcessedRequest) -> IncrementalDetokenizer | None:
        params = processed.sampling_params
        if params.output_kind is RequestOutputKind.FINAL_ONLY and not params.stop:
            return None
        return IncrementalDetokenizer(self._decode_fn(processed), processed.prompt_token_ids)

    def _decode_fn(self, processed: ProcessedRequest) -> Callable[[list[int]], str]:
        """The request's `ids -> text`, as its `skip_special_tokens` and
        `kept_special_token_ids` say."""
        skip = processed.sampling_params.skip_special_tokens
        key = (skip, processed.kept_special_token_ids if skip else frozenset())
        decode = self._decode_fns.get(key)
        if decode is None:
            decode = self._decode_fns[key] = make_decode_fn(self.tokenizer, *key)
        return decode

    def _apply(
        self, state: _RequestState, completion: _Completion, output: EngineCoreOutput,
        now_s: float,
    ) -> bool:
        """Applies one core output; True if a stop string ended a completion the core is
        still running."""
        if output.error is not None:
            state.error = output.error
            state.error_param = output.error_param
            completion.finish_reason = FinishReason.ABORT
            return False
        if output.new_token_ids:
            state.metrics.first_token_time_s = state.metrics.first_token_time_s or now_s
            state.metrics.last_token_time_s = now_s
            self._observe_tokens(completion, len(output.new_token_ids), now_s,
                                 state.metrics.arrival_time_s)
        state.num_cached_tokens = output.num_cached_tokens
        if output.prompt_logprobs is not None and state.prompt_logprobs is not None:
            state.prompt_logprobs.add(output.prompt_logprobs)
        completion.token_ids.extend(output.new_token_ids)
        if completion.logprobs is not None and output.logprobs:
            completion.logprobs.extend(output.logprobs)
        text_token_ids = output.new_token_ids
        if _hides_stop_token(output, state.processed.sampling_params):
            text_token_ids = text_token_ids[:-1]
            completion.num_hidden_tokens = 1
        stopped_by_string = self._detokenize(state, completion, text_token_ids)
        if stopped_by_string:
            return output.finish_reason is None
        if output.finish_reason is not None:
            completion.finish_reason = output.finish_reason
            completion.stop_reason = output.stop_reason
            self._finish_text(state, completion)  # a stop string in the flushed text wins
        return False

    def _detokenize(
        self, state: _RequestState, completion: _Completion, new_token_ids: list[int]
    ) -> bool:
        """Extends the text; True if that completed a stop string (which finishes it)."""
        if completion.detokenizer is None:
            return False
        return self._extend_text(state, completion, completion.detokenizer.push(new_token_ids))

    def _extend_text(self, state: _RequestState, completion: _Completion, new_text: str) -> bool:
        num_old_chars = len(completion.text)
        completion.text += new_text
        params = state.processed.sampling_params
        match = params.stop and find_stop_string(completion.text, params.stop, num_old_chars)
        if not match:
            return False
        start, stop_string = match
        end = start + len(stop_string) if params.include_stop_str_in_output else start
        completion.text = completion.text[:end]
        completion.finish_reason = FinishReason.STOP
        completion.stop_reason = stop_string
        return True

    def _finish_text(self, state: _RequestState, completion: _Completion) -> None:
        processed = state.processed
        if completion.detokenizer is None:
            decode = self._decode_fn(processed)
            num_text_tokens = len(completion.token_ids) - completion.num_hidden_tokens
            completion.text = detokenize_once(decode, processed.prompt_token_ids,
                                              completion.token_ids[:num_text_tokens])
        else:
            self._extend_text(state, completion, completion.detokenizer.flush())

    def _emit(
        self, state: _RequestState, completions: list[_Completion], now_s: float,
        result: ProcessedOutputs,
    ) -> None:
        finished = state.finished
        if finished:
            state.metrics.finished_time_s = now_s
            self._forget(state)
            result.finished.append(state.processed.request_id)
        output = self._request_output(state, completions, finished)
        if output is None:
            return
        if state.queue is not None:
            state.queue.put_nowait(output)
        else:
            result.request_outputs.append(output)

    def _request_output(
        self, state: _RequestState, changed: list[_Completion], finished: bool
    ) -> RequestOutput | None:
        """The output to report now for the request's kind, or None if there is nothing (or
        the prompt's logprobs are still incomplete)."""
        kind = state.processed.sampling_params.output_kind
        book = state.prompt_logprobs
        if not finished and (kind is RequestOutputKind.FINAL_ONLY
                             or (book is not None and book.num_missing)):
            return None
        if kind is RequestOutputKind.DELTA:
            if book is not None and not book.reported:
                changed = state.completions  # some may have waited for the prompt logprobs
            reported = [self._completion_output(state, c, delta=True) for c in changed]
            reported = [c for c in reported if c.text or c.token_ids or c.finished]
            if not reported and not finished:
                return None
        else:
            reported = [self._completion_output(state, c, delta=False)
                        for c in state.completions]
        prompt_logprobs = None
        if book is not None and not (kind is RequestOutputKind.DELTA and book.reported):
            prompt_logprobs = book.entries
            book.reported = True
        processed = state.processed
        return RequestOutput(
            request_id=processed.request_id, prompt=processed.prompt,
            prompt_token_ids=processed.prompt_token_ids, outputs=reported, finished=finished,
            num_cached_tokens=state.num_cached_tokens, metrics=dataclasses.replace(state.metrics),
            error=state.error, error_param=state.error_param, prompt_logprobs=prompt_logprobs,
            job_id=state.job_id,
        )

    def _completion_output(
        self, state: _RequestState, completion: _Completion, *, delta: bool
    ) -> CompletionOutput:
        params = state.processed.sampling_params
        num_chars = len(completion.text)
        if not completion.finished:
            num_chars -= num_held_back_chars(params.stop, params.include_stop_str_in_output)
        first_char = completion.num_sent_chars if delta else 0
        first_token = completion.num_sent_tokens if delta else 0
        num_chars = max(num_chars, completion.num_sent_chars)
        completion.num_sent_chars = num_chars
        completion.num_sent_tokens = len(completion.token_ids)
        logprobs = completion.logprobs
        if logprobs is not None:
            if delta:  # reported now: the completion keeps none of them
                completion.logprobs = []
            else:
                logprobs = list(logprobs)
        return CompletionOutput(
            index=completion.index,
            text=completion.text[first_char:num_chars],
            token_ids=completion.token_ids[first_token:],
            logprobs=logprobs,
            finish_reason=None if completion.finish_reason is None
            else str(completion.finish_reason),
            stop_reason=completion.stop_reason,
        )


def _hides_stop_token(output: EngineCoreOutput, params: SamplingParams) -> bool:
    """Whether the last new token is the EOS or stop token that finished the completion and
    stays out of its text (it stays in its token ids). The core stops only on tokens."""
    return (output.finish_reason is FinishReason.STOP and bool(output.new_token_ids)
            and not params.include_stop_str_in_output)
