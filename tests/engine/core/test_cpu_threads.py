"""torch's intra-op threads: a core process beside its frontend leaves it a core."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from engine.config import EngineConfig, ModelConfig
from engine.core.cpu_threads import core_process_threads, for_core_process, usable_cores


@pytest.mark.parametrize(("requested", "num_cores", "environ", "expected"), [
    (None, 4, {}, 3),  # one core left to the frontend
    (None, 1, {}, 1),  # at least one thread
    (None, 4, {"OMP_NUM_THREADS": "2"}, None),  # the user's OMP_NUM_THREADS stands
    (2, 4, {"OMP_NUM_THREADS": "1"}, 2),  # cpu_threads wins over everything
])
def test_a_core_process_threads(requested: int | None, num_cores: int,
                                environ: dict[str, str], expected: int | None) -> None:
    assert core_process_threads(requested, num_cores=num_cores, environ=environ) == expected


def test_the_client_sends_the_core_process_its_threads() -> None:
    config = EngineConfig()
    assert config.model.cpu_threads is None  # in the caller's process: torch's count
    sent = for_core_process(config, environ={})
    assert sent.model.cpu_threads == max(1, usable_cores() - 1)
    assert sent.model.model == config.model.model and sent.cache == config.cache
    assert for_core_process(config, environ={"OMP_NUM_THREADS": "1"}) is config
    explicit = EngineConfig(model=ModelConfig(cpu_threads=5))
    assert for_core_process(explicit, environ={}) is explicit


def test_cpu_threads_must_be_positive() -> None:
    with pytest.raises(ValueError, match="cpu_threads"):
        ModelConfig(cpu_threads=0)


_BUILD = """
import json, sys, torch
from engine.config import EngineConfig, ModelConfig
from engine.executor.torch_executor import TorchExecutor
before = torch.get_num_threads()
TorchExecutor(EngineConfig(model=ModelConfig(device="cpu", cpu_threads=json.loads(sys.argv[1]))))
print(json.dumps([before, torch.get_num_threads()]))
"""


def _threads_around_an_executor(cpu_threads: int | None) -> list[int]:
    # A process of its own: torch's thread count is process-wide, and this one's must not move.
    environ = {key: value for key, value in os.environ.items() if key != "OMP_NUM_THREADS"}
    result = subprocess.run([sys.executable, "-c", _BUILD, json.dumps(cpu_threads)],
                            capture_output=True, text=True, env=environ, timeout=300,
                            check=True)
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_the_torch_executor_sets_the_threads_it_is_given() -> None:
    assert _threads_around_an_executor(1)[1] == 1
    before, after = _threads_around_an_executor(None)
    assert after == before
