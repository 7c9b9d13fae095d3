"""On CUDA, launching a step makes no synchronizing call that torch can flag
(`torch.cuda.set_sync_debug_mode`: blocking copies, reads of device values, stream
synchronizations): every sampling input reaches the device by an asynchronous copy, and the
penalties count the sampled ids on the device. Taking a step's result (its sampled ids on
the host) waits, and a step with prompt logprobs, which reads them back by design, is left
out. Event waits (the static decode buffers wait for their last copies out) are not flagged
and not checked here. Runs where CUDA is (`scripts/gpu_bench.sh --part smoke`); CPU tests
check the same steps' tokens (`test_async_scheduling.py`)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine.config import AttentionBackendName, EngineConfig
from engine.core.engine_core import EngineCore
from engine.executor.base import make_executor
from engine.outputs import PendingStep
from engine.scheduler.output import SchedulerOutput
from tests.engine.core.test_async_scheduling import _config, _requests, _run

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


class NoWaitExecutor:
    """The tiny model's executor, launching each step with every synchronizing CUDA call an
    error (`torch.cuda.set_sync_debug_mode`)."""

    def __init__(self, config: EngineConfig) -> None:
        self.inner = make_executor(config)
        self.num_submitted = 0

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)

    def submit(self, scheduler_output: SchedulerOutput) -> PendingStep:
        torch.cuda.set_sync_debug_mode("error")
        try:
            launched = self.inner.submit(scheduler_output)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        self.num_submitted += 1
        return launched


@pytest.mark.parametrize("backend", ["auto", "sdpa"])
@pytest.mark.parametrize(("num_kv_blocks", "policy"), [(96, "continuum"), (16, "fcfs")],
                         ids=["roomy", "preempting"])
def test_launching_a_step_never_waits_for_the_device(num_kv_blocks: int, policy: str,
                                                      backend: AttentionBackendName) -> None:
    """Greedy, seeded, penalised, logprob, stop-token, min-tokens and constrained requests,
    with prefix hits (and preemptions in the small pool); with `auto` (triton-sdpa) decode steps
    replay CUDA graphs, with `sdpa` every step runs eagerly."""
    torch.cuda.set_sync_debug_mode("error")
    try:  # the check catches a read of the device, the kind of wait it is there for
        with pytest.raises(RuntimeError, match="synchronizing"):
            torch.zeros(1, device="cuda").item()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    requests = [request for request in _requests(None)
                if request.sampling_params.prompt_logprobs is None]
    config = _config(True, num_kv_blocks, policy, "cuda")
    config = dataclasses.replace(
        config, model=dataclasses.replace(config.model, attention_backend=backend))
    # Untimed first: kernels met for the first time compile here, not under the check.
    reference_core = EngineCore(config)
    reference = _run(reference_core, requests)
    reference_core.shutdown()
    executor = NoWaitExecutor(config)
    core = EngineCore(config, executor=executor)
    checked = _run(core, requests)
    core.shutdown()
    assert executor.num_submitted > len(requests)
    assert checked == reference
