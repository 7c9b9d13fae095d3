"""The scheduler trace schema: one msgspec Struct per record type, one JSON object per line.

A trace starts with a `TraceHeader`. Every other record carries `step` and `time_s`:

- `time_s` is the scheduler's clock (seconds; monotonic in a live engine, virtual in a
  simulation). `TraceHeader.clock_origin_s` and `created_unix_s` relate it to wall time.
- `step` is the scheduler step the record belongs to. Records of step N are the events since
  step N-1 ended (arrivals, aborts), the `StepSnapshot` of N, the events while N was planned
  (expiries, pressure releases, admissions), the `StepDecision` of N, then the events of
  applying N's output (finishes, pins). Snapshot and decision of a step share its number.

Field names say their unit; request and job ids are the engine's. The `type` field names
the record; readers must ignore fields they do not know (the version changes only when a
field's meaning does). A TTL of None means no deadline (an infinite TTL).
"""

from __future__ import annotations

from typing import Any

import msgspec

SCHEMA_VERSION = 1


class Record(msgspec.Struct, tag_field="type", kw_only=True, omit_defaults=True):
    """Base of every trace record."""


class Event(Record, kw_only=True):
    """A record that happened at a step: `step` and `time_s` (scheduler clock, seconds)."""

    step: int
    time_s: float


class TraceHeader(Record, tag="header", kw_only=True):
    """The first line: schema version, when and how the engine ran.

    `clock_origin_s` is the scheduler clock when the trace was opened, at `created_unix_s`
    wall time. `config` is the engine configuration as the engine reported it.
    """

    schema_version: int
    created_unix_s: float
    clock_origin_s: float
    policy: str
    num_kv_blocks: int
    block_size: int
    max_num_batched_tokens: int
    max_num_seqs: int
    config: dict[str, Any] = {}


class StepSnapshot(Event, tag="step_snapshot", kw_only=True):
    """The state entering a step, before the policy's step start (pin expiry).

    Blocks: `num_free_blocks` are unreferenced, of which `num_cached_free_blocks` still hold
    a prefix (evictable cache); `num_pinned_blocks` are held by pins (a block shared with a
    running request counts in both).
    """

    running_ids: list[str]
    waiting_ids: list[str]
    num_total_blocks: int
    num_free_blocks: int
    num_cached_free_blocks: int
    num_pinned_blocks: int
    pinned_job_ids: list[str]
    token_budget: int
    max_num_seqs: int

    @property
    def num_running(self) -> int:
        return len(self.running_ids)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting_ids)

    @property
    def num_pins(self) -> int:
        return len(self.pinned_job_ids)


