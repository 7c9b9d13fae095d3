"""The agent baselines as scheduler policies: continuum-fixed, InferCept and Autellix."""

from __future__ import annotations

from continuum.agent_policy import AgentPolicy
from continuum.policy_options import InferCeptOptions
from continuum.presets import AUTELLIX, CONTINUUM_FIXED, INFERCEPT
from engine.kv_cache.pins import PinReleaseReason
from engine.scheduler.policy_registry import make_policy
from tests.continuum.harness import Harness, tokens


def test_registry_names_the_agent_policies() -> None:
    for name in ("continuum", "continuum-fixed", "job-fcfs", "infercept", "autellix"):
        policy = make_policy(name)
        assert isinstance(policy, AgentPolicy) and policy.name == name


def test_continuum_fixed_pins_two_seconds_unless_the_tool_is_known_to_be_slower() -> None:
    h = Harness(CONTINUUM_FIXED.build())
    h.add("t1", tokens(1, 6), job="J", tool="slow")
    h.run_until_finished("t1")
    assert h.pin("J").ttl_s == 2.0  # unknown tool: pinned
    h.clock.advance(3.0)
    h.step()
    assert h.pin("J") is None  # expired
    h.next_turn("t2", "t1", tokens(50, 2), tool="slow")
    h.run_until_finished("t2")  # "slow" took 3 s: its mean is now above 2 s
    assert h.pin("J") is None
    h.clock.advance(1.0)
    h.next_turn("t3", "t2", tokens(60, 2), tool="fast")
    h.run_until_finished("t3")  # "slow" took 3 s again, "fast" is unknown
    assert h.pin("J").ttl_s == 2.0
    h.clock.advance(0.5)
    h.next_turn("t4", "t3", tokens(70, 2), tool="fast")
    h.run_until_finished("t4")
    assert h.pin("J").ttl_s == 2.0  # "fast" took 0.5 s
    assert h.scheduler.pins.num_released == {
        PinReleaseReason.EXPIRED: 1, PinReleaseReason.REUSED: 1,
    }


def test_infercept_preserves_until_the_next_turn_and_gives_pins_up_first() -> None:
    h = Harness(INFERCEPT.build(InferCeptOptions(job_idle_timeout_s=300.0)), num_blocks=16)
    h.add("t1", tokens(1, 12), job="J", max_tokens=2)
    h.run_until_finished("t1")
    assert h.pin("J").ttl_s == 300.0
    h.clock.advance(200.0)
    h.step()
    assert h.pin("J") is not None  # no TTL short of the idle timeout
    h.add("x", tokens(100, 8), max_tokens=2)
    h.step()
    h.add("big", tokens(200, 44), max_tokens=2)  # 11 blocks: while x runs, 10 are free
    h.step()
    assert h.pin("J") is None and "big" in h.running_ids
    assert h.scheduler.pins.num_released == {PinReleaseReason.PRESSURE: 1}


def test_infercept_pins_reach_the_next_turn() -> None:
    h = Harness(INFERCEPT.build())
    h.add("t1", tokens(1, 10), job="J", max_tokens=3)
    h.run_until_finished("t1")
    h.clock.advance(60.0)
    h.next_turn("t2", "t1", tokens(50, 5), last=True)
    h.run_until_finished("t2")
    assert h.requests["t2"].num_cached_tokens == 12
    assert h.pin("J") is None and h.policy.num_jobs == 0


def test_autellix_orders_waiting_turns_by_their_jobs_attained_service() -> None:
    h = Harness(AUTELLIX.build(), max_num_seqs=1)
    h.add("heavy1", tokens(1, 20), job="H", max_tokens=8)
    h.run_until_finished("heavy1")
    h.add("light1", tokens(100, 4), job="L", max_tokens=2)
    h.run_until_finished("light1")
    assert h.policy.ledger.jobs.get("H").attained_service_tokens == 28
    assert h.policy.ledger.jobs.get("L").attained_service_tokens == 6
    h.add("busy", tokens(200, 4), max_tokens=3)
    h.step()
    h.next_turn("heavy2", "heavy1", tokens(50, 2))
    h.next_turn("light2", "light1", tokens(150, 2))
    h.add("new", tokens(300, 4))
    assert h.waiting_ids == ["new", "light2", "heavy2"]
    h.run_until_finished("heavy2", "light2", "new")
    assert h.admission_order()[-3:] == ["new", "light2", "heavy2"]
    assert len(h.scheduler.pins) == 0
