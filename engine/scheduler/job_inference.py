"""Job inference: the job of a request whose client named none, read from its prompt.

Most agent clients send no job id, yet each turn of their conversation re-sends the previous
turn's prompt and output followed by something new (a tool result, a user message). The
scheduler therefore remembers recently finished turns of inferred jobs and, when a request
without a job arrives, gives it the job of the turn its prompt continues; a request that
continues nothing starts a new inferred job, so that its own end can be continued in turn.

Owned by the `Scheduler` (absent when `SchedulerConfig.job_inference` is off), which calls
`infer` from `add_request`, `turn_finished` from its finishing path, `sweep` at every step
start and in its idle sweep, and ends (`Scheduler.end_job`, reason JOB_END) every job those
return; `forget` from `end_job`, for a job ended otherwise. Times are seconds on the
scheduler's clock.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import re
import unicodedata
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

from engine.kv_cache.hashing import BlockHash, extend_block_hashes
from engine.request import (
    INFERRED_JOB_ID_PREFIX,
    JobInfo,
    Request,
    RequestStatus,
    is_inferred_job_id,
)

_K = TypeVar("_K")

# A finished turn keeps the text of its first output tokens, up to this many of them; a
# continuation's text is read over this many tokens after the turn's prompt (room for a
# client's preamble before the answer it re-sends), and over this many before it.
OUTPUT_TEXT_TOKENS = 64
CONTINUATION_TEXT_TOKENS = 256
PROMPT_TEXT_TOKENS = 64
# Texts are compared by their runs of this many characters (their n-grams).
TEXT_GRAM_CHARS = 4
# At most this many finished turns share a prompt (its last full block's hash) or a request
# id, the oldest dropped first, so that a lookup costs the same however many requests sent one
# prompt (docs/decisions/0014-job-inference-limits.md).
MAX_TURNS_PER_KEY = 16
_WHITESPACE = re.compile(r"\s+")
# Markup tags, the text of most special tokens (`<|im_end|>`, `<tool_call>`, `</think>`).
_TAGS = re.compile(r"<\|[^<>|\s]{0,64}\|>|</?[A-Za-z_][\w.-]{0,64}>")
_REPLACEMENT_CHARS = re.compile("\ufffd+")


@dataclass(frozen=True, slots=True)
class InferredJob:
    """The job inference gave a request that named none: `job` (marked inferred) and the
    finished request whose turn it continues (None: the request starts a new job)."""

    job: JobInfo
    continues_request_id: str | None


@dataclass(frozen=True, slots=True)
class _FinishedTurn:
    """What a later prompt is matched against: the turn's tenant, the chained hash of the last
    full block of its prompt, the prompt's tokens after that block, its length in tokens, the
    first tokens of its output (at most a block of them) and, with a decoder, the normalised
    text of its first `OUTPUT_TEXT_TOKENS` output tokens (`normalized_text`)."""

    job_id: str
    request_id: str
    tenant: str | None
    key_hash: BlockHash
    prompt_tail: tuple[int, ...]
    num_prompt_tokens: int
    output_head: tuple[int, ...]
    finished_at_s: float
    output_text: str | None = None
    kept_s: float = 0.0  # how long it is remembered, beyond `max_age_s` (its client's pin)

    def expires_at_s(self, max_age_s: float) -> float:
        return self.finished_at_s + max(max_age_s, self.kept_s)


class JobInference:
    """The table of recently finished turns of inferred jobs, and the rule that matches them.

    **The rule.** A request without a job continues a finished turn when its prompt begins
    with that turn's whole prompt and is longer than it. The prompt's full blocks are compared
    by their chained block hashes (`Request.block_hashes`, the prefix cache's own, salted with
    the request's `cache_salt`; a turn of another tenant never matches, even where tenants
    share the cache) and the tokens after the last full block one by one. Requiring the whole
    previous prompt, its generation prompt included, is what keeps a new conversation that
    merely shares a system prompt or a first message from joining. A turn whose prompt fills
    no block cannot be matched and is not remembered.

    **Which turn.** A request whose client re-sent a tool call that a finished turn issued
    (`Request.continues_request_id`, read by the frontend from the call's id) continues that
    turn when the rule above holds for it. Otherwise the matching turns with the longest
    prompt are candidates, and the turn's output decides between them: a chat client
    re-renders the output through the chat template (tool calls re-serialised, whitespace
    moved), so it is not required to come back whole.

    With `decode` (token ids to text) the match is on text, which survives what token ids do
    not: a byte-level tokenizer's output that is not valid UTF-8 comes back as U+FFFD,
    special tokens the client never saw are missing from what it sends, and clients that
    rewrite an answer ("Thought: ... Answer: ...") still send its text. A candidate's output
    text (what its client received: without the stop token that ended it) and the text the
    request has after the candidates' prompt are normalised (whitespace runs as one space,
    runs of U+FFFD as one, NFC, markup tags such as special tokens' left out) and compared by
    their runs of `TEXT_GRAM_CHARS` characters, less those the end of the candidates' prompt
    also holds (the chat template's text and words of the question tell no candidate
    apart). Of the candidates with any run in the request's text, the one with
    the largest share of its runs there wins, then the one with the most; a candidate whose
    output was empty wins only when no candidate has any. Without `decode`, the candidate
    whose first output tokens (up to a block of them) the request repeats furthest wins.

    A tie between candidates with the same output (runs of one conversation that answered
    alike) goes to the one that finished last, since a run that goes on sends its next turn
    soon after its own turn finished while a finished run's last turn stays in the table;
    of turns that finished in one step, to the first filed (they are filed, and their
    clients answered, in the order they were admitted). A tie between candidates whose outputs
    differ (rollouts the request's text cannot tell apart) is ambiguous: the request starts
    a new job rather than join one of theirs, whose pins and order it might take.

    **One continuation per turn.** A match takes the turn out of the table, so an inferred job
    has at most one unfinished turn. If that turn is aborted, the turn it continued goes back
    in (as of the abort) so that a retry joins the job again.

    **Bounds.** At most `max_turns` turns, each for at most `max_age_s`, or as long as the
    client's pin of it lasts (a cache breakpoint of an hour on an inferred job:
    `turn_finished`'s `kept_s`): a sweep drops older ones (and a lookup skips them); at most
    `MAX_TURNS_PER_KEY` of them under one prompt or one request id (the oldest dropped), so
    that a lookup checks a bounded number of candidates; a full table drops the oldest turn
    of the tenant that holds the most, so that one tenant's flood of requests never pushes
    another tenant's turns out while it holds more of the table (with one tenant: the
    oldest). The job of a dropped turn has no unfinished turn and can never be continued, so
    it ends (its pin, if any, is released and the policy forgets it), as does a job left with
    nothing to continue (its first turn was aborted, or its finished prompt filled no block).
    The scheduler caps a policy's pin of an inferred job's turn at `max_age_s` (`pin_ttl_s`),
    since no later turn could take it over. A request that continues nothing therefore costs
    a table entry of about two blocks' worth of token ids and policy books until its turn
    leaves the table, and holds KV only where the policy would pin an explicit job's turn
    (shipped policies pin only turns that called a tool) or its client asked to.
    """

    def __init__(self, block_size: int, *, max_turns: int, max_age_s: float,
                 decode: Callable[[Sequence[int]], str] | None = None) -> None:
        if max_turns <= 0:
            raise ValueError(f"max_turns must be positive, got {max_turns!r}")
        if not max_age_s > 0:
            raise ValueError(f"max_age_s must be positive, got {max_age_s!r}")
        self.block_size = block_size
        self.max_turns = max_turns
        self.max_age_s = max_age_s
        self._decode = decode
        self._turns: OrderedDict[str, _FinishedTurn] = OrderedDict()  # by job id, oldest first
        # The same turns by tenant, each tenant's oldest first (a tenant with none is absent).
        self._turns_by_tenant: dict[str | None, OrderedDict[str, None]] = {}
        self._job_ids_by_key: dict[BlockHash, list[str]] = {}
        # Clients may reuse a request id: the jobs of the turns filed under it, oldest first.
        self._job_ids_by_request_id: dict[str, list[str]] = {}
        self._continued: dict[str, _FinishedTurn] = {}  # by the unfinished continuing request
        # (expiry, filing rank, job id, turn) of the turns filed, soonest first; entries of
        # turns gone stay until popped (or the heap is rebuilt).
        self._expiries: list[tuple[float, int, str, _FinishedTurn]] = []
        self._num_filed = itertools.count()
        self._new_job_ids = itertools.count()

    def __len__(self) -> int:
        """Finished turns in the table."""
        return len(self._turns)

    @property
    def matches_text(self) -> bool:
        """Whether candidates are told apart by their output's text (a decoder was given)."""
        return self._decode is not None

    def infer(self, request: Request, now_s: float) -> InferredJob:
        """The job of `request` (which names none): the job of the finished turn it continues,
        taken out of the table, else a new inferred job with an id no client can send (its
        tenant's name and `/` first, as the server names a tenant's jobs)."""
        hashes = extend_block_hashes(request, self.block_size)
        turn = self._named_turn(request, hashes, now_s) or self._match(request, hashes, now_s)
        if turn is None:
            tenant = "" if request.tenant is None else f"{request.tenant}/"
            job_id = (f"{tenant}{INFERRED_JOB_ID_PREFIX}{next(self._new_job_ids)}/"
                      f"{request.request_id}")
            return InferredJob(JobInfo(job_id=job_id, inferred=True), None)
        self._remove(turn)
        self._continued[request.request_id] = turn
        return InferredJob(JobInfo(job_id=turn.job_id, inferred=True), turn.request_id)

    def turn_finished(self, request: Request, now_s: float, *, kept_s: float = 0.0
                      ) -> list[str]:
        """`request`, a turn of an inferred job, finished: remembers it, for `max_age_s` or
        `kept_s` if longer (or, aborted, puts back the turn it continued). Returns the ids of
        the jobs that ended, oldest first."""
        if request.job is None or not request.job.inferred:
            raise ValueError(f"{request} is not a turn of an inferred job")
        continued = self._continued.pop(request.request_id, None)
        if request.status is RequestStatus.FINISHED_ABORTED:
            if continued is None:
                return [request.job.job_id]
            return self._add(dataclasses.replace(continued, finished_at_s=now_s))
        num_full_blocks = request.num_prompt_tokens // self.block_size
        if num_full_blocks == 0:
            return [request.job.job_id]
        hashes = extend_block_hashes(request, self.block_size)
        turn = _FinishedTurn(
            job_id=request.job.job_id, request_id=request.request_id, tenant=request.tenant,
            key_hash=hashes[num_full_blocks - 1],
            prompt_tail=tuple(request.all_token_ids[num_full_blocks * self.block_size:
                                                    request.num_prompt_tokens]),
            num_prompt_tokens=request.num_prompt_tokens,
            output_head=tuple(request.all_token_ids[request.num_prompt_tokens:
                                                    request.num_prompt_tokens + self.block_size]),
            finished_at_s=now_s,
            output_text=self._text(request.all_token_ids, request.num_prompt_tokens,
                                   min(OUTPUT_TEXT_TOKENS, _num_visible_output_tokens(request))),
            kept_s=kept_s,
        )
        return self._add(turn)

    def sweep(self, now_s: float) -> list[str]:
        """Drops the turns past their time (`max_age_s`, or their `kept_s`); returns their
        jobs' ids, which ended."""
        ended = []
        expiries = self._expiries
        while expiries and expiries[0][0] < now_s:
            _, _, job_id, turn = heapq.heappop(expiries)
            if self._turns.get(job_id) is turn and self._is_stale(turn, now_s):
                self._remove(turn)
                ended.append(job_id)
        return ended

    def forget(self, job_id: str) -> None:
        """Drops the job's finished turn, if the table holds one: the job was ended from
        outside (`DELETE /v1/jobs/...`), so no later request continues it."""
        turn = self._turns.get(job_id)
        if turn is not None:
            self._remove(turn)

    def pin_ttl_s(self, ttl_s: float) -> float:
        """The TTL of a policy's pin of an inferred job's turn: at most `max_age_s`, after
        which the turn can no longer be continued (a client's pin keeps its turn as long as
        itself instead: `turn_finished`'s `kept_s`)."""
        return min(ttl_s, self.max_age_s)

    # The table.
    def _named_turn(self, request: Request, hashes: list[BlockHash], now_s: float
                    ) -> _FinishedTurn | None:
        """The latest turn filed under `request.continues_request_id` that `request`
        continues, if any."""
        if request.continues_request_id is None:
            return None
        for job_id in reversed(self._job_ids_by_request_id.get(request.continues_request_id, ())):
            turn = self._turns[job_id]
            key_index = turn.num_prompt_tokens // self.block_size - 1
            if (key_index < len(hashes) and hashes[key_index] == turn.key_hash
                    and self._continues(request, turn, now_s)):
                return turn
        return None

    def _match(self, request: Request, hashes: list[BlockHash], now_s: float
               ) -> _FinishedTurn | None:
        """The turn `request` continues by the rule (None: none, or an ambiguous tie)."""
        for index in range(len(hashes) - 1, -1, -1):
            candidates = [self._turns[job_id]
                          for job_id in self._job_ids_by_key.get(hashes[index], ())]
            candidates = [turn for turn in candidates if self._continues(request, turn, now_s)]
            if candidates:
                return self._decide(request, candidates)
        return None

    def _decide(self, request: Request, candidates: list[_FinishedTurn]) -> _FinishedTurn | None:
        """Among turns `request` continues (in the order they were filed): the one with the
        longest prompt, then the one whose output it repeats furthest (by text with a
        decoder, else by tokens); of turns that tie with the same output, the one finished
        last (the first filed of those); None when turns with different outputs tie."""
        longest = max(turn.num_prompt_tokens for turn in candidates)
        candidates = [turn for turn in candidates if turn.num_prompt_tokens == longest]
        if len(candidates) == 1:
            return candidates[0]
        num_continued = min(CONTINUATION_TEXT_TOKENS, request.num_prompt_tokens - longest)
        continuation = self._text(request.all_token_ids, longest, num_continued)
        scores: list[tuple[bool, float, int]] | list[int]
        prompt_end = self._text(request.all_token_ids, max(0, longest - PROMPT_TEXT_TOKENS),
                                min(longest, PROMPT_TEXT_TOKENS))
        if (continuation is not None and prompt_end is not None
                and all(turn.output_text is not None for turn in candidates)):
            grams = _grams(continuation)
            common = _grams(prompt_end)
            scores = [_text_score(turn.output_text or "", continuation, grams, common)
                      for turn in candidates]
        else:
            scores = [_num_repeated(request, turn) for turn in candidates]
        best = max(scores)
        tied = [turn for turn, score in zip(candidates, scores, strict=True) if score == best]
        by_text = all(turn.output_text is not None for turn in tied)
        if len({turn.output_text if by_text else turn.output_head for turn in tied}) > 1:
            return None  # rollouts that answered differently, told apart by nothing
        return max(tied, key=lambda turn: turn.finished_at_s)  # the first filed of the latest

    def _text(self, token_ids: Sequence[int], start: int, max_tokens: int) -> str | None:
        """The normalised text of up to `max_tokens` of `token_ids` from `start` (None
        without a decoder, or when it fails: the turn is then told apart by token ids)."""
        if self._decode is None:
            return None
        try:
            return normalized_text(self._decode(token_ids[start:start + max_tokens]))
        except Exception:  # a tokenizer that cannot decode these ids leaves them to tokens
            return None

    def _continues(self, request: Request, turn: _FinishedTurn, now_s: float) -> bool:
        """Whether `request`'s prompt, whose full blocks up to `turn`'s key already match,
        also holds `turn`'s prompt tail and goes on past it (and `turn` is fresh and of the
        same tenant)."""
        if request.num_prompt_tokens <= turn.num_prompt_tokens or self._is_stale(turn, now_s):
            return False
        if request.tenant != turn.tenant:
            return False
        start = turn.num_prompt_tokens - len(turn.prompt_tail)
        return tuple(request.all_token_ids[start:turn.num_prompt_tokens]) == turn.prompt_tail

    def _is_stale(self, turn: _FinishedTurn, now_s: float) -> bool:
        return now_s > turn.expires_at_s(self.max_age_s)

    def _add(self, turn: _FinishedTurn) -> list[str]:
        """Files `turn`, dropping the oldest turn filed under its prompt or its request id past
        `MAX_TURNS_PER_KEY`, and the oldest turns of the tenant holding the most while the
        table is over its size; returns the dropped turns' jobs."""
        previous = self._turns.get(turn.job_id)
        if previous is not None:
            self._remove(previous)
        self._turns[turn.job_id] = turn
        self._turns_by_tenant.setdefault(turn.tenant, OrderedDict())[turn.job_id] = None
        heapq.heappush(self._expiries, (turn.expires_at_s(self.max_age_s),
                                        next(self._num_filed), turn.job_id, turn))
        if len(self._expiries) > 2 * len(self._turns) + 64:  # drop the entries of turns gone
            self._expiries = [entry for entry in self._expiries
                              if self._turns.get(entry[2]) is entry[3]]
            heapq.heapify(self._expiries)
        ended = []
        for index, key in ((self._job_ids_by_key, turn.key_hash),
                           (self._job_ids_by_request_id, turn.request_id)):
            filed = index.setdefault(key, [])  # type: ignore[attr-defined]
            filed.append(turn.job_id)
            if len(filed) > MAX_TURNS_PER_KEY:
                oldest = self._turns[filed[0]]
                self._remove(oldest)
                ended.append(oldest.job_id)
        while len(self._turns) > self.max_turns:
            # The tenant holding the most; between tenants holding as many, the oldest turn.
            largest = max(self._turns_by_tenant.values(), key=lambda turns: (
                len(turns), -self._turns[next(iter(turns))].finished_at_s))
            oldest = self._turns[next(iter(largest))]
            self._remove(oldest)
            ended.append(oldest.job_id)
        return ended

    def _remove(self, turn: _FinishedTurn) -> None:
        del self._turns[turn.job_id]
        tenant_turns = self._turns_by_tenant[turn.tenant]
        del tenant_turns[turn.job_id]
        if not tenant_turns:
            del self._turns_by_tenant[turn.tenant]
        _unfile(self._job_ids_by_request_id, turn.request_id, turn.job_id)
        _unfile(self._job_ids_by_key, turn.key_hash, turn.job_id)

    def check_invariants(self, unfinished: Mapping[str, Request],
                         pinned_job_ids: Iterable[str]) -> None:
        """The table is within its size, in finish order, and indexed by its keys; a job in
        the table has no unfinished turn, each continuing request is unfinished and of the
        job it continued, and every pin of an inferred job is of a job that can still go on
        (in the table, or with an unfinished turn). `unfinished`: the scheduler's unfinished
        requests by id; `pinned_job_ids`: the jobs holding pins."""
        assert len(self._turns) <= self.max_turns, "the table of finished turns overflowed"
        times = [turn.finished_at_s for turn in self._turns.values()]
        assert times == sorted(times), "finished turns out of order"
        indexed = sorted(job_id for ids in self._job_ids_by_key.values() for job_id in ids)
        assert indexed == sorted(self._turns), "the key index disagrees with the table"
        by_tenant: dict[str | None, list[str]] = {}
        for job_id, turn in self._turns.items():
            by_tenant.setdefault(turn.tenant, []).append(job_id)
        assert {tenant: list(turns) for tenant, turns in self._turns_by_tenant.items()} == \
            by_tenant, "the tenant index disagrees with the table"
        by_request_id: dict[str, list[str]] = {}
        for job_id, turn in self._turns.items():
            by_request_id.setdefault(turn.request_id, []).append(job_id)
        assert self._job_ids_by_request_id == by_request_id, (
            "the request index disagrees with the table"
        )
        for job_id, turn in self._turns.items():
            assert turn.job_id == job_id, f"turn of {turn.job_id} filed under {job_id}"
            assert job_id in self._job_ids_by_key[turn.key_hash], f"{job_id} filed wrongly"
            assert len(turn.prompt_tail) < self.block_size, f"{job_id}: tail over a block"
            assert len(turn.output_head) <= self.block_size, f"{job_id}: output over a block"
        unfinished_job_ids = [request.job_id for request in unfinished.values()
                              if request.job is not None and request.job.inferred]
        assert len(set(unfinished_job_ids)) == len(unfinished_job_ids), (
            "an inferred job has two unfinished turns"
        )
        assert not set(unfinished_job_ids) & self._turns.keys(), (
            "a job in the table of finished turns has an unfinished turn"
        )
        for request_id, turn in self._continued.items():
            request = unfinished.get(request_id)
            assert request is not None, f"continuing request {request_id} is not unfinished"
            assert request.job_id == turn.job_id, f"{request_id} left the job it continued"
        live = self._turns.keys() | set(unfinished_job_ids)
        for job_id in pinned_job_ids:
            assert not is_inferred_job_id(job_id) or job_id in live, (
                f"the pin of {job_id} outlived its inferred job"
            )


def _num_visible_output_tokens(request: Request) -> int:
    """The output tokens whose text the client received: all but a stop token that ended it
    (EOS or a stop token id, which the output text leaves out)."""
    num_tokens = request.num_output_tokens
    if num_tokens and request.status is RequestStatus.FINISHED_STOPPED:
        last_token_id = request.all_token_ids[-1]
        if (last_token_id == request.eos_token_id
                or last_token_id in request.sampling_params.stop_token_ids):
            return num_tokens - 1
    return num_tokens


def normalized_text(text: str) -> str:
    """`text` as turns are matched on it: without markup tags (`<|name|>`, `<name>`,
    `</name>`: the decoder keeps special tokens, which a client never sees, and a tag the
    model wrote as text goes from both sides alike), NFC, each run of whitespace one space,
    each run of U+FFFD (bytes that were not UTF-8, decoded once whole and once in pieces)
    one, and no whitespace at either end."""
    text = unicodedata.normalize("NFC", _TAGS.sub("", text))
    text = _REPLACEMENT_CHARS.sub("\ufffd", text)
    return _WHITESPACE.sub(" ", text).strip()


def _grams(text: str) -> set[str]:
    """The runs of `TEXT_GRAM_CHARS` characters of `text` (the text itself if shorter)."""
    if len(text) <= TEXT_GRAM_CHARS:
        return {text} if text else set()
    return {text[start:start + TEXT_GRAM_CHARS]
            for start in range(len(text) - TEXT_GRAM_CHARS + 1)}


def _text_score(output_text: str, continuation: str, continuation_grams: set[str],
                common_grams: set[str]) -> tuple[bool, float, int]:
    """How well `continuation` (whose runs of characters are `continuation_grams`) holds
    `output_text`: whether it holds any of its runs less `common_grams`, the share it holds,
    and their number. A text shorter than a run counts as one, held when it occurs anywhere.
    An empty text (or one made of common runs only) is held whole, by none of its runs: it
    wins only where no candidate's text occurs at all."""
    grams = _grams(output_text) - common_grams
    if not grams:
        return False, 1.0, 0
    if len(output_text) < TEXT_GRAM_CHARS:
        held = int(output_text in continuation)
    else:
        held = len(grams & continuation_grams)
    return held > 0, held / len(grams), held


def _num_repeated(request: Request, turn: _FinishedTurn) -> int:
    """How many of `turn`'s first output tokens `request`'s prompt repeats, in order, right
    after `turn`'s prompt."""
    start = turn.num_prompt_tokens
    repeated = 0
    for token, expected in zip(request.all_token_ids[start:request.num_prompt_tokens],
                               turn.output_head, strict=False):
        if token != expected:
            break
        repeated += 1
    return repeated


def _unfile(index: dict[_K, list[str]], key: _K, job_id: str) -> None:
    """Removes `job_id` from the list filed under `key`, and the key with its last job."""
    job_ids = index[key]
    job_ids.remove(job_id)
    if not job_ids:
        del index[key]
