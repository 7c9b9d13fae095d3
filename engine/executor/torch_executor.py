"""The `torch` executor: one model runner in the engine-core process (CPU or one GPU)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.config import EngineConfig, ModelConfig
from engine.cpu_cores import usable_cores
from engine.outputs import ModelRunnerOutput, PendingStep
from engine.scheduler.output import SchedulerOutput
from engine.worker.model_runner import ModelRunner


class TorchExecutor:
    """Runs the real model; loads weights and allocates the KV pool (and the host tier's
    caches, with `kv_offload_gib` > 0) on construction."""

    def __init__(self, config: EngineConfig) -> None:
        self.runner = ModelRunner(config)
        if self.runner.device.type == "cpu":
            threads = cpu_threads(config.model, torch.get_num_threads(), usable_cores())
            if threads != torch.get_num_threads():
                torch.set_num_threads(threads)

    @property
    def num_kv_blocks(self) -> int:
        return self.runner.num_kv_blocks

    @property
    def num_host_kv_blocks(self) -> int:
        return self.runner.num_host_kv_blocks

    @property
    def num_cpu_threads(self) -> int | None:
        return torch.get_num_threads() if self.runner.device.type == "cpu" else None

    @property
    def vocab_size(self) -> int:
        return self.runner.arch.vocab_size

    @property
    def prefers_async_scheduling(self) -> bool:
        return self.runner.prefers_async_scheduling

    def submit(self, scheduler_output: SchedulerOutput) -> PendingStep:
        return self.runner.submit(scheduler_output)

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.runner.execute_model(scheduler_output)

    def profile_prefill(self, lengths: Sequence[int]) -> list[tuple[int, float]]:
        return self.runner.profile_prefill(lengths)

    def profile_kv_reload(self, lengths: Sequence[int]) -> list[tuple[int, float]]:
        return self.runner.profile_kv_reload(lengths)

    def shutdown(self) -> None:
        # The graphs hold the caches' addresses and their own memory pool: dropped first.
        self.runner.decode_graphs = None
        self.runner.kv_caches.clear()
        if self.runner.host_kv_cache is not None:
            self.runner.host_kv_cache.caches.clear()


def cpu_threads(model: ModelConfig, torch_threads: int, num_cores: int) -> int:
    """torch's intra-op threads for a model on CPU: `cpu_threads` if set; else, with
    `leave_core_to_frontend`, one fewer than torch's own count (`torch_threads`, one per
    physical core) or than `num_cores` (at least 1); else torch's own."""
    if model.cpu_threads is not None:
        return model.cpu_threads
    if model.leave_core_to_frontend:
        return max(1, min(torch_threads, num_cores) - 1)
    return torch_threads
