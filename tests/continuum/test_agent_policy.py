"""The Continuum policy's rules (docs/architecture.md, 'The policies'), one scenario each, on
a real scheduler with a fake clock and a fake runner."""

from __future__ import annotations

import pytest

from continuum.agent_policy import AgentPolicy
from continuum.policy_options import ContinuumOptions
from continuum.presets import CONTINUUM
from engine.kv_cache.pins import PinReleaseReason
from engine.request import RequestStatus
from engine.scheduler.policies import FCFSPolicy
from estimator.ttl_estimator import ConstantTTLEstimator, ObservationSink, ToolCall, TTLDecision
from eval.policy_variants import CONTINUUM_AF226D3
from tests.continuum.harness import Harness, tokens


class TTLByTool(ObservationSink):
    """Test estimator: a TTL per tool name (0 for others), and a log of observations."""

    def __init__(self, ttl_by_tool: dict[str | None, float]) -> None:
        self.ttl_by_tool = ttl_by_tool
        self.log: list[tuple] = []

    def decide(self, call: ToolCall) -> TTLDecision:
        return TTLDecision(self.ttl_by_tool.get(call.tool_name, 0.0), "test")

    def observe_tool_call(self, call: ToolCall) -> None:
        self.log.append(("call", call.job_id, call.tool_name, call.finished_at_s,
                         call.num_context_tokens, call.turn_index))

    def observe_next_turn(self, job_id: str, arrived_at_s: float) -> None:
        self.log.append(("next", job_id, arrived_at_s))

    def observe_queueing_delay(self, delay_s: float) -> None:
        self.log.append(("delay", delay_s))

    def observe_job_end(self, job_id: str, num_turns: int) -> None:
        self.log.append(("end", job_id, num_turns))


def continuum(ttl_s: float = 5.0, **options) -> AgentPolicy:
    """Continuum pinning every tool-calling turn for `ttl_s`, with the given options."""
    return CONTINUUM.build(ContinuumOptions(**options), estimator=ConstantTTLEstimator(ttl_s))


@pytest.mark.parametrize(("job", "last", "ttl_s", "pinned"), [
    (None, False, 5.0, False),  # requests without a job are never pinned
    ("J", False, 5.0, True),  # a non-final turn is pinned for the estimator's TTL
    ("J", False, 0.0, False),  # a TTL of 0 means no pin
    ("J", True, 5.0, False),  # a last step is never pinned
])
def test_retention(job: str | None, last: bool, ttl_s: float, pinned: bool) -> None:
    h = Harness(continuum(ttl_s))
    h.clock.advance(7.0)
    h.add("r", tokens(1, 10), job=job, last=last, max_tokens=3)
    h.run_until_finished("r")
    pin = h.pin("J")
    assert (pin is not None) == pinned
    assert len(h.scheduler.pins) == int(pinned)
    if pinned:
        assert (pin.request_id, pin.ttl_s, pin.deadline_s) == ("r", ttl_s, 7.0 + ttl_s)
        assert pin.num_blocks == 3  # 10 prompt + 3 output tokens, the last one never computed


def test_a_last_step_ends_the_jobs_state_and_releases_its_pin() -> None:
    h = Harness(continuum())
    h.add("t1", tokens(1, 10), job="J")
    h.run_until_finished("t1")
    assert h.pin("J") is not None and h.policy.job_state("J") is not None
    h.next_turn("t2", "t1", tokens(50, 3), last=True)
    h.run_until_finished("t2")
    assert h.pin("J") is None and h.policy.job_state("J") is None
    assert h.scheduler.pins.num_released == {PinReleaseReason.REUSED: 1}
    assert h.policy.num_jobs == 0


