"""Measured cost profiles: the file round-trips, bad files are refused with their reason,
profiles are found by name or path, and the simulated executor prices steps with one."""

from __future__ import annotations

import json
from datetime import date
from pathlib import Path

import pytest

from engine.config import CacheConfig, SchedulerConfig
from engine.engine_args import EngineArgs
from engine.executor.measured import (
    MeasuredProfile,
    TraceFit,
    read_measured_profile,
    write_measured_profile,
)
from engine.executor.roofline import SIM_PROFILES
from engine.executor.sim_profiles import get_sim_profile, sim_profile_names
from engine.executor.simulated import SimulatedExecutor
from engine.executor.step_cost import StepCostModel
from engine.kv_cache.transfers import KVTransfers
from tests.engine.executor.test_simulated import sim_config, step_output

SHIPPED = "h100-llama3.1-8b-measured"
MODEL = StepCostModel(step_overhead_s=0.03, prefill_token_s=2e-5, prefill_query_s=0.06,
                      decode_query_s=1e-3, context_token_s=0.0, attention_pair_s=5e-9)


def measured(**overrides: object) -> MeasuredProfile:
    fields = {"name": "toy-measured", "base": SIM_PROFILES["h100-llama3.1-8b"],
              "step_cost": MODEL, "measured_on": date(2026, 11, 22), "engine_commit": "abc1234",
              "command": "continuum bench calibrate --trace t.jsonl.gz",
              "fits": (TraceFit("t.jsonl.gz", True, 10, 1.0, 1.1, 0.7, 0.01),), **overrides}
    return MeasuredProfile(**fields)  # type: ignore[arg-type]


@pytest.fixture
def profile_path(tmp_path: Path) -> Path:
    path = tmp_path / "toy.json"
    write_measured_profile(measured(), path)
    return path


def test_a_profile_file_round_trips(profile_path: Path) -> None:
    profile = read_measured_profile(profile_path)
    assert profile == measured()
    assert profile.fits[0].total_error == pytest.approx(0.1)
    base = SIM_PROFILES["h100-llama3.1-8b"]
    assert (profile.model, profile.num_kv_tokens) == (base.model, base.num_kv_tokens)
    assert profile.kv_copy_time_s(1000) == base.kv_copy_time_s(1000)
    assert profile.prefill_time_s(100) == MODEL.step_time_s([(0, 100)])


def _edited(path: Path, edit) -> Path:
    document = json.loads(path.read_text())
    edit(document)
    path.write_text(json.dumps(document))
    return path


@pytest.mark.parametrize(("edit", "reason"), [
    (lambda d: d.update(format="other"), "'format' is not"),
    (lambda d: d.update(version=2), "version 2"),
    (lambda d: d.pop("engine_commit"), "missing field 'engine_commit'"),
    (lambda d: d["step_cost"].pop("decode_query_s"), "needs exactly the fields"),
    (lambda d: d["step_cost"].update(decode_query_s=-1.0), "decode_query_s must be a finite"),
    (lambda d: d["step_cost"].update(decode_query_s="fast"), "decode_query_s must be a number"),
    (lambda d: d.update(base_profile="tpu"), "unknown base profile 'tpu'"),
    (lambda d: d.update(measured_on="yesterday"), "isoformat"),
    (lambda d: d.update(command=""), "command is empty"),
])
def test_a_bad_profile_file_is_refused_with_its_reason(profile_path: Path, edit,
                                                       reason: str) -> None:
    _edited(profile_path, edit)
    with pytest.raises(ValueError, match=f"{profile_path} is not a measured cost profile: .*"
                                         f"{reason}"):
        read_measured_profile(profile_path)


def test_files_that_are_not_profiles_are_refused(tmp_path: Path) -> None:
    for name, content in (("empty.json", ""), ("list.json", "[1, 2]")):
        (tmp_path / name).write_text(content)
        with pytest.raises(ValueError, match="is not a measured cost profile"):
            read_measured_profile(tmp_path / name)
    with pytest.raises(ValueError, match="is not a measured cost profile"):
        read_measured_profile(tmp_path / "missing.json")


def test_profiles_are_found_by_name_or_path(profile_path: Path) -> None:
    assert SHIPPED in sim_profile_names() and "h100-llama3.1-8b" in sim_profile_names()
    assert get_sim_profile("h100-llama3.1-8b") is SIM_PROFILES["h100-llama3.1-8b"]
    assert get_sim_profile(str(profile_path)) == measured()
    with pytest.raises(ValueError, match=f"unknown sim profile 'h200'.*{SHIPPED}"):
        get_sim_profile("h200")


def test_the_shipped_profile_says_what_it_measured() -> None:
    profile = get_sim_profile(SHIPPED)
    assert isinstance(profile, MeasuredProfile) and profile.name == SHIPPED
    assert profile.engine_commit == "af226d3" and profile.measured_on.year >= 2026
    assert profile.command.startswith("continuum bench calibrate ")
    assert {fit.used_for_fit for fit in profile.fits} == {True, False}  # fitted and held out
    # Slower than the roofline: the engine on the GPU was far from the hardware's limits.
    roofline = SIM_PROFILES[profile.base.name]
    assert profile.step_time_s([(1000, 1)] * 8) > 2 * roofline.step_time_s([(1000, 1)] * 8)


def test_the_simulated_executor_prices_steps_with_a_profile_file(profile_path: Path) -> None:
    config = sim_config(sim_profile=str(profile_path), cache=CacheConfig(),
                        scheduler=SchedulerConfig(max_model_len=1024))
    slept: list[float] = []
    executor = SimulatedExecutor(config, sleep=slept.append)
    assert executor.num_kv_blocks == SIM_PROFILES["h100-llama3.1-8b"].num_kv_tokens // 16
    executor.execute(step_output(KVTransfers(), prompt_len=40))
    assert slept == [pytest.approx(MODEL.step_time_s([(0, 40)]))]
    flags = EngineArgs(executor="simulated", sim_profile=str(profile_path),
                       max_model_len=512).to_engine_config(environ={})
    assert flags.sim_profile == str(profile_path)