class Preemption(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A running request sent back to waiting, its `num_computed_tokens` of KV dropped:
    because `needed_by` (possibly itself) could not get blocks ("out_of_blocks"), or because
    this request's tenant is over its share of the batch and KV pool while `needed_by`'s is
    within its own ("tenant_share": for `needed_by` waiting, or in place of the policy's
    victim)."""

    request_id: str
    job_id: str | None = None
    reason: str = "out_of_blocks"
    needed_by: str
    num_computed_tokens: int


class StepDecision(Event, tag="step_decision", kw_only=True):
    """What a step scheduled: tokens per request (`num_scheduled_tokens`, continuing requests
    first, in running order, then admitted ones), which of them were admitted (`new_ids` for
    the first time, `resumed_ids` after a preemption), and the preemptions. The continuing
    requests' ids are not repeated: `running_ids` derives them. With a host KV tier,
    `num_stored_blocks` were copied to it and `num_loaded_blocks` back from it in the step."""

    new_ids: list[str]
    resumed_ids: list[str]
    preempted: list[Preemption] = []
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    num_stored_blocks: int = 0
    num_loaded_blocks: int = 0

    @property
    def running_ids(self) -> list[str]:
        """Requests that were already running and continued in this step."""
        admitted = {*self.new_ids, *self.resumed_ids}
        return [request_id for request_id in self.num_scheduled_tokens
                if request_id not in admitted]


class PrefixCacheEvent(Event, tag="prefix_cache", kw_only=True):
    """A request's admission: of its `num_prompt_tokens` (all its tokens so far),
    `num_hit_tokens` came from the prefix cache: `num_pin_hit_tokens` from blocks its own
    job's pin held, `num_host_hit_tokens` loaded from the host tier, the rest
    (`num_device_hit_tokens`) from the device's unpinned cache. `resumed`: it was preempted
    before (the miss is recomputation)."""

    request_id: str
    job_id: str | None = None
    num_prompt_tokens: int
    num_hit_tokens: int
    num_pin_hit_tokens: int = 0
    num_host_hit_tokens: int = 0
    resumed: bool = False

    @property
    def num_device_hit_tokens(self) -> int:
        """Hit tokens from device blocks no pin of the request's job held."""
        return self.num_hit_tokens - self.num_pin_hit_tokens - self.num_host_hit_tokens


class TTLInputs(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Why a policy chose `ttl_s` (0: do not pin) for a finished turn that called `tool`.

    `source` names the rule: for Eq. 2 the distribution that decided (`cold-start`, `tool`,
    `pooled`, `learned`), else the policy's rule (`fixed`, `constant`, `until-next-turn`;
    InferCept with swap: `preserve`, `discard` or `swap`, with the samples behind the tool's
    expected duration in `num_samples` and the context's way back in `rebuild_s`).
    Eq. 2's inputs, when it decided: `num_samples` of the distribution, `queueing_delay_s`
    (T), `eta`, `rebuild_s` (R), `benefit_s` (T * eta + R) and `memory_price` (seconds of
    the others' delay a second of the pin costs, with a priced `pin_cost`). `declined_by`
    names what overruled a positive TTL (`pin-cap`: the pins' share of the pool was full).
    """

    ttl_s: float | None
    source: str
    tool: str | None = None
    num_samples: int | None = None
    queueing_delay_s: float | None = None
    eta: float | None = None
    rebuild_s: float | None = None
    benefit_s: float | None = None
    declined_by: str | None = None
    memory_price: float | None = None


class PinPinned(Event, tag="pin_pinned", kw_only=True):
    """A finished turn's `num_blocks` blocks pinned for its job for `ttl_s`; `inputs` when
    the policy explained its TTL."""

    job_id: str
    request_id: str
    num_blocks: int
    ttl_s: float | None
    inputs: TTLInputs | None = None


class PinDeclined(Event, tag="pin_declined", kw_only=True):
    """A finished turn that called a tool whose KV the policy chose not to pin (or that had
    no full block to pin)."""

    job_id: str
    request_id: str
    inputs: TTLInputs


class PinReleased(Event, tag="pin_released", kw_only=True):
    """A pin stopped holding its blocks after `held_s`, for `reason`: reused, expired,
    pressure, client_pressure, tenant_share, job_end, replaced, release or abort."""

    job_id: str
    request_id: str
    num_blocks: int
    ttl_s: float | None
    held_s: float
    reason: str


class RequestArrived(Event, tag="request_arrived", kw_only=True):
    """A request joined the waiting queue. `max_tokens` None: bounded only by the model
    length; `is_last_turn` and `tool_name` as the client said. `job_inferred`: the client
    named no job and the engine inferred `job_id`, continuing the finished request
    `inferred_from` (None: the request started a new inferred job)."""

    request_id: str
    job_id: str | None = None
    num_prompt_tokens: int
    max_tokens: int | None = None
    is_last_turn: bool = False
    tool_name: str | None = None
    job_inferred: bool = False
    inferred_from: str | None = None


class RequestFinished(Event, tag="request_finished", kw_only=True):
    """A request left the engine for `reason` (stop, length, abort)."""

    request_id: str
    job_id: str | None = None
    reason: str
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int = 0
    num_preemptions: int = 0


class JobEnded(Event, tag="job_ended", kw_only=True):
    """The engine ended a job: its last turn finished (`job_end`) or a client released it
    (`release`). An inferred job ends (`job_end`) once it can no longer be continued. Jobs
    the policy forgets after their idle timeout are not recorded."""

    job_id: str
    reason: str


class TraceTruncated(Event, tag="truncated", kw_only=True):
    """The last record of a trace that reached its size cap of `max_bytes`; its step and
    time are those of the latest record that was left out."""

    max_bytes: int


TraceRecord = (
    TraceHeader
    | StepSnapshot
    | StepDecision
    | PrefixCacheEvent
    | PinPinned
    | PinDeclined
    | PinReleased
    | RequestArrived
    | RequestFinished
    | JobEnded
    | TraceTruncated
)

RECORD_TYPES: dict[str, type[Record]] = {
    cls.__struct_config__.tag: cls  # type: ignore[misc]
    for cls in (TraceHeader, StepSnapshot, StepDecision, PrefixCacheEvent, PinPinned,
                PinDeclined, PinReleased, RequestArrived, RequestFinished, JobEnded,
                TraceTruncated)
}
