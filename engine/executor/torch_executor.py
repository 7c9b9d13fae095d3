"""The `torch` executor: one model runner in the engine-core process (CPU or one GPU)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.config import EngineConfig
from engine.outputs import ModelRunnerOutput, PendingStep
from engine.scheduler.output import SchedulerOutput
from engine.worker.model_runner import ModelRunner


class TorchExecutor:
    """Runs the real model; loads weights and allocates the KV pool (and the host tier's
    caches, with `kv_offload_gib` > 0) on construction."""

    def __init__(self, config: EngineConfig) -> None:
        if config.model.cpu_threads is not None:
            torch.set_num_threads(config.model.cpu_threads)
        self.runner = ModelRunner(config)

    @property
    def num_kv_blocks(self) -> int:
        return self.runner.num_kv_blocks

    @property
    def num_host_kv_blocks(self) -> int:
        return self.runner.num_host_kv_blocks

    @property
    def vocab_size(self) -> int:
        return self.runner.arch.vocab_size

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