@pytest.mark.parametrize(("policy", "expected_hit_tokens"), [
    (FCFSPolicy, 0),  # the other requests evicted the turn's blocks during the tool call
    # Pins held against the blocked head: prompt + output, minus the partial last block.
    (lambda: continuum(5.0), 12),
])
def test_a_pinned_turns_next_turn_hits_its_whole_context(policy, expected_hit_tokens) -> None:
    h = Harness(policy(), num_blocks=16)
    h.add("t1", tokens(1, 10), job="J", max_tokens=3)
    h.run_until_finished("t1")
    # During the tool call, two other requests want 7 + 9 of the 16 blocks.
    h.add("b", tokens(100, 26), max_tokens=2)
    h.add("c", tokens(200, 34), max_tokens=2)
    h.step(dt_s=0.1)
    h.next_turn("t2", "t1", tokens(50, 5))
    h.run_until_finished("t2", "b", "c")
    assert h.requests["t2"].num_cached_tokens == expected_hit_tokens
    if expected_hit_tokens:
        assert h.scheduler.pins.num_released[PinReleaseReason.REUSED] == 1
        # The pinned job's turn went ahead of the older waiting request.
        assert h.admission_order().index("t2") < h.admission_order().index("c")


@pytest.mark.parametrize(("policy", "advance_s", "next_turn_waits", "expired"), [
    ("continuum", 5.0, False, False),  # expiry needs now > deadline
    ("continuum", 5.01, False, True),
    # The next turn waits, but is not admitted in that step: a deadline is a hard end,
    # whatever the policy (the scheduler's rule).
    ("continuum", 5.01, True, True),
    ("continuum-af226d3", 5.01, True, True),
])
def test_pin_expiry(policy: str, advance_s: float, next_turn_waits: bool,
                    expired: bool) -> None:
    h = Harness(continuum(5.0) if policy == "continuum" else CONTINUUM_AF226D3.build(
        estimator=ConstantTTLEstimator(5.0)), max_num_seqs=1)
    h.add("t1", tokens(1, 10), job="J")
    h.run_until_finished("t1")
    if next_turn_waits:
        h.add("busy", tokens(100, 8), max_tokens=20)
        h.step()
        h.next_turn("t2", "t1", tokens(50, 3))
    h.clock.advance(advance_s)
    h.step()
    pin = h.pin("J")
    assert (pin is None) == expired
    if expired:
        assert h.scheduler.pins.num_released == {PinReleaseReason.EXPIRED: 1}
    if next_turn_waits:
        assert h.waiting_ids == ["t2"]
        h.run_until_finished("t2")
        reason = PinReleaseReason.EXPIRED if expired else PinReleaseReason.REUSED
        assert h.scheduler.pins.num_released == {reason: 1}
        assert h.requests["t2"].num_cached_tokens == 8  # its blocks were not evicted since


def test_a_jobs_new_pin_replaces_its_old_one() -> None:
    h = Harness(continuum())
    h.add("a", tokens(1, 10), job="J", max_tokens=1)
    h.add("b", tokens(1, 10) + tokens(60, 6), job="J", max_tokens=4)
    h.run_until_finished("a")
    assert h.pin("J").request_id == "a"
    h.run_until_finished("b")
    assert h.pin("J").request_id == "b" and len(h.scheduler.pins) == 1
    assert h.scheduler.pins.num_released == {PinReleaseReason.REPLACED: 1}
    state = h.policy.job_state("J")
    assert (state["num_pins_created"], state["pins_released"]) == (2, {"replaced": 1})


def test_waiting_order_is_pinned_jobs_then_first_arrival_of_the_job() -> None:
    estimator = TTLByTool({"search": 30.0})
    h = Harness(CONTINUUM.build(estimator=estimator),
                max_num_seqs=1)
    h.add("a1", tokens(1, 6), job="A", tool="bash")
    h.run_until_finished("a1")
    h.add("b1", tokens(100, 6), job="B", tool="search")
    h.run_until_finished("b1")
    assert h.pin("A") is None and h.pin("B") is not None
    h.add("busy", tokens(200, 4), max_tokens=3)
    h.step()
    h.add("p", tokens(300, 4))
    h.next_turn("a2", "a1", tokens(50, 2))
    h.next_turn("b2", "b1", tokens(150, 2))
    h.clock.advance(1.0)
    h.add("c1", tokens(400, 4), job="C")
    # B holds a pin; then by first arrival: A, then the new job C; the plain request p goes
    # ahead of the turns that arrived after it (a2 among them), though A's job is older.
    assert h.waiting_ids == ["b2", "p", "a2", "c1"]
    h.run_until_finished("b2", "a2", "p", "c1")
    assert h.admission_order()[-4:] == ["b2", "p", "a2", "c1"]


