"""One scheduler step's plan: built by the step loop, then emitted as a `SchedulerOutput`.

Owned by `Scheduler.schedule()`: it creates a `StepPlan` per call, fills it while scheduling
running and waiting requests (admissions report an `AdmissionOutcome`), and ends the step with
`emit`. Nothing outside that call keeps a plan.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.config import SchedulerConfig
from engine.kv_cache.block import KVCacheBlock
from engine.kv_cache.transfers import KVTransfers
from engine.request import Request
from engine.scheduler.output import CachedRequestData, NewRequestData, SchedulerOutput


class AdmissionOutcome(enum.Enum):
    """The outcome of trying to admit one waiting request."""

    ADMITTED = "admitted"
    OVER_BUDGET = "over_budget"  # the prompt must go whole and does not fit this step
    NO_MEMORY = "no_memory"


@dataclass(slots=True)
class StepPlan:
    """What one `schedule()` call has decided so far, under the scheduler's `config`;
    `token_budget` starts at its `max_num_batched_tokens` and shrinks with every scheduled
    token. `held_back` requests must not sample this step (they compute at most up to their
    last known token)."""

    config: SchedulerConfig
    held_back: frozenset[str] = frozenset()
    token_budget: int = field(init=False)
    admitted: list[Request] = field(default_factory=list)
    continuing: list[Request] = field(default_factory=list)
    new_block_ids: dict[str, list[int]] = field(default_factory=dict)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    preempted: list[Request] = field(default_factory=list)
    stalled: list[Request] = field(default_factory=list)  # running, left waiting for memory

    def __post_init__(self) -> None:
        self.token_budget = self.config.max_num_batched_tokens

    @property
    def total_num_scheduled_tokens(self) -> int:
        return self.config.max_num_batched_tokens - self.token_budget

    def num_new_tokens(self, request: Request, num_computed_tokens: int) -> int:
        """Tokens `request` may compute this step past `num_computed_tokens`: its remainder,
        placeholders included (but its last token if it is held back), capped by the
        long-prefill threshold and the budget (0 if it must go whole and does not fit, or if
        the token it awaits will end it by length)."""
        if request.num_output_placeholders and self._awaits_last_token(request):
            return 0
        num_new_tokens = request.num_tokens + request.num_output_placeholders - num_computed_tokens
        if request.request_id in self.held_back:
            num_new_tokens -= 1
        threshold = self.config.long_prefill_token_threshold
        if threshold is not None and num_new_tokens > threshold:
            num_new_tokens = threshold
        if num_new_tokens > self.token_budget:
            return self.token_budget if self.config.enable_chunked_prefill else 0
        return num_new_tokens

    def _awaits_last_token(self, request: Request) -> bool:
        """Whether the tokens `request` awaits bring it to `max_model_len` or `max_tokens`."""
        num_tokens = request.num_tokens + request.num_output_placeholders
        max_tokens = request.sampling_params.max_tokens
        return num_tokens >= self.config.max_model_len or (
            max_tokens is not None and num_tokens - request.num_prompt_tokens >= max_tokens)

    def add(self, request: Request, num_tokens: int) -> None:
        self.num_scheduled_tokens[request.request_id] = num_tokens
        self.token_budget -= num_tokens

    def add_continuing(
        self, request: Request, num_tokens: int, new_blocks: list[KVCacheBlock]
    ) -> None:
        self.continuing.append(request)
        if new_blocks:
            self.new_block_ids[request.request_id] = [b.block_id for b in new_blocks]
        self.add(request, num_tokens)

    def drop_continuing(self, request: Request) -> None:
        """Undoes the scheduling of a running request that became a victim later this step."""
        self.token_budget += self.num_scheduled_tokens.pop(request.request_id)
        self.continuing.remove(request)
        self.new_block_ids.pop(request.request_id, None)


def emit(
    plan: StepPlan,
    *,
    step_id: int,
    finished_req_ids: set[str],
    block_ids_of: Callable[[str], list[int]],
    transfers: KVTransfers,
) -> SchedulerOutput:
    """Builds the step's output and advances `num_computed_tokens` of everything scheduled;
    a request whose known tokens (and placeholders) are then all computed samples, and gets
    one more `num_output_placeholders`.

    Called once per step, at the end of `Scheduler.schedule()`; `finished_req_ids` (the
    requests finished since the previous step) is handed over to the output, not copied, and
    `block_ids_of` gives a request's block ids (`KVCacheManager.get_block_ids`), and
    `transfers` are the host-tier copies the step carries.
    """
    new_reqs = [
        NewRequestData(
            req_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            output_token_ids=request.output_token_ids,
            sampling_params=request.sampling_params,
            block_ids=block_ids_of(request.request_id),
            num_computed_tokens=request.num_computed_tokens,
            eos_token_id=request.eos_token_id,
        )
        for request in plan.admitted
    ]
    cached = CachedRequestData(
        req_ids=[request.request_id for request in plan.continuing],
        new_block_ids=[plan.new_block_ids.get(r.request_id, []) for r in plan.continuing],
        num_computed_tokens=[request.num_computed_tokens for request in plan.continuing],
    )
    num_scheduled = plan.num_scheduled_tokens
    for request in (*plan.continuing, *plan.admitted):
        request.num_computed_tokens += num_scheduled[request.request_id]
        if request.num_computed_tokens >= request.num_tokens + request.num_output_placeholders:
            request.num_output_placeholders += 1  # it samples: its token comes back later
    return SchedulerOutput(
        step_id=step_id,
        scheduled_new_reqs=new_reqs,
        scheduled_cached_reqs=cached,
        num_scheduled_tokens=num_scheduled,
        total_num_scheduled_tokens=plan.total_num_scheduled_tokens,
        finished_req_ids=finished_req_ids,
        preempted_req_ids={request.request_id for request in plan.preempted},
        kv_transfers=transfers,
    )
