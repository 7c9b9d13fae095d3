"""InferCept's waste model (preserve, discard or swap a paused turn's KV), InferCept with swap
in the scheduler with a host tier, and Continuum's R with the tier."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from continuum.agent_policy import AgentPolicy
from continuum.interception import InterceptionModel, InterceptionWaste
from continuum.policy_options import InferCeptOptions
from continuum.presets import INFERCEPT
from continuum.retention_rules import InterceptedPins, PinUntilNextTurn
from engine.scheduler import events
from engine.scheduler.policy import PolicyEnvironment
from engine.scheduler.policy_registry import check_policy_options, make_policy
from engine.scheduler.tracer import SchedulerTracer
from estimator.cost_model import HostReloadCost, PrefillCostModel
from estimator.eq2 import Eq2Estimator
from estimator.ttl_estimator import ToolCall
from eval.policy_specs import policy_specs
from tests.continuum.harness import Harness, tokens
from tests.continuum.workload import AgentJob, Turn, replay
from tracing.reader import read_trace
from tracing.records import PinDeclined, PinPinned, PrefixCacheEvent

BLOCK_SIZE = 16
RECOMPUTE = PrefillCostModel(linear_s=1.0)  # 1 s per 1000 tokens
FAST_RELOAD = HostReloadCost(PrefillCostModel(linear_s=0.1), max_tokens=10_000)
SLOW_RELOAD = HostReloadCost(PrefillCostModel(linear_s=2.0), max_tokens=10_000)


def model(recompute: PrefillCostModel | None = RECOMPUTE,
          reload: HostReloadCost | None = FAST_RELOAD,
          default_s: float = 1.0) -> InterceptionModel:
    return InterceptionModel(recompute_cost=recompute, reload_cost=reload,
                             default_tool_duration_s=default_s)


def call(job_id: str = "j", tool: str | None = "bash", at_s: float = 0.0,
         tokens_: int = 1600) -> ToolCall:
    return ToolCall(job_id, tool, at_s, tokens_, 0)


def observe(interception: InterceptionModel, tool: str | None, duration_s: float,
            job_id: str = "j") -> None:
    interception.observe_tool_call(call(job_id, tool, at_s=100.0))
    interception.observe_next_turn(job_id, 100.0 + duration_s)


# The waste model.
def test_a_tool_shorter_than_the_way_back_preserves() -> None:
    # 100 blocks: preserve 100 x 0.1 s; swap 0.16 s x 100; discard 1.6 s x 100.
    short = model(default_s=0.1).decide(call(tokens_=1600), block_size=BLOCK_SIZE,
                                        num_running_blocks=0)
    assert short.waste == InterceptionWaste(pytest.approx(10.0), pytest.approx(160.0),
                                            pytest.approx(16.0))
    assert short.choice == "preserve" and short.expected_tool_s == 0.1
    assert short.rebuild_s == pytest.approx(0.16)  # the cheaper way back, for the trace
    longer = model(default_s=1.0).decide(call(), block_size=BLOCK_SIZE, num_running_blocks=0)
    assert longer.choice == "swap"  # 100 x 1 s of preserving outweighs 16 of swapping


def test_a_long_tool_swaps_when_reloading_is_cheaper_than_recomputing() -> None:
    interception = model()
    observe(interception, "bash", 30.0)
    decision = interception.decide(call(), block_size=BLOCK_SIZE, num_running_blocks=50)
    assert (decision.choice, decision.expected_tool_s, decision.num_samples) == ("swap", 30.0, 1)
    assert decision.rebuild_s == pytest.approx(0.16)


def test_a_long_tool_discards_when_recomputing_is_cheaper_than_reloading() -> None:
    interception = model(reload=SLOW_RELOAD)
    observe(interception, "bash", 30.0)
    decision = interception.decide(call(), block_size=BLOCK_SIZE, num_running_blocks=50)
    assert decision.choice == "discard" and decision.rebuild_s == pytest.approx(1.6)


def test_running_requests_make_a_rebuild_costlier_than_preserving() -> None:
    interception = model(reload=None)
    observe(interception, "bash", 3.0)
    alone = interception.decide(call(), block_size=BLOCK_SIZE, num_running_blocks=0)
    assert alone.choice == "discard"  # 1.6 s x 100 blocks < 3 s x 100 blocks
    busy = interception.decide(call(), block_size=BLOCK_SIZE, num_running_blocks=200)
    assert busy.choice == "preserve"  # 1.6 s x 300 blocks > 3 s x 100 blocks


def test_a_choice_that_cannot_be_priced_is_never_taken() -> None:
    unpriced = model(recompute=None, reload=None)
    observe(unpriced, "bash", 600.0)
    assert unpriced.decide(call(), block_size=BLOCK_SIZE, num_running_blocks=0).choice == (
        "preserve")
    small_tier = model(reload=HostReloadCost(PrefillCostModel(linear_s=0.1), max_tokens=1000))
    observe(small_tier, "bash", 600.0)
    decision = small_tier.decide(call(tokens_=1600), block_size=BLOCK_SIZE,
                                 num_running_blocks=0)
    assert decision.choice == "discard" and decision.reload_s is None
    assert decision.waste.swap_block_s is None


def test_ties_go_to_preserve_then_swap() -> None:
    assert InterceptionWaste(5.0, 5.0, 5.0).choice == "preserve"
    assert InterceptionWaste(6.0, 5.0, 5.0).choice == "swap"
    assert InterceptionWaste(6.0, 4.0, 5.0).choice == "discard"


def test_the_expected_duration_is_the_tools_mean_else_all_tools_else_the_default() -> None:
    interception = model(default_s=2.5)
    assert interception.expected_tool_s("bash") == (2.5, 0)
    observe(interception, "bash", 1.0, job_id="a")
    observe(interception, "bash", 3.0, job_id="b")
    observe(interception, "grep", 10.0, job_id="c")
    assert interception.expected_tool_s("bash") == (2.0, 2)
    assert interception.expected_tool_s("unseen") == (pytest.approx(14.0 / 3), 3)
    assert interception.expected_tool_s(None) == (pytest.approx(14.0 / 3), 3)
    interception.observe_tool_call(call("d", "bash", at_s=0.0))
    interception.forget_job("d")  # its job ended: its next turn never comes
    interception.observe_next_turn("d", 50.0)
    assert interception.expected_tool_s("bash") == (2.0, 2)


# Options.
def test_swap_is_an_option_of_infercept_and_a_bench_spec() -> None:
    policy = make_policy("infercept", {"swap": "on", "default_tool_duration_s": "3"})
    assert isinstance(policy, AgentPolicy)
    retention = policy.strategies.retention
    assert isinstance(retention, InterceptedPins) and retention.default_tool_duration_s == 3.0
    assert isinstance(make_policy("infercept").strategies.retention, PinUntilNextTurn)
    [spec] = policy_specs("infercept:swap=on")
    assert (spec.name, spec.options) == ("infercept", (("swap", "on"),))
    kept = INFERCEPT.build(InferCeptOptions(job_idle_timeout_s=30.0)).strategies.retention
    assert isinstance(kept, PinUntilNextTurn) and kept.ttl_s == 30.0


@pytest.mark.parametrize(("options", "message"), [
    ({"swap": "maybe"}, "swap"),
    ({"default_tool_duration_s": "-1"}, "default_tool_duration_s"),
    ({"default_tool_duration_s": "inf"}, "default_tool_duration_s"),
])
def test_bad_infercept_options_are_refused_with_their_name(options, message) -> None:
    with pytest.raises(ValueError, match=message):
        check_policy_options("infercept", options)


# InferCept with swap in the scheduler.
def points(seconds_per_token: float) -> list[tuple[int, float]]:
    return [(16, 16 * seconds_per_token), (64, 64 * seconds_per_token)]


def environment(prefill_s_per_token: float, reload_s_per_token: float) -> PolicyEnvironment:
    return PolicyEnvironment(profile_prefill=lambda: points(prefill_s_per_token),
                             profile_kv_reload=lambda: points(reload_s_per_token))


def infercept_harness(tmp_path: Path, env: PolicyEnvironment, num_host_kv_blocks: int = 32,
                      **options: str) -> Harness:
    return Harness(make_policy("infercept", {"swap": "on", **options}), num_blocks=8,
                   max_model_len=32, environment=env, num_host_kv_blocks=num_host_kv_blocks,
                   tracer=SchedulerTracer(tmp_path / "trace.jsonl", config={"test": True}))


def evict_everything(h: Harness) -> None:
    """Unrelated requests that take every device block, evicting whatever is cached."""
    for index in range(2):
        h.add(f"filler{index}", tokens(500 + 20 * index, 15), max_tokens=1)
    h.run_until_finished("filler0", "filler1")


def recorded(h: Harness) -> list:
    tracer = h.scheduler.tracer
    assert tracer is not None
    h.scheduler.close_subscribers()
    return read_trace(tracer.path).events


def two_turns_with_eviction(h: Harness) -> None:
    h.add("t1", tokens(1, 12), job="J", max_tokens=2)  # 14 tokens: 3 full blocks of KV
    h.run_until_finished("t1")
    evict_everything(h)
    h.clock.advance(5.0)
    h.next_turn("t2", "t1", tokens(50, 3))
    h.run_until_finished("t2")


def test_a_swapped_turn_is_stored_and_its_next_turn_loads_it_from_the_host_tier(
    tmp_path: Path,
) -> None:
    h = infercept_harness(tmp_path, environment(0.05, 0.0001))
    two_turns_with_eviction(h)
    assert h.pin("J") is None  # swapped, not pinned
    assert h.requests["t2"].num_cached_tokens == 12
    assert h.scheduler.kv_cache_manager.stats.num_host_hit_tokens == 12
    loads = [output.kv_transfers.loads for output in h.outputs if output.kv_transfers.loads]
    assert [len(pairs) for pairs in loads] == [3]
    events = recorded(h)
    [declined] = [e for e in events if isinstance(e, PinDeclined) and e.request_id == "t1"]
    assert (declined.inputs.source, declined.inputs.ttl_s, declined.inputs.tool) == (
        "swap", 0.0, "bash")
    assert declined.inputs.num_samples == 0  # the default duration: nothing observed yet
    assert declined.inputs.rebuild_s == pytest.approx(14 * 0.0001, abs=1e-4)
    [hit] = [e for e in events if isinstance(e, PrefixCacheEvent) and e.request_id == "t2"]
    assert (hit.num_hit_tokens, hit.num_host_hit_tokens) == (12, 12)


def test_a_discarded_turn_is_not_stored_and_its_next_turn_recomputes(tmp_path: Path) -> None:
    h = infercept_harness(tmp_path, environment(0.0001, 0.05))
    two_turns_with_eviction(h)
    assert h.pin("J") is None
    assert h.requests["t2"].num_cached_tokens == 0
    assert h.scheduler.kv_cache_manager.stats.num_host_hit_tokens == 0
    events = recorded(h)
    [declined] = [e for e in events if isinstance(e, PinDeclined) and e.request_id == "t1"]
    assert declined.inputs.source == "discard"


def test_a_preserved_turn_is_pinned_until_its_next_turn(tmp_path: Path) -> None:
    h = infercept_harness(tmp_path, environment(0.05, 0.05), default_tool_duration_s="0.01")
    h.add("t1", tokens(1, 12), job="J", max_tokens=2)
    h.run_until_finished("t1")
    assert h.pin("J") is not None and h.pin("J").ttl_s == h.policy.ledger.jobs.idle_timeout_s
    h.clock.advance(2.0)
    h.next_turn("t2", "t1", tokens(50, 3))
    h.run_until_finished("t2")
    assert h.requests["t2"].num_cached_tokens == 12
    assert h.scheduler.kv_cache_manager.stats.num_host_hit_tokens == 0
    [pinned] = [e for e in recorded(h) if isinstance(e, PinPinned)]
    assert pinned.inputs.source == "preserve"
    # The 2 s the tool took is now bash's expected duration.
    assert h.policy.strategies.retention.model.expected_tool_s("bash") == (2.0, 1)


def test_without_a_tier_swap_is_never_chosen(tmp_path: Path) -> None:
    h = infercept_harness(tmp_path, environment(0.05, 0.0001), num_host_kv_blocks=0)
    h.add("t1", tokens(1, 12), job="J", max_tokens=2)
    h.run_until_finished("t1")
    assert h.policy.strategies.retention.model.reload_cost is None
    [declined] = [e for e in recorded(h) if isinstance(e, PinDeclined)]
    assert declined.inputs.source == "discard"  # 0.7 s of recompute beats 1 s of preserve


def test_without_swap_nothing_is_profiled_and_every_tool_call_is_preserved() -> None:
    profiled: list[str] = []
    env = PolicyEnvironment(profile_prefill=lambda: profiled.append("prefill") or points(1.0),
                            profile_kv_reload=lambda: profiled.append("reload") or points(1.0))
    h = Harness(make_policy("infercept"), environment=env, num_host_kv_blocks=32)
    h.add("t1", tokens(1, 12), job="J", max_tokens=2)
    h.run_until_finished("t1")
    assert h.pin("J") is not None and profiled == []
    assert isinstance(h.policy.strategies.retention, PinUntilNextTurn)


# Continuum's R with the tier.
def continuum_estimator(env: PolicyEnvironment, num_host_kv_blocks: int,
                        **options: str) -> Eq2Estimator:
    policy = make_policy("continuum", options)
    assert isinstance(policy, AgentPolicy)
    Harness(policy, environment=env, num_host_kv_blocks=num_host_kv_blocks)
    inner = policy.strategies.retention.estimator.inner
    assert isinstance(inner, Eq2Estimator)
    return inner


def test_continuums_r_is_the_reload_time_for_a_context_the_tier_holds() -> None:
    env = environment(0.01, 0.001)
    estimator = continuum_estimator(env, num_host_kv_blocks=8)  # 32 tokens of block size 4
    assert estimator.reload_cost is not None and estimator.reload_cost.max_tokens == 32
    assert estimator.rebuild_s(32) == pytest.approx(0.032)
    assert estimator.rebuild_s(33) == pytest.approx(0.33)  # too large for the tier: prefill
    no_tier = continuum_estimator(env, num_host_kv_blocks=0)
    assert no_tier.reload_cost is None and no_tier.rebuild_s(32) == pytest.approx(0.32)


def test_continuums_trace_shows_the_reload_time_as_r(tmp_path: Path) -> None:
    tracer = SchedulerTracer(tmp_path / "trace.jsonl", config={"test": True})
    h = Harness(make_policy("continuum"), environment=environment(0.01, 0.001),
                num_host_kv_blocks=8, tracer=tracer)
    h.add("t1", tokens(1, 12), job="J", max_tokens=2)
    h.run_until_finished("t1")
    [decision] = [e for e in recorded(h) if isinstance(e, PinPinned | PinDeclined)]
    assert decision.inputs.rebuild_s == pytest.approx(14 * 0.001)


# Random agent jobs under InferCept with swap and a host tier.
turn = st.builds(Turn, appended_tokens=st.integers(1, 12), output_tokens=st.integers(1, 6),
                 tool_s=st.sampled_from([0.0, 0.05, 0.3, 1.0, 4.0]),
                 tool_name=st.sampled_from([None, "bash", "grep"]))
job_shape = st.tuples(st.floats(0.0, 2.0), st.lists(turn, min_size=1, max_size=4))
seconds_per_token = st.sampled_from([1e-5, 1e-3, 0.02, 0.2])


class RecordingSources:
    """A subscriber that keeps the source of every retention the scheduler carried out."""

    def __init__(self) -> None:
        self.sources: list[str] = []

    def started(self, event) -> None:
        pass

    def receive(self, event) -> bool:
        if isinstance(event, events.RetentionDecided):
            self.sources.append(event.inputs.source)
        return True

    def close(self) -> None:
        pass


@settings(max_examples=80, deadline=None)
@given(
    shapes=st.lists(job_shape, min_size=1, max_size=8),
    num_blocks=st.integers(8, 28),
    num_host_kv_blocks=st.integers(0, 48),
    prefill_s=seconds_per_token,
    reload_s=seconds_per_token,
    default_tool_s=st.sampled_from([0.0, 0.01, 1.0]),
    max_num_seqs=st.integers(1, 6),
    seed=st.integers(0, 1000),
)
def test_random_jobs_under_infercept_swap_finish_without_leaks(
    shapes, num_blocks, num_host_kv_blocks, prefill_s, reload_s, default_tool_s, max_num_seqs,
    seed,
) -> None:
    jobs = []
    for index, (arrival_s, turns) in enumerate(shapes):
        last = Turn(turns[-1].appended_tokens, turns[-1].output_tokens, tool_s=None)
        jobs.append(AgentJob(f"job{index}", arrival_s, (*turns[:-1], last)))
    jobs = [job for job in jobs if job.num_tokens <= num_blocks * 4]
    if not jobs:
        return
    policy = INFERCEPT.build(InferCeptOptions(swap=True, default_tool_duration_s=default_tool_s))
    recorder = RecordingSources()
    # replay() checks both tiers' invariants after every step (the fake runner checks that
    # every load brings back the right tokens), that every job finishes, and that nothing
    # is left behind.
    result = replay(jobs, policy, num_blocks=num_blocks, max_num_seqs=max_num_seqs,
                    max_num_batched_tokens=32, seed=seed, max_steps=20_000,
                    num_host_kv_blocks=num_host_kv_blocks, tracer=recorder,  # type: ignore[arg-type]
                    environment=environment(prefill_s, reload_s))
    assert sorted(result.job_completion_s) == sorted(job.job_id for job in jobs)
    assert policy.num_jobs == 0
    for source in sorted(set(recorder.sources)):
        event(f"chose {source}")
