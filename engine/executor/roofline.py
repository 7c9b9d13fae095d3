"""A roofline cost model of one engine step, and named (model, device) profiles.

A step is bound either by compute or by memory traffic, whichever takes longer:
- FLOPs: `2 * num_params` per scheduled token (the matmuls), plus causal attention,
  `4 * num_layers * num_heads * head_dim` per (query, key) pair;
- bytes: the weights once per step, plus each scheduled request's KV read (its context) and
  written (its new tokens).
Each side runs at its peak times an efficiency factor; a fixed overhead per step covers
launches, sampling and, with tensor parallelism, the all-reduces. Tensor parallelism over
`num_devices` devices multiplies FLOP/s, bandwidth and memory.

KV copies to and from a host-memory tier run over each device's host link (PCIe), at its
per-direction bandwidth times an efficiency; every device moves its own shard of the KV, so
the links add up too.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from types import MappingProxyType

GB = 1e9
GIB = 2**30


@dataclass(frozen=True)
class ModelShape:
    """What the cost model needs of a transformer; bytes per weight and per KV element."""

    name: str
    num_params: float
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    weight_bytes_per_param: int = 2
    kv_bytes_per_element: int = 2

    @property
    def weight_bytes(self) -> float:
        return self.num_params * self.weight_bytes_per_param

    @property
    def kv_bytes_per_token(self) -> int:
        """Keys and values of one token over all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.kv_bytes_per_element

    @property
    def attention_flops_per_pair(self) -> int:
        """Q.K and A.V for one (query, key) pair over all layers: two multiply-adds per dim."""
        return 4 * self.num_layers * self.num_heads * self.head_dim


@dataclass(frozen=True)
class DeviceSpec:
    """One accelerator: dense BF16 FLOP/s, memory bandwidth (bytes/s), memory (bytes), and
    the bandwidth of its link to host memory (bytes/s in each direction)."""

    name: str
    peak_flops: float
    memory_bandwidth: float
    memory_bytes: float
    host_link_bandwidth: float

    def __post_init__(self) -> None:
        for name in ("peak_flops", "memory_bandwidth", "memory_bytes", "host_link_bandwidth"):
            _require_positive(f"device {self.name}: {name}", getattr(self, name))


