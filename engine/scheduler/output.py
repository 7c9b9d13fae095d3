"""The plan of one scheduler step, consumed by the executor (model runner)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec

from engine.kv_cache.transfers import NO_TRANSFERS, KVTransfers
from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine.structured_output.bitmask import GrammarBitmask


class NewRequestData(msgspec.Struct, kw_only=True):
    """A request the runner has no state for: new, or resumed after preemption, sent in full.

    `output_token_ids` is non-empty for a resumed request (penalties need them);
    `num_computed_tokens` is the prefix-cache hit whose KV the runner can reuse;
    `eos_token_id` is banned by the sampler until `min_tokens` (unless `ignore_eos`).
    """

    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    eos_token_id: int | None = None


class CachedRequestData(msgspec.Struct, kw_only=True):
    """Requests the runner already holds, as deltas (parallel lists).

    The runner appends the tokens it sampled itself, so no token ids are sent; `new_block_ids`
    lists blocks appended since the last step, `num_computed_tokens` is the count before it.
    """

    req_ids: list[str] = msgspec.field(default_factory=list)
    new_block_ids: list[list[int]] = msgspec.field(default_factory=list)
    num_computed_tokens: list[int] = msgspec.field(default_factory=list)


class SchedulerOutput(msgspec.Struct, kw_only=True):
    """Everything the runner needs to execute one step.

    Blocks are registered in the prefix cache when scheduled, so a request admitted in this
    step may reuse KV that another request computes in this same step: the runner must write
    the step's new KV of every request before attention reads the cache (per layer).

    `num_scheduled_tokens` maps every scheduled request to its token count this step.
    `finished_req_ids` and `preempted_req_ids` tell the runner whose state to drop.
    `grammar_bitmask` (added by the engine core, never by the scheduler) holds the allowed
    tokens of the requests with a structured output that sample in this step.
    `kv_transfers` are the host-tier copies the runner carries out with the step, in the
    order `KVTransfers` gives, even when no token is scheduled.
    """

    step_id: int
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    finished_req_ids: set[str]
    preempted_req_ids: set[str]
    grammar_bitmask: GrammarBitmask | None = None
    kv_transfers: KVTransfers = NO_TRANSFERS

    @property
    def is_empty(self) -> bool:
        """No token is scheduled (host-tier copies may still be)."""
        return self.total_num_scheduled_tokens == 0