def test_a_broken_pin_drops_its_waiting_turn_back_to_first_arrival_order() -> None:
    h = Harness(CONTINUUM.build(estimator=TTLByTool({"search": 30.0})), max_num_seqs=1)
    h.add("o1", tokens(1, 6), job="O", tool="bash")
    h.run_until_finished("o1")
    h.add("a1", tokens(100, 6), job="A", tool="search")
    h.run_until_finished("a1")
    h.add("busy", tokens(200, 4), max_tokens=3)
    h.step()
    h.next_turn("o2", "o1", tokens(50, 2))
    h.next_turn("a2", "a1", tokens(150, 2))
    assert h.waiting_ids == ["a2", "o2"]
    h.scheduler.pins.release("A", PinReleaseReason.PRESSURE, now_s=0.0)
    assert h.waiting_ids == ["o2", "a2"]
    h.run_until_finished("o2", "a2")
    assert h.admission_order()[-2:] == ["o2", "a2"]


def test_under_pressure_pins_are_released_before_any_request_is_preempted() -> None:
    # 16 blocks: J's pin holds 2; x and y (no job) then grow until they need them.
    h = Harness(continuum(100.0), num_blocks=16)
    h.add("t1", tokens(1, 8), job="J", max_tokens=2)
    h.run_until_finished("t1")
    assert h.pin("J").num_blocks == 2
    h.add("x", tokens(100, 20), max_tokens=20)
    h.add("y", tokens(200, 20), max_tokens=20)
    h.run_until_finished("x", "y")
    assert h.pin("J") is None
    assert h.scheduler.pins.num_released == {PinReleaseReason.PRESSURE: 1}


def test_af226d3_preempted_other_requests_before_breaking_pins() -> None:
    # 16 blocks: J's pin holds 2; x and y (no job) then grow until one must give way.
    h = Harness(CONTINUUM_AF226D3.build(estimator=ConstantTTLEstimator(100.0)), num_blocks=16)
    h.add("t1", tokens(1, 8), job="J", max_tokens=2)
    h.run_until_finished("t1")
    assert h.pin("J").num_blocks == 2
    h.add("x", tokens(100, 20), max_tokens=20)
    h.add("y", tokens(200, 20), max_tokens=20)
    h.run_until_finished("x", "y")
    assert h.scheduler.num_preemptions > 0
    assert h.pin("J") is not None  # never broken: another request could always give way


def test_when_the_needy_request_is_alone_pins_are_broken_latest_job_first() -> None:
    h = Harness(continuum(100.0), num_blocks=16)
    for index, job in enumerate(("J0", "J1", "J2")):
        h.add(f"{job}-t1", tokens(100 * (index + 1), 12), job=job, max_tokens=2)
        h.run_until_finished(f"{job}-t1")
    assert h.scheduler.pins.num_pinned_blocks == 9
    h.add("x", tokens(900, 8), max_tokens=40)  # grows to 12 blocks: needs 5 of the pins' 9
    h.run_until_finished("x")
    assert h.scheduler.num_preemptions == 0
    assert [job for job in ("J0", "J1", "J2") if h.pin(job)] == ["J0"]
    assert h.scheduler.pins.num_released == {PinReleaseReason.PRESSURE: 2}


@pytest.mark.parametrize("something_runs", [True, False])
def test_pins_give_way_to_a_blocked_head_at_once_when_nothing_runs(something_runs: bool) -> None:
    h = Harness(continuum(100.0), num_blocks=16)
    for index, job in enumerate(("J0", "J1")):
        h.add(f"{job}-t1", tokens(100 * (index + 1), 20), job=job, max_tokens=2)
        h.run_until_finished(f"{job}-t1")
    assert h.scheduler.pins.num_pinned_blocks == 10
    if something_runs:
        h.add("small", tokens(500, 4), max_tokens=30)
        h.step()
    h.add("big", tokens(900, 30), max_tokens=2)  # 8 blocks: more than are free
    h.step()
    if something_runs:
        assert h.waiting_ids == ["big"] and len(h.scheduler.pins) == 2
        h.run_until_finished("small")
    h.run_until_finished("big")
    assert [job for job in ("J0", "J1") if h.pin(job)] == ["J0"]  # the latest job's went
    assert h.scheduler.pins.num_released == {PinReleaseReason.PRESSURE: 1}


