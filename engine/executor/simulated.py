"""The `simulated` executor: no model; each step takes the time a cost profile gives.

The profile is a roofline model (`engine.executor.roofline`) or one measured on a device
(`engine.executor.measured`), by name or file (`engine.executor.sim_profiles`).
Used behind the real server (`executor = "simulated"` in a `--config` file, where it sleeps each
step's time) and in the discrete-event simulator (where `sleep` advances a virtual clock).
It samples a fixed, deterministic token sequence that never contains the request's EOS
token, so a turn ends at `max_tokens` or a stop condition.

With a host tier (`CacheConfig.kv_offload_gib`), a step's KV copies cost their time over the
profile's host link as the real runner orders them: urgent stores and loads before the
forward, one after another; lazy stores beside the forward, so a step takes the longer of
the two.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from engine.config import EngineConfig
from engine.executor.base import SynchronousExecutor
from engine.executor.roofline import DEFAULT_SIM_PROFILE, GIB
from engine.executor.sim_profiles import CostProfile, get_sim_profile
from engine.kv_cache.transfers import KVTransfers
from engine.model.directory import load_arch
from engine.outputs import ModelRunnerOutput
from engine.scheduler.output import SchedulerOutput


class SimulatedExecutor(SynchronousExecutor):
    """Prices steps with `config.sim_profile` (default `DEFAULT_SIM_PROFILE`). The KV pool is
    `config.cache.num_kv_blocks`, or what the profile's memory holds; the host tier is as
    many blocks as `config.cache.kv_offload_gib` holds at the profile's KV bytes per token;
    the vocabulary is the configured model's, so its tokenizer serves text.

    `sleep(seconds)` is called once per step with the step's time; `busy_s` sums them, and
    `kv_copy_s` sums the host-link time of the copies (overlapped or not).
    """

    def __init__(
        self, config: EngineConfig, *, sleep: Callable[[float], None] = time.sleep
    ) -> None:
        self.profile: CostProfile = get_sim_profile(config.sim_profile or DEFAULT_SIM_PROFILE)
        block_size = config.cache.block_size
        self._num_kv_blocks = config.cache.num_kv_blocks or max(
            1, self.profile.num_kv_tokens // block_size
        )
        self._block_size = block_size
        self._num_host_kv_blocks = int(config.cache.kv_offload_gib * GIB) // (
            self.kv_bytes_per_block)
        if config.cache.kv_offload_gib and not self._num_host_kv_blocks:
            raise ValueError(f"kv_offload_gib={config.cache.kv_offload_gib} holds no KV block "
                             f"of {self.kv_bytes_per_block} bytes")
        self._vocab_size = load_arch(config.model.model).vocab_size
        self._sleep = sleep
        self._num_known_tokens: dict[str, int] = {}
        self._eos_token_ids: dict[str, int | None] = {}
        self.busy_s = 0.0
        self.kv_copy_s = 0.0

    @property
    def num_kv_blocks(self) -> int:
        return self._num_kv_blocks

    @property
    def num_host_kv_blocks(self) -> int:
        return self._num_host_kv_blocks

    @property
    def num_cpu_threads(self) -> int | None:
        return None

    @property
    def kv_bytes_per_block(self) -> int:
        """Bytes of KV in one block, over all layers and devices."""
        return self._block_size * self.profile.model.kv_bytes_per_token

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        for req_id in scheduler_output.finished_req_ids | scheduler_output.preempted_req_ids:
            self._num_known_tokens.pop(req_id, None)
            self._eos_token_ids.pop(req_id, None)
        num_computed = self._register(scheduler_output)
        forward_s = self.profile.step_time_s(
            (num_computed[req_id], num_new)
            for req_id, num_new in scheduler_output.num_scheduled_tokens.items()
        )
        step_s = self._with_copies_s(forward_s, scheduler_output.kv_transfers)
        req_ids = list(scheduler_output.num_scheduled_tokens)
        sampled = [self._sample(req_id, num_computed[req_id]
                                + scheduler_output.num_scheduled_tokens[req_id])
                   for req_id in req_ids]
        self.busy_s += step_s
        self._sleep(step_s)
        return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled,
                                 kv_copy_time_s=max(step_s - forward_s, 0.0))

    def _with_copies_s(self, forward_s: float, transfers: KVTransfers) -> float:
        """The step's time with its KV copies: the ones the forward waits for (urgent stores,
        then loads) first, then the forward beside the lazy stores."""
        blocking_s = self._copy_time_s(len(transfers.urgent_stores) + len(transfers.loads))
        overlapped_s = self._copy_time_s(len(transfers.stores))
        self.kv_copy_s += blocking_s + overlapped_s
        return blocking_s + max(forward_s, overlapped_s)

    def _copy_time_s(self, num_blocks: int) -> float:
        return self.profile.kv_copy_time_s(num_blocks * self._block_size)

    def _register(self, scheduler_output: SchedulerOutput) -> dict[str, int]:
        """Each scheduled request's computed-token count before the step."""
        num_computed = {}
        for new in scheduler_output.scheduled_new_reqs:
            self._num_known_tokens[new.req_id] = (len(new.prompt_token_ids)
                                                  + len(new.output_token_ids))
            self._eos_token_ids[new.req_id] = new.eos_token_id
            num_computed[new.req_id] = new.num_computed_tokens
        cached = scheduler_output.scheduled_cached_reqs
        num_computed.update(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
        return num_computed

    def _sample(self, req_id: str, num_computed_after: int) -> list[int]:
        """One token once every known token is computed; none while a prefill is partial."""
        num_known = self._num_known_tokens[req_id]
        if num_computed_after < num_known:
            return []
        self._num_known_tokens[req_id] = num_known + 1
        token_id = num_known % self._vocab_size
        if token_id == self._eos_token_ids[req_id]:
            token_id = (token_id + 1) % self._vocab_size
        return [token_id]

    def profile_prefill(self, lengths: Sequence[int]) -> list[tuple[int, float]]:
        """The cost model's whole-prompt prefill time per length (nothing is run)."""
        return [(length, self.profile.prefill_time_s(length)) for length in lengths]

    def profile_kv_reload(self, lengths: Sequence[int]) -> list[tuple[int, float]]:
        """The cost model's time to load each length's blocks from the host tier (nothing is
        run); lengths beyond the device pool or the host tier are skipped."""
        capacity = min(self._num_kv_blocks, self._num_host_kv_blocks) * self._block_size
        return [(length, self._copy_time_s(-(-length // self._block_size)))
                for length in lengths if 0 < length <= capacity]

    def shutdown(self) -> None:
        self._num_known_tokens.clear()
        self._eos_token_ids.clear()
