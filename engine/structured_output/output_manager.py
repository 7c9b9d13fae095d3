"""The engine core's side of structured outputs: compiling grammars and computing masks.

Owned by the `EngineCore` (one thread calls it). Grammar work never runs on the step loop:
- **Compiles** run on a worker thread, one at a time (`submit`, then `pop_compiled`), so that
  the heap each allocates is its own, taken by tenants in turn (`compile_queue.py`), so that
  another tenant's next grammar waits for the compile running and at most one of each tenant
  ahead of it, whatever their backlogs; a request waits in the core, outside the scheduler,
  until its grammar is ready. A compile is charged its text and that heap, and fails,
  uncached, past `max_grammar_bytes` or, as a deadline the core checks at every step (counted
  from the compile's start), past `max_grammar_compile_s`. Compiled grammars are shared by
  requests with the same (grammar, EOS) through a cache bounded in bytes
  (`grammar_cache_bytes`, least recently used first out); failures are never cached.
  The byte limit also bounds a compile before it runs: llguidance's lexer gets the fuel
  (its unit of work building expressions and states) that `max_grammar_bytes` buys at
  `LEXER_BYTES_PER_FUEL`, and a grammar that runs out fails as too large. A failed compile
  leaves nothing behind: its error carries no frames (which would hold its matcher), and
  the compile thread then calls `release_heap`, which hands the heap's free memory back.
- **Masks** run on worker threads too: a request's first mask is the compile's, and its
  next one is started as soon as it accepts a token. Before every step the core calls
  `await_masks`, which waits until a deadline for the masks started less than
  `grammar_mask_budget_s` ago, then says which requests are `held_back` (their mask is not
  ready: the step must not sample them) and which fail: a grammar whose masks took more
  than the budget of CPU `MAX_SLOW_MASKS` times (the compile's first mask included), or
  whose current mask has already used that many budgets, is too slow, and only its
  request ends.

Worker threads run at a lower CPU priority (niceness 10: about a tenth of the step loop's
share when both want a core), so that on a busy machine grammar work yields to the step loop
without starving. Torch-free: masks are numpy int32 words, bit `i % 32` of word
`i // 32` allowing token `i`.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any

import llguidance
import llguidance.numpy
import numpy as np

from engine.config import StructuredOutputConfig
from engine.structured_output.bitmask import GrammarBitmask
from engine.structured_output.compile_queue import CompileQueue
from engine.structured_output.grammars import check_schema_ranges, short_error
from engine.structured_output.spec import StructuredOutputSpec
from engine.structured_output.tokenizer import GrammarTokenizerSource

logger = logging.getLogger(__name__)

NUM_MASK_THREADS = 4
MAX_SLOW_MASKS = 3
WORKER_NICENESS = 10  # a tenth of the step loop's CPU share
# The most C heap one unit of llguidance's lexer fuel allocated, in bytes, measured over
# hostile and ordinary grammars (docs/decisions/0030-grammar-compile-memory.md).
LEXER_BYTES_PER_FUEL = 256


@dataclass(frozen=True)
class GrammarFailure:
    """A request whose grammar failed: `error` is a short message; `param` names the request
    field the grammar came from (None when unknown)."""

    request_id: str
    error: str
    param: str | None


@dataclass(frozen=True)
class CompileOutcome:
    """A grammar compile that ended for `request_id`: `failure` is None when the request may
    be queued."""

    request_id: str
    failure: GrammarFailure | None


@dataclass(frozen=True)
class MaskRound:
    """What `await_masks` found before a step: the requests whose mask is not ready (the step
    must not sample them) and those whose grammar was too slow (already forgotten here)."""

    held_back: frozenset[str]
    failures: tuple[GrammarFailure, ...]


@dataclass(frozen=True)
class _Compiled:
    """A compiled grammar at its start: its matcher, its first mask and that mask's CPU
    seconds, and the bytes it is charged (its text and the heap its compile allocated)."""

    matcher: llguidance.LLMatcher
    first_words: np.ndarray  # [1, words]
    first_mask_cpu_s: float
    num_bytes: int


@dataclass
class _CacheEntry:
    """A grammar compiling or compiled, cached under `key`: `started_s` is set by the worker
    when it starts (the deadline counts from then, not from the queue); `num_bytes` once it
    settled."""

    key: tuple[str, int | None]
    future: Future[_Compiled] = field(default_factory=Future)
    started_s: float | None = None
    num_bytes: int | None = None


@dataclass(frozen=True)
class _MaskResult:
    words: np.ndarray  # [1, words]
    cpu_s: float
    error: str | None


@dataclass
class _MaskJob:
    """One mask being computed on a worker: when it was started, and the worker's CPU clock
    when it began (so the core can read how much CPU it has used so far)."""

    future: Future[_MaskResult]
    submitted_s: float
    cpu_clock: tuple[int, float] | None = None  # (clock id, reading at start), by the worker


@dataclass
class _Grammar:
    """One queued request's grammar: its own matcher, its mask when ready, the mask job in
    flight, and how many of its masks were slow."""

    param: str | None
    matcher: llguidance.LLMatcher
    words: np.ndarray | None = None
    job: _MaskJob | None = None
    num_slow_masks: int = 0


class StructuredOutputManager:
    """Grammars of the core's requests, from compile to the request's end.

    `read_tokenizer` returns the model's tokenizer as llguidance reads it; it is called once,
    by `prepare` or else on the compile thread when the first grammar arrives. `vocab_size`
    is the model's (it may exceed the tokenizer's: the extra ids are never allowed). `config`
    holds the limits; `clock` gives seconds (deadlines). `release_heap`, if given, is called
    on the compile thread after each failed compile, once the compile's memory is freed (the
    engine core passes `engine.core.malloc_thresholds.release_free_heap`). Once compiles
    started, the compile thread alone touches the tokenizers.
    """

    def __init__(self, read_tokenizer: Callable[[], GrammarTokenizerSource], vocab_size: int, *,
                 config: StructuredOutputConfig | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 release_heap: Callable[[], object] | None = None) -> None:
        self._read_tokenizer = read_tokenizer
        self._release_heap = release_heap
        self.vocab_size = vocab_size
        self.config = StructuredOutputConfig() if config is None else config
        self._limits = compile_limits(self.config.max_grammar_bytes)
        self._clock = clock
        self._compile_pool = ThreadPoolExecutor(
            1, thread_name_prefix="grammar-compile", initializer=_lower_thread_priority)
        # Compiles waiting, in the tenants' turns: added to by the owner's thread, taken by the
        # compile thread, which gets one `_compile_next` call for each entry queued here.
        self._compile_queue: CompileQueue[_CacheEntry] = CompileQueue(_not_started)
        self._mask_pool = ThreadPoolExecutor(
            NUM_MASK_THREADS, thread_name_prefix="grammar-mask",
            initializer=_lower_thread_priority)
        self._tokenizer_source: GrammarTokenizerSource | None = None
        self._tokenizers: dict[int | None, llguidance.LLTokenizer] = {}
        self._cache: OrderedDict[tuple[str, int | None], _CacheEntry] = OrderedDict()
        self._unsettled: list[_CacheEntry] = []  # compiling, in the cache or not
        self._cached_bytes = 0
        self._compiling: dict[str, tuple[_CacheEntry, str | None]] = {}
        self._grammars: dict[str, _Grammar] = {}
        # Set by workers when a compile or mask ends, and by `wake`: `wait_for_work` ends then.
        # The futures' callback holds the event only, not the manager (no reference cycle).
        self._work_done = threading.Event()
        work_done = self._work_done
        self._work_done_callback: Callable[[Future[Any]], None] = lambda _: work_done.set()
        self.num_compiles = 0
        self.num_cache_hits = 0
        self.compile_time_s = 0.0
        self.mask_time_s = 0.0

    @property
    def num_compiling(self) -> int:
        return len(self._compiling)

    @property
    def request_ids(self) -> set[str]:
        """Requests with a compiled grammar (queued in the scheduler, until they finish)."""
        return set(self._grammars)

    @property
    def compiling_request_ids(self) -> set[str]:
        return set(self._compiling)

    @property
    def has_grammars(self) -> bool:
        """Whether any queued request has a grammar (steps without one skip all grammar work)."""
        return bool(self._grammars)

    @property
    def cached_bytes(self) -> int:
        """Bytes of the compiled grammars in the cache (as measured when they compiled)."""
        return self._cached_bytes

    def has_grammar(self, request_id: str) -> bool:
        return request_id in self._grammars

    def prepare(self, eos_token_id: int | None) -> None:
        """Builds, on the calling thread, the tokenizer of the grammars of requests whose EOS
        is `eos_token_id` (None: the tokenizer's own). Called through the core's
        `prepare_grammars` before any compile: building it holds the GIL for up to seconds,
        which on the compile thread, when the first grammar arrives, would stall the step
        loop. Requests with another EOS have theirs built on the compile thread (logged)."""
        self._tokenizer(eos_token_id)

    def submit(self, request_id: str, spec: StructuredOutputSpec,
               eos_token_id: int | None, tenant: str | None = None) -> None:
        """Queues `spec`'s compile for `request_id` (whose EOS the grammar allows at its end)
        in `tenant`'s turn, unless the cache has it; `pop_compiled` reports when it is done.
        A grammar still waiting for its compile joins this tenant's queue too, so that it
        starts in whichever of the two tenants' turns comes first."""
        if request_id in self._compiling or request_id in self._grammars:
            raise ValueError(f"request id {request_id!r} already has a grammar")
        key = (spec.grammar, eos_token_id)
        entry = self._cache.get(key)
        if entry is None:
            entry = self._cache[key] = _CacheEntry(key)
            entry.future.add_done_callback(self._work_done_callback)
            self._unsettled.append(entry)
            self.num_compiles += 1
            self._queue_compile(tenant, entry)
        else:
            self._cache.move_to_end(key)
            self.num_cache_hits += 1
            if _not_started(entry):
                self._queue_compile(tenant, entry)
        self._compiling[request_id] = (entry, spec.param)

    def _queue_compile(self, tenant: str | None, entry: _CacheEntry) -> None:
        """Queues `entry`'s compile in `tenant`'s turn, with a call of the compile thread to
        take the next one."""
        self._compile_queue.add(tenant, entry)
        self._compile_pool.submit(self._compile_next)

    def pop_compiled(self) -> list[CompileOutcome]:
        """The compiles that ended since the last call: a successful one's request has its
        grammar (with its first mask) ready; a failed one, or one past its deadline, is
        forgotten and its grammar not cached. Then settles the cache: compiles that finished
        with no request left are charged (or dropped if they failed), and the least recently
        used grammars are evicted while the cache holds more than its byte budget."""
        now_s = self._clock()
        limit_s = self.config.max_grammar_compile_s
        outcomes = []
        for request_id, (entry, param) in list(self._compiling.items()):
            if entry.future.done():
                exception = entry.future.exception()
                error = None if exception is None else short_error(exception)
            elif entry.started_s is not None and now_s - entry.started_s > limit_s:
                error = f"the grammar took longer than {limit_s:g} s to compile"
                self._drop(entry)
            else:
                continue
            del self._compiling[request_id]
            failure = None if error is None else self._failure(request_id, error, param)
            if failure is None:
                self._grammars[request_id] = self._first_grammar(entry.future.result(), param)
            outcomes.append(CompileOutcome(request_id, failure))
        self._settle_cache()
        return outcomes

    def wait_for_work(self, timeout_s: float) -> None:
        """Blocks until a compile or a mask in flight finishes, `wake` is called, or
        `timeout_s` passes (the core waits here when nothing else can run). Returns at once
        when nothing is in flight or something already finished, and may return early (the
        caller looks again)."""
        futures: list[Future[Any]] = [entry.future for entry, _ in self._compiling.values()]
        futures += [grammar.job.future for grammar in self._grammars.values()
                    if grammar.job is not None]
        if futures and not any(future.done() for future in futures) and \
                self._work_done.wait(timeout_s):
            self._work_done.clear()

    def wake(self) -> None:
        """Ends a `wait_for_work` in progress, or the next one, at once. Thread-safe: the
        core process's input thread calls it when a message arrives, so that a request or
        an abort does not wait behind another request's compile."""
        self._work_done.set()

    def await_masks(self) -> MaskRound:
        """Called before every step: waits, until at most the mask budget after they were
        started, for the masks in flight of grammars that were never slow, then collects what
        finished. Returns the requests whose mask is still not ready and forgets those whose
        grammar proved too slow."""
        budget_s = self.config.grammar_mask_budget_s
        jobs = [grammar.job for grammar in self._grammars.values()
                if grammar.job is not None and not grammar.num_slow_masks]
        if jobs:
            deadline_s = max(job.submitted_s for job in jobs) + budget_s
            fresh = [job.future for job in jobs if job.submitted_s + budget_s > self._clock()]
            if fresh:
                wait(fresh, timeout=max(0.0, deadline_s - self._clock()))
        failures = []
        for request_id, grammar in list(self._grammars.items()):
            error = self._collect_mask(grammar)
            if error is not None:
                if grammar.job is not None:
                    grammar.job.future.cancel()
                del self._grammars[request_id]
                failures.append(self._failure(request_id, error, grammar.param))
        held_back = frozenset(request_id for request_id, grammar in self._grammars.items()
                              if grammar.words is None)
        return MaskRound(held_back, tuple(failures))

    def bitmask(self, req_ids: Iterable[str]) -> GrammarBitmask | None:
        """The masks of those of `req_ids` that have a grammar (None when none has). Each
        must be ready: requests `await_masks` held back are never among them."""
        constrained = [req_id for req_id in req_ids if req_id in self._grammars]
        if not constrained:
            return None
        rows = []
        for req_id in constrained:
            words = self._grammars[req_id].words
            if words is None:
                raise RuntimeError(f"request {req_id!r} samples before its mask is ready")
            rows.append(words)
        return GrammarBitmask(constrained, np.concatenate(rows))

    def accept(self, request_id: str, token_ids: Sequence[int], *,
               finished: bool = False) -> GrammarFailure | None:
        """Advances the request's matcher by the tokens it produced, then starts its next mask
        (or, when the request `finished`, forgets it); the failure if the grammar rejects
        the tokens (the request is forgotten then), None when it accepts them or the request
        has no grammar."""
        grammar = self._grammars.get(request_id)
        if grammar is None:
            return None
        error = self._consume(request_id, grammar, token_ids)
        if error is not None or finished:
            del self._grammars[request_id]
        elif token_ids:
            self._start_mask(grammar)
        return None if error is None else self._failure(request_id, error, grammar.param)

    def _consume(self, request_id: str, grammar: _Grammar,
                 token_ids: Sequence[int]) -> str | None:
        matcher = grammar.matcher
        if token_ids and grammar.job is not None:
            raise RuntimeError(f"request {request_id!r} produced tokens before its mask")
        for token_id in token_ids:
            if matcher.is_stopped():
                return None  # the grammar is complete: what follows is the EOS that ends it
            if not matcher.consume_token(token_id):
                return short_error(
                    f"the output left its grammar: {matcher.get_error() or 'rejected'}")
        return None

    def remove(self, request_ids: Iterable[str]) -> None:
        """Forgets finished or aborted requests: a mask in flight is dropped (cancelled if it
        has not started), and so is a compile no other request waits for that has not
        started (one that has finishes into the cache)."""
        for request_id in request_ids:
            grammar = self._grammars.pop(request_id, None)
            if grammar is not None and grammar.job is not None:
                grammar.job.future.cancel()
            compiling = self._compiling.pop(request_id, None)
            if compiling is not None:
                entry = compiling[0]
                waited_for = any(other is entry for other, _ in self._compiling.values())
                if not waited_for and entry.future.cancel():
                    self._drop(entry)

    def shutdown(self) -> None:
        for entry in self._compile_queue.clear():
            entry.future.cancel()
        self._compile_pool.shutdown(wait=False, cancel_futures=True)
        self._mask_pool.shutdown(wait=False, cancel_futures=True)

    # The cache.
    def _first_grammar(self, compiled: _Compiled, param: str | None) -> _Grammar:
        """A request's own copy of a compiled grammar, with the first mask its compile
        computed (a grammar slow from that mask is never waited for)."""
        slow = compiled.first_mask_cpu_s > self.config.grammar_mask_budget_s
        return _Grammar(param, matcher=compiled.matcher.deep_copy(), words=compiled.first_words,
                        num_slow_masks=int(slow))

    def _settle_cache(self) -> None:
        """Charges the compiles that finished (dropping failed ones), then evicts the least
        recently used grammars while the cache holds more than its budget (requests keep
        their own matchers). Does nothing while no compile finished."""
        if not any(entry.future.done() for entry in self._unsettled):
            return
        finished = [entry for entry in self._unsettled if entry.future.done()]
        self._unsettled = [entry for entry in self._unsettled if not entry.future.done()]
        for entry in finished:
            if self._cache.get(entry.key) is not entry:
                continue  # dropped meanwhile
            if entry.future.cancelled() or entry.future.exception() is not None:
                del self._cache[entry.key]
                continue
            entry.num_bytes = entry.future.result().num_bytes
            self._cached_bytes += entry.num_bytes
        while self._cached_bytes > self.config.grammar_cache_bytes:
            oldest = next(entry for entry in self._cache.values() if entry.num_bytes is not None)
            self._drop(oldest)

    def _drop(self, entry: _CacheEntry) -> None:
        if self._cache.get(entry.key) is entry:
            del self._cache[entry.key]
            self._cached_bytes -= entry.num_bytes or 0

    def _failure(self, request_id: str, error: str, param: str | None) -> GrammarFailure:
        return GrammarFailure(request_id, f"{param}: {error}" if param else error, param)

    # Masks.
    def _start_mask(self, grammar: _Grammar) -> None:
        grammar.words = None
        job = _MaskJob(Future(), self._clock())
        job.future = self._mask_pool.submit(self._compute_mask, grammar.matcher, job)
        job.future.add_done_callback(self._work_done_callback)
        grammar.job = job

    def _collect_mask(self, grammar: _Grammar) -> str | None:
        """Takes a finished mask into `grammar`; the error that ends the request, if its
        grammar failed or is too slow."""
        job = grammar.job
        if job is None:
            return None
        budget_s = self.config.grammar_mask_budget_s
        if not job.future.done():
            used_s = _cpu_used_s(job)
            return self._too_slow if used_s > MAX_SLOW_MASKS * budget_s else None
        grammar.job = None
        try:
            result = job.future.result()
        except Exception as error:  # a worker's failure ends its request only
            return short_error(f"the grammar failed: {error}")
        self.mask_time_s += result.cpu_s
        if result.error is not None:
            return result.error
        grammar.words = result.words
        if result.cpu_s > budget_s:
            grammar.num_slow_masks += 1
            if grammar.num_slow_masks >= MAX_SLOW_MASKS:
                return self._too_slow
        return None

    @property
    def _too_large(self) -> str:
        return (f"the grammar is too large: compiling it takes more than the limit of "
                f"{self.config.max_grammar_bytes / 2**20:g} MiB")

    @property
    def _too_slow(self) -> str:
        budget_ms = self.config.grammar_mask_budget_s * 1e3
        return (f"the grammar is too slow: computing its allowed tokens took over "
                f"{budget_ms:g} ms of CPU {MAX_SLOW_MASKS} times, or over "
                f"{MAX_SLOW_MASKS * budget_ms:g} ms once")

    # Worker threads.
    def _compute_mask(self, matcher: llguidance.LLMatcher, job: _MaskJob) -> _MaskResult:
        started_cpu_s = time.thread_time()
        clock_id = time.pthread_getcpuclockid(threading.get_ident())
        job.cpu_clock = (clock_id, time.clock_gettime(clock_id))
        words = llguidance.numpy.allocate_token_bitmask(1, self.vocab_size)
        llguidance.numpy.fill_next_token_bitmask(matcher, words, 0)
        error = (short_error(f"the grammar failed: {matcher.get_error()}") if matcher.is_error()
                 else None)
        return _MaskResult(words, time.thread_time() - started_cpu_s, error)

    def _compile_next(self) -> None:
        """Compiles the next grammar in the tenants' turns into its entry's future (on the
        compile thread); nothing when none waits (the entries queued more than once, or
        cancelled, leave the pool more calls than compiles)."""
        while (entry := self._compile_queue.take()) is not None:
            if entry.future.set_running_or_notify_cancel():
                break
        else:
            return
        grammar, eos_token_id = entry.key
        failure = None
        try:
            compiled = self._compile(grammar, eos_token_id, entry)
        except BaseException as error:  # the request's failure, reported by `pop_compiled`
            # A new error, without the traceback whose frames hold the compile's matcher
            # (and this entry, whose future would hold the traceback: a cycle that only the
            # collector frees): the matcher is freed when this block ends.
            failure = GrammarCompileError(short_error(error))
        if failure is None:
            entry.future.set_result(compiled)
            return
        if self._release_heap is not None:
            self._release_heap()
        entry.future.set_exception(failure)

    def _compile(self, grammar: str, eos_token_id: int | None,
                 entry: _CacheEntry) -> _Compiled:
        started_s = time.perf_counter()
        tokenizer = self._tokenizer(eos_token_id)
        entry.started_s = self._clock()
        heap_before = allocated_bytes()
        try:
            matcher, first_words, first_mask_cpu_s = compile_grammar(tokenizer, grammar,
                                                                     self._limits)
        except LexerLimitError:
            raise ValueError(self._too_large) from None
        heap_after = allocated_bytes()
        heap_bytes = 0 if heap_before is None or heap_after is None else heap_after - heap_before
        num_bytes = len(grammar) + max(0, heap_bytes)
        self.compile_time_s += time.perf_counter() - started_s
        limit = self.config.max_grammar_bytes
        if num_bytes > limit:
            raise ValueError(f"the grammar is too large: compiling it took "
                             f"{num_bytes / 2**20:.0f} MiB, over the limit of "
                             f"{limit / 2**20:g} MiB")
        if first_mask_cpu_s > MAX_SLOW_MASKS * self.config.grammar_mask_budget_s:
            raise ValueError(self._too_slow)
        return _Compiled(matcher, first_words, first_mask_cpu_s, num_bytes)

    def _source(self) -> GrammarTokenizerSource:
        if self._tokenizer_source is None:
            self._tokenizer_source = self._read_tokenizer()
        return self._tokenizer_source

    def _tokenizer(self, eos_token_id: int | None) -> llguidance.LLTokenizer:
        """The tokenizer whose EOS is `eos_token_id` (None: the tokenizer's own)."""
        source = self._source()
        eos = source.eos_token_id if eos_token_id is None else eos_token_id
        tokenizer = self._tokenizers.get(eos)
        if tokenizer is None:
            if self._tokenizers:
                logger.warning("building the grammars' tokenizer for EOS %s beside the step "
                               "loop (prepared for EOS %s)", eos, ", ".join(
                                   str(prepared) for prepared in self._tokenizers))
            tokenizer = llguidance.LLTokenizer(source.tokenizer_json, n_vocab=self.vocab_size,
                                               eos_token=eos)
            self._tokenizers[eos] = tokenizer
        return tokenizer


# What llguidance's errors say when the lexer's limits stopped a compile (its fuel, its
# states), rather than the grammar being wrong.
_LIMIT_ERRORS = ("too big", "fuel", "too many expressions", "too many states")


class GrammarCompileError(ValueError):
    """A compile that failed, as its request's error: one line, no traceback."""


class LexerLimitError(ValueError):
    """A compile that llguidance's lexer limits stopped (it ran out of fuel or states)."""


def compile_limits(max_grammar_bytes: int | None = None) -> llguidance.LLParserLimits:
    """llguidance's limits for a compile: the lexer fuel that `max_grammar_bytes` buys at
    `LEXER_BYTES_PER_FUEL` (None: llguidance's default fuel), and errors without the
    parser's state and the grammar after their first line (the tokens so far, the request's
    schema), so that a client gets the first line only."""
    if max_grammar_bytes is None:
        return llguidance.LLParserLimits(verbose_errors=False)
    fuel = max(1, max_grammar_bytes // LEXER_BYTES_PER_FUEL)
    return llguidance.LLParserLimits(initial_lexer_fuel=fuel, verbose_errors=False)


_DEFAULT_LIMITS = compile_limits()


def _not_started(entry: _CacheEntry) -> bool:
    """Whether the entry's compile still waits: neither started, finished nor cancelled."""
    return not (entry.future.running() or entry.future.done())


def compile_grammar(tokenizer: llguidance.LLTokenizer, grammar: str,
                    limits: llguidance.LLParserLimits | None = None
                    ) -> tuple[llguidance.LLMatcher, np.ndarray, float]:
    """A matcher at the grammar's start, its first mask (computed now: the lexer and the
    parser's tables are built then, not in the step that first samples), and the CPU seconds
    of that first mask. `limits` default to `compile_limits()`. ValueError for a wrong
    grammar; `LexerLimitError` when the lexer's limits stopped the compile. llguidance
    reports a lexer that ran out of fuel building the first mask (and a parser over its
    items) only at the next token: a copy of the matcher takes the first token the mask
    allows, so that such a grammar fails here rather than in a step."""
    check_schema_ranges(grammar)  # one llguidance would crash on: a request's error here
    matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0,
                                   limits=_DEFAULT_LIMITS if limits is None else limits)
    _raise_error(matcher.get_error())
    words = llguidance.numpy.allocate_token_bitmask(1, tokenizer.vocab_size)
    started_cpu_s = time.thread_time()
    llguidance.numpy.fill_next_token_bitmask(matcher, words, 0)
    first_mask_cpu_s = time.thread_time() - started_cpu_s
    _raise_error(matcher.get_error() if matcher.is_error() else "")
    first_token = _first_allowed_token(words, tokenizer)
    if first_token is not None:
        probe = matcher.deep_copy()
        if not probe.consume_token(first_token):
            _raise_error(probe.get_error() or "the grammar stopped at its first token")
    return matcher, words, first_mask_cpu_s


def _raise_error(error: str) -> None:
    if not error:
        return
    if any(marker in error for marker in _LIMIT_ERRORS):
        raise LexerLimitError(error)
    raise ValueError(f"invalid grammar: {error}")


def _first_allowed_token(words: np.ndarray, tokenizer: llguidance.LLTokenizer) -> int | None:
    """The lowest token the mask `words` allows other than an EOS (None: none is)."""
    bits = np.unpackbits(words.view(np.uint8), bitorder="little")[:tokenizer.vocab_size]
    bits[[eos for eos in tokenizer.eos_tokens if eos < bits.size]] = 0
    allowed = np.flatnonzero(bits)
    return int(allowed[0]) if allowed.size else None


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


def _load_mallinfo2() -> Callable[[], _MallInfo2] | None:
    try:
        function = ctypes.CDLL(None).mallinfo2
    except (OSError, AttributeError):  # not glibc 2.33+
        return None
    function.restype = _MallInfo2
    return function  # type: ignore[no-any-return]


_MALLINFO2 = _load_mallinfo2()


def allocated_bytes() -> int | None:
    """Bytes the C heap has handed out (llguidance allocates there), or None where the C
    library cannot say."""
    if _MALLINFO2 is None:
        return None
    info = _MALLINFO2()
    return int(info.uordblks + info.hblkhd)


def _cpu_used_s(job: _MaskJob) -> float:
    """CPU seconds the job in flight has used so far (0 before a worker took it)."""
    if job.cpu_clock is None:
        return 0.0
    clock_id, started_s = job.cpu_clock
    try:
        return time.clock_gettime(clock_id) - started_s
    except OSError:  # the worker thread ended
        return 0.0


def _lower_thread_priority() -> None:
    """Worker threads yield most of the CPU to the step loop when both want it (Linux sets
    niceness per thread); not all of it, so that grammars still make progress on a machine
    the step loop keeps busy."""
    with contextlib.suppress(AttributeError, OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WORKER_NICENESS)