@dataclass(frozen=True)
class SimProfile:
    """A model served on `num_devices` devices (tensor parallel), with the efficiencies the
    engine reaches on them.

    `memory_utilization` is the share of device memory the engine may use (as vLLM's
    `gpu_memory_utilization`); `activation_reserve_bytes` is kept back for activations, the
    rest after the weights holds KV. `host_link_efficiency` is the share of the host link's
    bandwidth that KV copies reach; `host_memory_bytes_per_device` the host memory a KV tier
    may take beside each device (the Continuum paper gave 100-200 GB per GPU).
    """

    name: str
    model: ModelShape
    device: DeviceSpec
    num_devices: int = 1
    compute_efficiency: float = 0.5
    bandwidth_efficiency: float = 0.7
    step_overhead_s: float = 0.002
    memory_utilization: float = 0.9
    activation_reserve_bytes: float = 2 * GB
    host_link_efficiency: float = 0.8
    host_memory_bytes_per_device: float = 150 * GB

    def __post_init__(self) -> None:
        for name in ("compute_efficiency", "bandwidth_efficiency", "memory_utilization",
                     "host_link_efficiency"):
            value = getattr(self, name)
            if not 0.0 < value <= 1.0:
                raise ValueError(f"{name} must be in (0, 1], got {value!r}")
        if self.num_devices < 1:
            raise ValueError(f"num_devices must be >= 1, got {self.num_devices}")
        if self.step_overhead_s < 0:
            raise ValueError(f"step_overhead_s must be >= 0, got {self.step_overhead_s}")
        if self.num_kv_tokens < 1:
            raise ValueError(f"profile {self.name}: the weights leave no memory for KV")
        _require_positive("host_memory_bytes_per_device", self.host_memory_bytes_per_device)

    @property
    def flops_per_s(self) -> float:
        return self.device.peak_flops * self.num_devices * self.compute_efficiency

    @property
    def bytes_per_s(self) -> float:
        return self.device.memory_bandwidth * self.num_devices * self.bandwidth_efficiency

    @property
    def host_link_bytes_per_s(self) -> float:
        """Bytes/s that KV copies reach in each direction between the devices and the host."""
        return self.device.host_link_bandwidth * self.num_devices * self.host_link_efficiency

    @property
    def host_memory_bytes(self) -> float:
        """Host memory a KV tier may take, over all devices."""
        return self.host_memory_bytes_per_device * self.num_devices

    @property
    def num_kv_tokens(self) -> int:
        """Tokens of KV that fit in the memory left after weights and activations."""
        usable = self.device.memory_bytes * self.num_devices * self.memory_utilization
        free = usable - self.model.weight_bytes - self.activation_reserve_bytes
        return int(free // self.model.kv_bytes_per_token)

    def step_time_s(self, batch: Iterable[tuple[int, int]]) -> float:
        """Seconds of one step over `(num_computed_tokens, num_new_tokens)` per scheduled
        request: the tokens whose KV exists and the tokens computed this step. An empty
        step costs nothing."""
        num_new_total = 0
        attention_pairs = 0
        kv_tokens_touched = 0
        for num_computed, num_new in batch:
            num_new_total += num_new
            attention_pairs += num_new * num_computed + num_new * (num_new + 1) // 2
            kv_tokens_touched += num_computed + num_new
        if num_new_total == 0:
            return 0.0
        model = self.model
        flops = 2.0 * model.num_params * num_new_total
        flops += model.attention_flops_per_pair * attention_pairs
        memory_bytes = model.weight_bytes + model.kv_bytes_per_token * kv_tokens_touched
        return max(flops / self.flops_per_s, memory_bytes / self.bytes_per_s) + (
            self.step_overhead_s
        )

    def prefill_time_s(self, num_tokens: int) -> float:
        """Seconds to prefill one prompt of `num_tokens` from scratch, alone in a step."""
        return self.step_time_s([(0, num_tokens)])

    def kv_copy_time_s(self, num_tokens: int) -> float:
        """Seconds to copy the KV of `num_tokens` tokens one way over the host link."""
        return num_tokens * self.model.kv_bytes_per_token / self.host_link_bytes_per_s


def _require_positive(name: str, value: float) -> None:
    if not 0 < value < math.inf:
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")


LLAMA_3_1_8B = ModelShape("Llama-3.1-8B", num_params=8.03e9, num_layers=32, num_heads=32,
                          num_kv_heads=8, head_dim=128)
LLAMA_3_1_70B = ModelShape("Llama-3.1-70B", num_params=70.6e9, num_layers=80, num_heads=64,
                           num_kv_heads=8, head_dim=128)
# Datasheet figures of the SXM parts: dense BF16 tensor FLOP/s, HBM bandwidth, HBM size, and
# the host link, PCIe x16, per direction (half the datasheet's bidirectional figure): Gen5
# on the H100, Gen4 on the A100.
H100_SXM = DeviceSpec("H100-SXM-80GB", peak_flops=989e12, memory_bandwidth=3.35e12,
                      memory_bytes=80 * GB, host_link_bandwidth=64 * GB)
A100_SXM = DeviceSpec("A100-SXM-80GB", peak_flops=312e12, memory_bandwidth=2.039e12,
                      memory_bytes=80 * GB, host_link_bandwidth=32 * GB)

SIM_PROFILES = MappingProxyType({
    profile.name: profile for profile in (
        SimProfile("h100-llama3.1-8b", LLAMA_3_1_8B, H100_SXM),
        SimProfile("a100-llama3.1-8b", LLAMA_3_1_8B, A100_SXM),
        # Two all-reduces per layer over NVLink add about 1.5 ms per step at four devices.
        SimProfile("4xh100-llama3.1-70b", LLAMA_3_1_70B, H100_SXM, num_devices=4,
                   step_overhead_s=0.0035),
    )
})
DEFAULT_SIM_PROFILE = "h100-llama3.1-8b"

