"""torch's intra-op threads: a core process beside its frontend leaves it a core."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest

from engine.config import EngineConfig, ModelConfig
from engine.core.client import SyncMPClient
from engine.core.cpu_threads import for_core_process
from engine.cpu_cores import usable_cores
from engine.executor.torch_executor import cpu_threads
from tests.engine.core.conftest import SMALL_CONFIG


def _small(model: ModelConfig) -> EngineConfig:
    return dataclasses.replace(SMALL_CONFIG, model=dataclasses.replace(
        model, max_model_len=SMALL_CONFIG.model.max_model_len))


@pytest.mark.parametrize(("requested", "leave_one", "torch_threads", "num_cores", "expected"), [
    (None, None, 4, 8, 4),  # in the caller's process: torch's count
    (None, False, 4, 8, 4),
    (None, True, 4, 8, 3),  # one fewer than torch's (one thread per physical core)...
    (None, True, 8, 4, 3),  # ...or than the cores this process may use
    (None, True, 1, 1, 1),  # at least one
    (6, True, 4, 8, 6),  # cpu_threads wins
])
def test_the_thread_count(requested: int | None, leave_one: bool | None, torch_threads: int,
                          num_cores: int, expected: int) -> None:
    model = ModelConfig(cpu_threads=requested, leave_core_to_frontend=leave_one)
    assert cpu_threads(model, torch_threads, num_cores) == expected


def test_the_client_asks_its_core_process_to_leave_a_core() -> None:
    config = EngineConfig()
    assert config.model.leave_core_to_frontend is None  # in the caller's process: off
    sent = for_core_process(config, environ={})
    assert sent.model.leave_core_to_frontend
    assert sent.model.model == config.model.model and sent.cache == config.cache
    # The user's (or Ray's) OMP_NUM_THREADS, or cpu_threads, chose already.
    assert for_core_process(config, environ={"OMP_NUM_THREADS": "1"}) is config
    for explicit in (EngineConfig(model=ModelConfig(cpu_threads=5)),
                     EngineConfig(model=ModelConfig(leave_core_to_frontend=False))):
        assert for_core_process(explicit, environ={}) is explicit


def test_cpu_threads_must_be_positive() -> None:
    with pytest.raises(ValueError, match="cpu_threads"):
        ModelConfig(cpu_threads=0)


def _torch_threads_of_a_fresh_process() -> int:
    environ = {key: value for key, value in os.environ.items() if key != "OMP_NUM_THREADS"}
    result = subprocess.run([sys.executable, "-c", "import torch; print(torch.get_num_threads())"],
                            capture_output=True, text=True, env=environ, timeout=120,
                            check=True)
    return int(result.stdout.strip().splitlines()[-1])


def test_a_core_process_beside_its_client_runs_one_thread_fewer(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # The suite sets OMP_NUM_THREADS=1 (tests/conftest.py); a server's environment does not.
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    expected = max(1, min(_torch_threads_of_a_fresh_process(), usable_cores()) - 1)
    for cpu_threads_set, threads in [(None, expected), (2, 2)]:
        client = SyncMPClient(_small(ModelConfig(device="cpu", cpu_threads=cpu_threads_set)))
        try:
            assert client.call_utility("stats")["num_cpu_threads"] == threads
        finally:
            client.shutdown()


def test_a_simulated_executor_reports_no_cpu_threads() -> None:
    client = SyncMPClient(dataclasses.replace(_small(ModelConfig()), executor="simulated"))
    try:
        assert client.call_utility("stats")["num_cpu_threads"] is None
    finally:
        client.shutdown()
