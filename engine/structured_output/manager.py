"""The engine core's side of structured outputs: compiling grammars and stepping matchers.

Owned by the `EngineCore` (one thread calls it). A request with a grammar is compiled on a
worker thread before it is queued (`submit`, then `pop_compiled`), so compiling never holds up
the step loop; a grammar is compiled once per distinct (grammar, EOS) and kept in a bounded
LRU cache (a second request for a grammar still compiling waits for the same compile), and
each request gets a copy of the compiled matcher. Each step, `bitmask` computes
the allowed tokens of the requests that sample (on llguidance's own thread pool when the batch
is large enough to gain from it) and `accept` advances their matchers by the tokens they
produced.

Torch-free: masks are numpy int32 words, bit `i % 32` of word `i // 32` allowing token `i`.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

import llguidance
import llguidance.numpy

from engine.structured_output.bitmask import GrammarBitmask
from engine.structured_output.spec import StructuredOutputSpec

MAX_CACHED_GRAMMARS = 256
NUM_COMPILE_THREADS = 2
# Rows x vocabulary from which masks are filled on llguidance's thread pool: below it, handing
# rows to the pool costs more than it saves (measured: 32 rows of the 272-token `tiny`
# vocabulary fill in 0.4 ms one by one, 1.5 ms on the pool, on 2 cores).
PARALLEL_FILL_MIN_TOKENS = 1 << 20


@dataclass(frozen=True)
class CompileOutcome:
    """A grammar compile that finished: `error` is None when the request may be queued."""

    request_id: str
    error: str | None


class StructuredOutputManager:
    """Grammars of the core's requests, from compile to the request's end.

    `load_tokenizer` returns the Hugging Face tokenizer of the model; it is called once, on a
    compile thread, when the first grammar arrives. `vocab_size` is the model's (it may exceed
    the tokenizer's: the extra ids are never allowed).
    """

    def __init__(self, load_tokenizer: Callable[[], Any], vocab_size: int, *,
                 max_cached_grammars: int = MAX_CACHED_GRAMMARS,
                 num_compile_threads: int = NUM_COMPILE_THREADS) -> None:
        self._load_tokenizer = load_tokenizer
        self.vocab_size = vocab_size
        self.max_cached_grammars = max_cached_grammars
        self._pool = ThreadPoolExecutor(num_compile_threads, thread_name_prefix="grammar")
        self._tokenizer_lock = threading.Lock()  # compile threads share tokenizers and stats
        self._hf_tokenizer: Any = None
        self._tokenizers: dict[int | None, llguidance.LLTokenizer] = {}
        self._compiled: OrderedDict[tuple[str, int | None], Future[llguidance.LLMatcher]] = (
            OrderedDict())
        self._compiling: dict[str, Future[llguidance.LLMatcher]] = {}
        self._matchers: dict[str, llguidance.LLMatcher] = {}
        self._executor: llguidance.LLExecutor | None = None
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
        return set(self._matchers)

    @property
    def compiling_request_ids(self) -> set[str]:
        return set(self._compiling)

    @property
    def has_grammars(self) -> bool:
        """Whether any queued request has a grammar (steps without one skip all grammar work)."""
        return bool(self._matchers)

    def has_grammar(self, request_id: str) -> bool:
        return request_id in self._matchers

    def submit(self, request_id: str, spec: StructuredOutputSpec,
               eos_token_id: int | None) -> None:
        """Starts compiling `spec` for `request_id` (whose EOS the grammar allows at its end);
        `pop_compiled` reports when it is done."""
        if request_id in self._compiling or request_id in self._matchers:
            raise ValueError(f"request id {request_id!r} already has a grammar")
        key = (spec.grammar, eos_token_id)
        compiled = self._compiled.get(key)
        if compiled is None:
            compiled = self._pool.submit(self._compile, spec.grammar, eos_token_id)
            self._compiled[key] = compiled
            self.num_compiles += 1
            while len(self._compiled) > self.max_cached_grammars:
                self._compiled.popitem(last=False)
        else:
            self._compiled.move_to_end(key)
            self.num_cache_hits += 1
        self._compiling[request_id] = compiled

    def pop_compiled(self) -> list[CompileOutcome]:
        """The compiles that finished since the last call; a successful one's matcher is ready
        for `bitmask`, a failed one is forgotten."""
        outcomes = []
        for request_id, future in list(self._compiling.items()):
            if not future.done():
                continue
            del self._compiling[request_id]
            error = future.exception()
            if error is None:
                self._matchers[request_id] = future.result().deep_copy()
            outcomes.append(CompileOutcome(request_id, None if error is None else str(error)))
        return outcomes

    def wait_for_compile(self, timeout_s: float) -> None:
        """Blocks until a compile finishes or `timeout_s` passes (the core waits here when
        nothing else can run)."""
        if self._compiling:
            wait(list(self._compiling.values()), timeout=timeout_s, return_when=FIRST_COMPLETED)

    def bitmask(self, req_ids: Iterable[str]) -> GrammarBitmask | None:
        """The masks of those of `req_ids` that have a grammar (None when none has)."""
        constrained = [req_id for req_id in req_ids if req_id in self._matchers]
        if not constrained:
            return None
        started_s = time.perf_counter()
        words = llguidance.numpy.allocate_token_bitmask(len(constrained), self.vocab_size)
        rows = [(self._matchers[req_id], row) for row, req_id in enumerate(constrained)]
        if len(rows) * self.vocab_size >= PARALLEL_FILL_MIN_TOKENS:
            if self._executor is None:
                self._executor = llguidance.LLExecutor()
            llguidance.numpy.fill_next_token_bitmask_par(self._executor, rows, words)
        else:  # straight to each row's memory: the checked wrapper costs as much as a mask
            address, row_bytes = words.ctypes.data, words.shape[1] * words.itemsize
            for matcher, row in rows:
                matcher.unsafe_compute_mask_ptr(address + row * row_bytes, row_bytes)
        self.mask_time_s += time.perf_counter() - started_s
        return GrammarBitmask(constrained, words)

    def accept(self, request_id: str, token_ids: Sequence[int]) -> str | None:
        """Advances the request's matcher by the tokens it produced; returns an error message
        if the grammar rejects them (None when it accepts, or the request has no grammar)."""
        matcher = self._matchers.get(request_id)
        if matcher is None:
            return None
        for token_id in token_ids:
            if matcher.is_stopped():
                return None  # the grammar is complete: what follows is the EOS that ends it
            if not matcher.consume_token(token_id):
                return f"the output left its grammar: {matcher.get_error() or 'rejected'}"
        return None

    def remove(self, request_ids: Iterable[str]) -> None:
        """Forgets finished or aborted requests (a compile in flight finishes into the
        cache)."""
        for request_id in request_ids:
            self._matchers.pop(request_id, None)
            self._compiling.pop(request_id, None)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    # Compile threads.
    def _compile(self, grammar: str, eos_token_id: int | None) -> llguidance.LLMatcher:
        started_s = time.perf_counter()
        with self._tokenizer_lock:
            tokenizer = self._tokenizer(eos_token_id)
        compiled = compile_grammar(tokenizer, grammar)
        with self._tokenizer_lock:
            self.compile_time_s += time.perf_counter() - started_s
        return compiled

    def _tokenizer(self, eos_token_id: int | None) -> llguidance.LLTokenizer:
        tokenizer = self._tokenizers.get(eos_token_id)
        if tokenizer is None:
            import llguidance.hf  # imports transformers: only once a grammar arrives

            if self._hf_tokenizer is None:
                self._hf_tokenizer = self._load_tokenizer()
            tokenizer = llguidance.hf.from_tokenizer(
                self._hf_tokenizer, n_vocab=self.vocab_size, eos_token=eos_token_id)
            self._tokenizers[eos_token_id] = tokenizer
        return tokenizer


def compile_grammar(tokenizer: llguidance.LLTokenizer, grammar: str) -> llguidance.LLMatcher:
    """A matcher at the grammar's start, its first mask computed (the lexer and the parser's
    tables are built then, not in the step that first samples)."""
    matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
    error = matcher.get_error()
    if error:
        raise ValueError(f"invalid grammar: {error}")
    words = llguidance.numpy.allocate_token_bitmask(1, tokenizer.vocab_size)
    llguidance.numpy.fill_next_token_bitmask(matcher, words, 0)
    if matcher.is_error():
        raise ValueError(f"invalid grammar: {matcher.get_error()}")
    return matcher
