"""The policy's estimator from its options, the tool a turn called, and an estimator that
can never hurt a step."""

from __future__ import annotations

import json

import pytest

from continuum.agent_policy import AgentPolicy
from continuum.estimation import retention_inputs
from continuum.presets import CONTINUUM, CONTINUUM_FIXED
from engine.scheduler.policy import PolicyEnvironment
from engine.scheduler.policy_registry import make_policy
from estimator.eq2 import Eq2Estimator
from estimator.fixed import FixedTTLEstimator
from estimator.state_file import STATE_FORMAT, read_state
from estimator.ttl_estimator import ToolCall, TTLDecision
from eval.policy_variants import CONTINUUM_AF226D3
from tests.continuum.harness import Harness
from tests.continuum.test_agent_policy import TTLByTool

BASH_TURN = "THOUGHT: look for it.\n\n```bash\ncd /repo && grep -rn needle src/\n```"


def continuum(**options: object) -> AgentPolicy:
    return make_policy("continuum", options)  # type: ignore[return-value]


def estimator_of(policy: AgentPolicy):
    """The guarded estimator of a Continuum policy (bound)."""
    return policy.strategies.retention.estimator  # type: ignore[attr-defined]


def test_the_tool_is_parsed_from_the_output_unless_the_client_names_it() -> None:
    decoded: list[list[int]] = []

    def decode(token_ids) -> str:
        decoded.append(list(token_ids))
        return BASH_TURN

    estimator = TTLByTool({"grep": 30.0, "ls": 7.0})
    h = Harness(CONTINUUM.build(estimator=estimator),
                environment=PolicyEnvironment(decode=decode))
    h.add("parsed", list(range(8)), job="a", tool=None)
    h.add("named", list(range(20, 28)), job="b", tool="ls")
    h.run_until_finished("parsed", "named")
    assert decoded == [h.requests["parsed"].output_token_ids]  # only the unnamed turn
    assert h.pin("a").ttl_s == 30.0 and h.pin("b").ttl_s == 7.0
    assert [entry[2] for entry in estimator.log if entry[0] == "call"] == ["grep", "ls"]
    assert h.policy.job_state("a")["last_tool_name"] == "grep"


def test_a_turn_that_called_no_tool_is_not_pinned_nor_observed() -> None:
    estimator = TTLByTool({None: 3.0, "bash": 3.0})
    h = Harness(CONTINUUM.build(estimator=estimator),
                environment=PolicyEnvironment(decode=lambda ids: "no tool here"))
    h.add("t", list(range(8)), job="a", tool=None)
    h.run_until_finished("t")
    assert h.pin("a") is None and h.policy.job_state("a")["last_tool_name"] is None
    assert not [entry for entry in estimator.log if entry[0] == "call"]
    h.next_turn("t2", "t", [1, 2], tool="bash")
    h.run_until_finished("t2")
    assert h.pin("a").ttl_s == 3.0


def test_the_estimator_comes_from_the_policy_options() -> None:
    profiled = []

    def profile_prefill():
        profiled.append(True)
        return [(16, 0.002), (256, 0.03), (1024, 0.2)]

    environment = PolicyEnvironment(profile_prefill=profile_prefill)
    estimator = estimator_of(Harness(continuum(), environment=environment).policy).inner
    # The engine times prefills once (its environment keeps the first result).
    assert isinstance(estimator, Eq2Estimator) and profiled
    assert estimator.rebuild_s(1024) == pytest.approx(0.2, rel=0.05)
    # Eq. 2 as docs/decisions/0001-0003 chose it: R times the requests a rebuild's steps
    # would slow, pins priced by the memory they hold, the cold-start prior only until the
    # first observed duration (a tool's own durations decide after the paper's K).
    assert (estimator.rebuild_cost, estimator.pin_cost) == ("prefill-times-running",
                                                            "priced-capped")
    assert (estimator.cold_start_samples, estimator.min_tool_samples) == (0, 100)
    fixed = Harness(continuum(estimator="fixed-2s"), environment=environment)
    assert isinstance(estimator_of(fixed.policy).inner, FixedTTLEstimator)
    assert isinstance(estimator_of(Harness(CONTINUUM_FIXED.build()).policy).inner,
                      FixedTTLEstimator)
    # Measured where used: the order prices each job's service by it, and Eq. 2 its R, but
    # the fixed rule prices nothing.
    assert len(profiled) == 3
    capped = estimator_of(Harness(continuum(max_ttl_s="30"), environment=environment).policy)
    assert capped.inner.max_ttl_s == 30.0
    measured = estimator_of(Harness(CONTINUUM_AF226D3.build(), environment=environment).policy)
    assert (measured.inner.rebuild_cost, measured.inner.pin_cost) == ("prefill", "ttl")
    assert measured.inner.cold_start_samples == 100  # as af226d3 ran it
    learned = Harness(continuum(estimator="eq2-learned"), environment=environment)
    assert estimator_of(learned.policy).inner.cold_start_samples == 0


