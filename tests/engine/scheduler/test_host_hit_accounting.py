"""Host-tier hits as clients and traces see them: a turn whose prefix comes back from the
host tier reports it in `num_cached_tokens` (the API's `usage.prompt_tokens_details.
cached_tokens`), and its trace splits the hit between the device cache and the host tier."""

from __future__ import annotations

from pathlib import Path

from engine.config import CacheConfig, SchedulerConfig
from engine.outputs import EngineCoreOutput
from engine.scheduler.policies import FCFSPolicy
from engine.scheduler.scheduler import Scheduler
from engine.scheduler.tracer import SchedulerTracer
from tests.engine.helpers import FakeClock, FakeRunner, make_request
from tracing.reader import read_trace
from tracing.records import PrefixCacheEvent
from tracing.summary import summarize

BLOCK_SIZE = 4
FIRST_PROMPT = list(range(1, 13))  # 3 full blocks
OTHER_PROMPT = list(range(100, 128))  # 7 blocks: pushes the first prompt out of the pool


def _scheduler(trace_path: Path) -> Scheduler:
    return Scheduler(
        SchedulerConfig(max_model_len=32, max_num_batched_tokens=64, max_num_seqs=4),
        CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=True),
        FCFSPolicy(), num_kv_blocks=8, num_host_kv_blocks=32, clock=FakeClock(),
        tracer=SchedulerTracer(trace_path, config={"test": "host tier"}),
    )


def _run_alone(scheduler: Scheduler, runner: FakeRunner, request_id: str,
               prompt: list[int]) -> list[EngineCoreOutput]:
    scheduler.add_request(make_request(request_id, prompt, max_tokens=1))
    outputs: list[EngineCoreOutput] = []
    while scheduler.has_unfinished_requests():
        output = scheduler.schedule()
        outputs += scheduler.update_from_output(output, runner.execute(output))
        scheduler.check_invariants()
    return outputs


def test_a_prefix_loaded_from_the_host_tier_counts_as_cached(tmp_path: Path) -> None:
    scheduler = _scheduler(tmp_path / "trace.jsonl")
    runner = FakeRunner(BLOCK_SIZE)
    _run_alone(scheduler, runner, "first", FIRST_PROMPT)
    _run_alone(scheduler, runner, "other", OTHER_PROMPT)
    (final,) = _run_alone(scheduler, runner, "again", [*FIRST_PROMPT, 13, 14, 15, 16])
    scheduler.close_subscribers()

    # The whole first prompt was found again, some of it only in the host tier.
    assert final.num_cached_tokens == len(FIRST_PROMPT)
    num_host_hit_tokens = scheduler.kv_cache_manager.stats.num_host_hit_tokens
    assert 0 < num_host_hit_tokens <= final.num_cached_tokens

    trace = read_trace(tmp_path / "trace.jsonl")
    (admission,) = (event for event in trace.of_type(PrefixCacheEvent)
                    if isinstance(event, PrefixCacheEvent) and event.request_id == "again")
    assert admission.num_hit_tokens == final.num_cached_tokens
    assert admission.num_host_hit_tokens == num_host_hit_tokens
    summary = summarize(trace)
    cache = summary.prefix_cache
    assert cache.host_hit_tokens == num_host_hit_tokens
    assert cache.device_hit_tokens == len(FIRST_PROMPT) - num_host_hit_tokens
    assert cache.pin_hit_tokens == 0
    assert summary.host_tier.loaded_blocks == num_host_hit_tokens // BLOCK_SIZE
    # At least the first prompt's 3 blocks were stored before the other prompt evicted them.
    assert summary.host_tier.stored_blocks >= len(FIRST_PROMPT) // BLOCK_SIZE