def test_pins_give_way_to_a_head_that_waited_past_the_bound_while_others_run() -> None:
    h = Harness(continuum(100.0, max_plain_wait_s=2.0), num_blocks=16)
    for index, job in enumerate(("J0", "J1")):
        h.add(f"{job}-t1", tokens(100 * (index + 1), 20), job=job, max_tokens=2)
        h.run_until_finished(f"{job}-t1")
    h.add("small", tokens(500, 4), max_tokens=60)
    h.step()
    h.add("big", tokens(900, 30), max_tokens=2)  # 8 blocks: more than are free
    h.step(dt_s=1.0)
    h.step(dt_s=0.9)
    assert h.waiting_ids == ["big"] and len(h.scheduler.pins) == 2  # waited 1.9 s
    h.step(dt_s=0.1)
    h.step()  # waited 2.0 s: J1's pin (the latest job's) yields while small still runs
    assert "small" in h.running_ids and "big" in h.running_ids
    assert [job for job in ("J0", "J1") if h.pin(job)] == ["J0"]
    assert h.scheduler.pins.num_released == {PinReleaseReason.PRESSURE: 1}


def test_explicit_release_ends_the_job() -> None:
    h = Harness(continuum())
    h.add("t1", tokens(1, 10), job="J")
    h.run_until_finished("t1")
    assert h.scheduler.end_job("J") is not None
    assert h.pin("J") is None and h.policy.job_state("J") is None
    assert h.scheduler.pins.num_released == {PinReleaseReason.RELEASE: 1}


@pytest.mark.parametrize(("advance_s", "forgotten"), [(599.0, False), (601.0, True)])
def test_idle_jobs_are_forgotten_after_the_timeout(advance_s: float, forgotten: bool) -> None:
    h = Harness(continuum(ttl_s=0.0), max_num_seqs=4)
    h.add("t1", tokens(1, 10), job="J")
    h.run_until_finished("t1")
    h.clock.advance(advance_s)
    h.step()
    assert (h.policy.job_state("J") is None) == forgotten


def test_a_pinned_job_is_not_forgotten_while_its_pin_lives() -> None:
    h = Harness(continuum(ttl_s=1000.0), max_num_seqs=4)
    h.add("t1", tokens(1, 10), job="J")
    h.run_until_finished("t1")
    h.clock.advance(900.0)
    h.step()
    assert h.policy.job_state("J") is not None
    h.clock.advance(101.0)
    h.step()  # the pin expires: the job, idle for 1001 s, goes with it
    assert h.pin("J") is None and h.policy.job_state("J") is None and h.policy.num_jobs == 0


def test_job_state_exposes_turns_pins_and_ttls() -> None:
    h = Harness(continuum(4.0))
    h.clock.advance(3.0)
    h.add("t1", tokens(1, 10), job="J")
    h.run_until_finished("t1")
    h.next_turn("t2", "t1", tokens(50, 3))
    state = h.policy.job_state("J")
    assert state["first_arrival_s"] == 3.0
    assert (state["num_turns_arrived"], state["num_turns_finished"]) == (2, 1)
    assert (state["num_pins_created"], state["last_ttl_s"], state["pins_released"]) == (
        1, 4.0, {})
    assert state["last_tool_name"] == "bash"
    h.step()
    assert h.policy.job_state("J")["pins_released"] == {"reused": 1}