@pytest.mark.parametrize(("options", "message"), [
    ({"estimator": "eq3"}, "estimator"),
    ({"service_weight": "-1"}, "service_weight"),
    ({"service_weight": "inf"}, "service_weight"),
    ({"pin_lead_s": "-1"}, "pin_lead_s"),
    ({"max_pinned_fraction": "1.5"}, "max_pinned_fraction"),
    ({"max_ttl_s": "inf"}, "max_ttl_s"),
    ({"service-weight": "x"}, "service_weight"),
    ({"max_wait_s": "30"}, "unknown option 'max_wait_s'"),
    ({"max_plain_wait_s": "-2"}, "max_plain_wait_s"),
    ({"job_idle_timeout_s": "0"}, "job_idle_timeout_s"),
    ({"estimator_state": ""}, "estimator_state"),
    ({"ttl": "3"}, "unknown option 'ttl'"),
    ({"pin_yield_wait_s": "5"}, "unknown option 'pin_yield_wait_s'"),
])
def test_bad_options_are_refused_with_their_name(options: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        continuum(**options)


def test_what_the_estimator_learned_is_saved_at_shutdown(tmp_path) -> None:
    path = tmp_path / "state.json"
    h = Harness(continuum(estimator_state=str(path)))
    h.add("t1", list(range(8)), job="a", tool="cat")
    h.run_until_finished("t1")
    h.step(dt_s=0.5)
    h.next_turn("t2", "t1", [1, 2], last=True)
    h.run_until_finished("t2")
    h.scheduler.close_subscribers()
    saved = read_state(path)
    assert json.loads(path.read_text())["format"] == STATE_FORMAT
    assert list(saved["tools_s"]) == ["cat"] and saved["job_num_turns"] == [2]
    restarted = Harness(continuum(estimator_state=str(path)))
    assert estimator_of(restarted.policy).state() == saved


def _overflowing_state() -> dict:
    huge = [1.7e308] * 4  # each finite; their sum is not
    return {"version": 1, "cold_start_samples": 100, "pooled_s": huge, "tools_s": {"ls": huge},
            "queueing_delays_s": huge, "job_num_turns": [3, 4], "prefill_cost": None,
            "records": []}


@pytest.mark.parametrize("content", [
    b"\x00{not json", b"[server]\napi_key = 'not a state'\n", b'{"some": "json"}'])
def test_a_state_file_that_is_not_a_state_is_refused_and_kept(tmp_path, content) -> None:
    path = tmp_path / "state.json"
    path.write_bytes(content)
    with pytest.raises(ValueError, match=r"estimator_state: .* not a file the engine wrote"):
        continuum(estimator_state=str(path))
    assert path.read_bytes() == content


@pytest.mark.parametrize("source", ["/dev/zero", "/dev/null"])
def test_a_state_path_that_is_a_device_is_refused(source) -> None:
    # A save renames a file over the path: a device node would be replaced.
    with pytest.raises(ValueError, match=r"estimator_state: .* is not a regular file"):
        continuum(estimator_state=source)


def test_a_state_file_that_does_not_load_starts_cold_and_the_engine_keeps_serving(
        tmp_path) -> None:
    path = tmp_path / "state.json"
    path.write_text(json.dumps(_overflowing_state()))  # a state, but an unsound one
    h = Harness(continuum(estimator_state=str(path)), num_blocks=64)
    assert estimator_of(h.policy).inner.state()["pooled_s"] == []  # cold
    for index in range(3):
        h.add(f"t{index}", list(range(100 * index, 100 * index + 8)), job=f"j{index}",
              tool="ls")
        h.run_until_finished(f"t{index}")
        h.step(dt_s=0.3)


class FailingEstimator:
    """Raises from every method, as a buggy or poisoned estimator might."""

    def decide(self, call: ToolCall) -> TTLDecision:
        raise OverflowError("intermediate overflow in fsum")

    def __getattr__(self, name: str):
        def fail(*args, **kwargs):
            raise ArithmeticError(f"{name} failed")
        return fail


def test_an_estimator_that_raises_costs_a_pin_never_a_step(caplog) -> None:
    h = Harness(CONTINUUM.build(estimator=FailingEstimator()))  # type: ignore[arg-type]
    h.add("t1", list(range(8)), job="a", tool="ls")
    h.run_until_finished("t1")
    assert h.pin("a") is None
    h.step(dt_s=0.5)
    h.next_turn("t2", "t1", [1, 2], last=True)
    h.run_until_finished("t2")
    assert h.policy.num_jobs == 0 and len(h.scheduler.pins) == 0
    assert estimator_of(h.policy).num_failures["decide"] == 1
    assert "the TTL estimator failed in decide" in caplog.text


def test_an_undecodable_output_leaves_the_tool_unknown_and_the_step_running() -> None:
    def decode(token_ids) -> str:
        raise OverflowError("out of range integral type conversion attempted")

    estimator = TTLByTool({None: 4.0})
    h = Harness(CONTINUUM.build(estimator=estimator), environment=PolicyEnvironment(decode=decode))
    h.add("t", list(range(8)), job="a", tool="  ")  # a blank client name says nothing
    h.run_until_finished("t")
    assert h.pin("a") is None and h.policy.job_state("a")["last_tool_name"] is None


def test_the_traced_inputs_carry_the_decisions_memory_price() -> None:
    call = ToolCall("j", "ls", 0.0, 1000, 0)
    decision = TTLDecision(1.5, "tool", num_samples=7, queueing_delay_s=0.25, eta=0.5,
                           rebuild_s=2.0, benefit_s=2.125, memory_price=0.75)
    inputs = retention_inputs(call, decision)
    assert (inputs.ttl_s, inputs.tool, inputs.benefit_s, inputs.memory_price) == (
        1.5, "ls", 2.125, 0.75)
    assert retention_inputs(call, TTLDecision(0.0, "fixed")).memory_price is None
