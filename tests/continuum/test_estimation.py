"""The policy's estimator from the engine's settings, and the tool a turn called."""

from __future__ import annotations

import json

import pytest

from continuum.policy import ContinuumFixedPolicy, ContinuumPolicy
from engine.config import EstimatorConfig
from engine.scheduler.policy import PolicyEnvironment
from estimator.eq2 import Eq2Estimator
from estimator.fixed import FixedTTLEstimator
from tests.continuum.harness import Harness
from tests.continuum.test_policy import TTLByTool

BASH_TURN = "THOUGHT: look for it.\n\n```bash\ncd /repo && grep -rn needle src/\n```"


def test_the_tool_is_parsed_from_the_output_unless_the_client_names_it() -> None:
    decoded: list[list[int]] = []

    def decode(token_ids) -> str:
        decoded.append(list(token_ids))
        return BASH_TURN

    estimator = TTLByTool({"grep": 30.0, "ls": 7.0})
    h = Harness(ContinuumPolicy(estimator=estimator),
                environment=PolicyEnvironment(decode=decode))
    h.add("parsed", list(range(8)), job="a")
    h.add("named", list(range(20, 28)), job="b", tool="ls")
    h.run_until_finished("parsed", "named")
    assert decoded == [h.requests["parsed"].output_token_ids]  # only the unnamed turn
    assert h.pin("a").ttl_s == 30.0 and h.pin("b").ttl_s == 7.0
    assert [entry[2] for entry in estimator.log if entry[0] == "call"] == ["grep", "ls"]
    assert h.policy.job_state("a").last_tool_name == "grep"


def test_without_a_decoder_or_a_recognisable_call_the_tool_is_unknown() -> None:
    estimator = TTLByTool({None: 3.0})
    h = Harness(ContinuumPolicy(estimator=estimator),
                environment=PolicyEnvironment(decode=lambda ids: "no tool here"))
    h.add("t", list(range(8)), job="a")
    h.run_until_finished("t")
    assert h.pin("a").ttl_s == 3.0 and h.policy.job_state("a").last_tool_name is None


def test_the_default_estimator_comes_from_the_engines_settings(tmp_path) -> None:
    profiled = []

    def profile_prefill():
        profiled.append(True)
        return [(16, 0.002), (256, 0.03), (1024, 0.2)]

    h = Harness(ContinuumPolicy(), environment=PolicyEnvironment(profile_prefill=profile_prefill))
    estimator = h.policy.estimator
    assert isinstance(estimator, Eq2Estimator) and profiled == [True]
    assert estimator.rebuild_s(1024) == pytest.approx(0.2, rel=0.05)
    fixed = Harness(ContinuumPolicy(), environment=PolicyEnvironment(
        estimator=EstimatorConfig(name="fixed-2s"), profile_prefill=profile_prefill))
    assert isinstance(fixed.policy.estimator, FixedTTLEstimator)
    assert isinstance(Harness(ContinuumFixedPolicy()).policy.estimator, FixedTTLEstimator)
    # A profile file wins over measuring; "none" prices rebuilds at 0.
    path = tmp_path / "profile.json"
    path.write_text(json.dumps([[0, 1.0], [100, 1.0]]))
    from_file = Harness(ContinuumPolicy(), environment=PolicyEnvironment(
        estimator=EstimatorConfig(prefill_profile=str(path)), profile_prefill=profile_prefill))
    assert from_file.policy.estimator.rebuild_s(5000) == pytest.approx(1.0)
    unpriced = Harness(ContinuumPolicy(), environment=PolicyEnvironment(
        estimator=EstimatorConfig(prefill_profile="none"), profile_prefill=profile_prefill))
    assert unpriced.policy.estimator.prefill_cost is None
    assert len(profiled) == 1  # measured only where used: not for fixed-2s, a file or "none"


def test_what_the_estimator_learned_is_saved_at_shutdown(tmp_path) -> None:
    path = tmp_path / "state.json"
    environment = PolicyEnvironment(estimator=EstimatorConfig(state_path=str(path)))
    h = Harness(ContinuumPolicy(), environment=environment)
    h.add("t1", list(range(8)), job="a", tool="cat")
    h.run_until_finished("t1")
    h.step(dt_s=0.5)
    h.next_turn("t2", "t1", [1, 2], last=True)
    h.run_until_finished("t2")
    h.policy.on_shutdown()
    saved = json.loads(path.read_text())
    assert list(saved["tools_s"]) == ["cat"] and saved["job_num_turns"] == [2]
    restarted = Harness(ContinuumPolicy(), environment=environment)
    assert restarted.policy.estimator.state() == saved


def test_an_undecodable_output_leaves_the_tool_unknown_and_the_step_running() -> None:
    def decode(token_ids) -> str:
        raise OverflowError("out of range integral type conversion attempted")

    estimator = TTLByTool({None: 4.0})
    h = Harness(ContinuumPolicy(estimator=estimator), environment=PolicyEnvironment(decode=decode))
    h.add("t", list(range(8)), job="a", tool="  ")  # a blank client name says nothing
    h.run_until_finished("t")
    assert h.pin("a").ttl_s == 4.0 and h.policy.job_state("a").last_tool_name is None
