"""The executor interface, and executors by name.

An executor is created and owned by the `EngineCore` (inside the engine-core process when one
is used). It is called once per step with the scheduler's plan and returns the sampled tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

from engine.config import EngineConfig
from engine.outputs import CompletedStep, ModelRunnerOutput, PendingStep
from engine.registry import Registry
from engine.scheduler.output import SchedulerOutput


class Executor(Protocol):
    """Runs scheduler steps on a device.

    `num_kv_blocks` is the KV pool size the executor allocated (the scheduler's pool must match
    it), `num_host_kv_blocks` the host tier's (0: none; `CacheConfig.kv_offload_gib`);
    `vocab_size` bounds the token ids it accepts; `num_cpu_threads` is torch's intra-op threads
    of a model it runs on CPU (None: no model on CPU); `prefers_async_scheduling` whether
    `submit` returns while the device still runs the step, so that scheduling the next step
    before taking this one's result hides the host's work (the engine core's choice when
    `SchedulerConfig.async_scheduling` is None). `submit` is called once per engine step
    (the step carries out its `kv_transfers` too) and returns the step launched; the engine
    core takes results in submission order, and with async scheduling submits the next step
    before it takes the last one's result (never more than two out). `execute` is `submit`
    and `result` at once. `shutdown` is called once when the engine stops.
    """

    @property
    def num_kv_blocks(self) -> int: ...

    @property
    def num_host_kv_blocks(self) -> int: ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def num_cpu_threads(self) -> int | None: ...

    @property
    def prefers_async_scheduling(self) -> bool: ...

    def submit(self, scheduler_output: SchedulerOutput) -> PendingStep: ...

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput: ...

    def shutdown(self) -> None: ...


class SynchronousExecutor:
    """An executor whose steps run to completion inside `execute`: `submit` runs one."""

    @property
    def prefers_async_scheduling(self) -> bool:
        return False

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        raise NotImplementedError

    def submit(self, scheduler_output: SchedulerOutput) -> PendingStep:
        return CompletedStep(self.execute(scheduler_output))


@runtime_checkable
class PrefillProfiler(Protocol):
    """An executor that can time prefills (before serving), for pricing context rebuilds."""

    def profile_prefill(self, lengths: Sequence[int]) -> list[tuple[int, float]]:
        """(length, seconds) of one whole-prompt prefill per length it could run."""
        ...


@runtime_checkable
class KVReloadProfiler(Protocol):
    """An executor with a host tier that can time loads from it (before serving), for
    pricing context reloads."""

    def profile_kv_reload(self, lengths: Sequence[int]) -> list[tuple[int, float]]:
        """(num_tokens, seconds) of loading that many tokens' KV from the host tier into the
        device pool, one per length it could hold."""
        ...


# Each entry is built with the engine's config; by path, so that choosing the simulated
# executor never imports torch.
EXECUTORS: Registry[Callable[[EngineConfig], Executor]] = Registry("executor", {
    "torch": "engine.executor.torch_executor:TorchExecutor",
    "simulated": "engine.executor.simulated:SimulatedExecutor",
}, accepts_paths=True)


def make_executor(config: EngineConfig) -> Executor:
    """The executor named by `config.executor` (a registry name or `module:Class`)."""
    return EXECUTORS.load(config.executor)(config)