def test_the_estimator_sees_tool_calls_next_turns_delays_and_job_ends() -> None:
    estimator = TTLByTool({"grep": 10.0})
    h = Harness(CONTINUUM.build(estimator=estimator))
    h.add("t1", tokens(1, 10), job="J", tool="grep", max_tokens=3)
    h.run_until_finished("t1")
    finished_s = h.clock()
    h.clock.advance(0.5)
    h.next_turn("t2", "t1", tokens(50, 3), tool="ls")
    h.run_until_finished("t2")  # reused the pin: no queueing delay to report
    h.clock.advance(2.0)
    h.next_turn("t3", "t2", tokens(60, 3), last=True)
    h.clock.advance(0.25)
    h.run_until_finished("t3")  # found no pin (TTL 0 for ls): waited 0.25 s
    assert estimator.log == [
        ("call", "J", "grep", finished_s, 13, 0),
        ("next", "J", finished_s + 0.5),
        ("call", "J", "ls", finished_s + 0.5, 18, 1),
        ("next", "J", finished_s + 2.5),
        ("delay", 0.25),
        ("end", "J", 3),
    ]


def test_an_aborted_turn_releases_its_jobs_pin_and_is_not_pinned() -> None:
    h = Harness(continuum())
    h.add("t1", tokens(1, 10), job="J")
    h.run_until_finished("t1")
    h.next_turn("t2", "t1", tokens(50, 3), max_tokens=10)
    h.scheduler.finish_requests(["t2"])
    assert h.requests["t2"].status is RequestStatus.FINISHED_ABORTED
    assert h.pin("J") is None
    assert h.scheduler.pins.num_released == {PinReleaseReason.ABORT: 1}
    h.step()
    assert h.scheduler.kv_cache_manager.block_pool.num_free_blocks == 32


@pytest.mark.parametrize("ttl_s", [0.0, 5.0])
def test_turns_of_an_ended_job_never_touch_a_new_job_with_the_same_id(ttl_s: float) -> None:
    h = Harness(continuum(ttl_s), max_num_seqs=4)
    h.add("old", tokens(1, 10), job="J", max_tokens=5)
    h.step()
    h.scheduler.end_job("J")  # a client released the job while its turn runs
    h.add("new1", tokens(300, 6), job="J", max_tokens=2)
    h.run_until_finished("old", "new1")
    job = h.policy.ledger.jobs.get("J")
    assert (job.num_turns_arrived, job.num_turns_finished, job.num_unfinished_turns) == (1, 1, 0)
    pin = h.pin("J")
    assert (pin is not None and pin.request_id) == (ttl_s > 0 and "new1")
    assert job.attained_service_tokens == 8


def test_aborted_turns_do_not_count_as_finished_turns() -> None:
    h = Harness(continuum())
    h.add("t1", tokens(1, 10), job="J", max_tokens=8)
    h.step()
    h.scheduler.finish_requests(["t1"])
    job = h.policy.ledger.jobs.get("J")
    assert (job.num_turns_finished, job.num_unfinished_turns, job.attained_service_tokens) == (
        0, 0, 0)
    assert h.pin("J") is None


class CallRecorder(TTLByTool):
    """Test estimator: `TTLByTool` that keeps every call it decides."""

    def __init__(self) -> None:
        super().__init__({})
        self.calls: list[ToolCall] = []

    def decide(self, call: ToolCall) -> TTLDecision:
        self.calls.append(call)
        return super().decide(call)


def test_a_tool_call_names_the_pool_shares_of_its_context_and_of_the_running_requests() -> None:
    recorder = CallRecorder()
    h = Harness(CONTINUUM.build(ContinuumOptions(), estimator=recorder))  # 32 blocks of 4
    h.add("long", tokens(100, 20), max_tokens=40)
    h.add("t1", tokens(1, 10), job="J", max_tokens=3)
    h.run_until_finished("t1")
    [call] = recorder.calls
    pool_tokens = 32 * 4
    assert call.num_running_requests == 1 and call.num_waiting_requests == 0
    assert call.pool_share == pytest.approx(12 / pool_tokens)  # 10 prompt + 2 computed outputs
    running = h.requests["long"].num_computed_tokens
    assert running > 20
    assert call.running_pool_share == pytest.approx(running / pool_tokens)
