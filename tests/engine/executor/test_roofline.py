"""The roofline cost model against hand-computed step times and host-link copy times."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from engine.executor.roofline import (
    A100_SXM,
    GB,
    H100_SXM,
    LLAMA_3_1_8B,
    SIM_PROFILES,
    DeviceSpec,
    ModelShape,
    SimProfile,
)
from engine.executor.sim_profiles import get_sim_profile

# A round-number model and device so every figure can be worked out by hand.
MODEL = ModelShape("toy", num_params=1e9, num_layers=2, num_heads=4, num_kv_heads=2,
                   head_dim=8)
DEVICE = DeviceSpec("toy", peak_flops=1e12, memory_bandwidth=1e11, memory_bytes=10 * GB,
                    host_link_bandwidth=1e10)


def profile(**overrides: object) -> SimProfile:
    settings = {"compute_efficiency": 1.0, "bandwidth_efficiency": 1.0, "step_overhead_s": 0.0,
                "activation_reserve_bytes": 0.0, "memory_utilization": 1.0, **overrides}
    return SimProfile("toy", MODEL, DEVICE, **settings)


def test_model_shape_figures() -> None:
    assert MODEL.weight_bytes == 2e9
    assert MODEL.kv_bytes_per_token == 2 * 2 * 2 * 8 * 2  # K and V, layers, kv heads, dim, bf16
    assert MODEL.attention_flops_per_pair == 4 * 2 * 4 * 8
    assert LLAMA_3_1_8B.kv_bytes_per_token == 128 * 1024


def test_decode_step_is_bound_by_memory() -> None:
    # One token with 999 computed: FLOPs 2e9 + 256 * 1000 pairs; bytes 2e9 + 128 * 1000.
    flops = 2e9 + 256 * 1000
    memory_bytes = 2e9 + 128 * 1000
    expected_s = max(flops / 1e12, memory_bytes / 1e11)
    assert expected_s == memory_bytes / 1e11
    assert profile().step_time_s([(999, 1)]) == pytest.approx(expected_s)


def test_prefill_step_is_bound_by_compute() -> None:
    num_tokens = 4096
    pairs = num_tokens * (num_tokens + 1) // 2
    flops = 2e9 * num_tokens + 256 * pairs
    assert flops / 1e12 > (2e9 + 128 * num_tokens) / 1e11
    assert profile().prefill_time_s(num_tokens) == pytest.approx(flops / 1e12)


def test_batch_adds_tokens_pairs_and_kv_but_reads_the_weights_once() -> None:
    model = profile()
    batch = [(100, 1), (0, 50), (20, 10)]
    pairs = 100 + 50 * 51 // 2 + (10 * 20 + 10 * 11 // 2)
    flops = 2e9 * 61 + 256 * pairs
    memory_bytes = 2e9 + 128 * (101 + 50 + 30)
    assert model.step_time_s(batch) == pytest.approx(max(flops / 1e12, memory_bytes / 1e11))


def test_efficiencies_overhead_and_devices_scale_the_time() -> None:
    batch = [(999, 1)]
    base_s = profile().step_time_s(batch)
    assert profile(bandwidth_efficiency=0.5).step_time_s(batch) == pytest.approx(2 * base_s)
    assert profile(step_overhead_s=0.01).step_time_s(batch) == pytest.approx(base_s + 0.01)
    assert profile(num_devices=4).step_time_s(batch) == pytest.approx(base_s / 4)


def test_empty_step_costs_nothing() -> None:
    assert profile(step_overhead_s=0.01).step_time_s([]) == 0.0
    assert profile().step_time_s([(10, 0)]) == 0.0


def test_kv_capacity_is_the_memory_left_after_weights() -> None:
    toy = profile(memory_utilization=0.5, activation_reserve_bytes=1 * GB)
    assert toy.num_kv_tokens == int((5 * GB - 2 * GB - 1 * GB) // 128)
    h100 = SIM_PROFILES["h100-llama3.1-8b"]
    usable = 80 * GB * 0.9 - 8.03e9 * 2 - 2 * GB
    assert h100.num_kv_tokens == int(usable // (128 * 1024))
    seventy = SIM_PROFILES["4xh100-llama3.1-70b"]
    assert seventy.num_devices == 4 and seventy.device is H100_SXM
    assert seventy.num_kv_tokens > 100_000


def test_named_profiles_order_devices_sensibly() -> None:
    batch = [(2000, 1)] * 32
    h100 = get_sim_profile("h100-llama3.1-8b")
    a100 = get_sim_profile("a100-llama3.1-8b")
    assert a100.step_time_s(batch) > h100.step_time_s(batch)
    assert a100.prefill_time_s(8192) > h100.prefill_time_s(8192)
    # Decode on an H100 is in the milliseconds, prefill of 8k tokens in the tenths of seconds.
    assert 0.005 < h100.step_time_s([(1000, 1)]) < 0.02
    assert 0.1 < h100.prefill_time_s(8192) < 1.0


def test_bad_profiles_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown sim profile 'h200'"):
        get_sim_profile("h200")
    with pytest.raises(ValueError, match="compute_efficiency"):
        profile(compute_efficiency=0.0)
    with pytest.raises(ValueError, match="no memory for KV"):
        SimProfile("big", ModelShape("big", 1e12, 2, 4, 2, 8), DEVICE)


def test_kv_copies_run_over_the_host_links() -> None:
    # 128 bytes of KV per token over a 10 GB/s link at 80%: 8e9 bytes/s.
    toy = profile(host_link_efficiency=0.8)
    assert toy.host_link_bytes_per_s == pytest.approx(8e9)
    assert toy.kv_copy_time_s(1000) == pytest.approx(1000 * 128 / 8e9)
    assert toy.kv_copy_time_s(0) == 0.0
    # Each device moves its own shard over its own link; each has its own host memory.
    four = profile(host_link_efficiency=0.8, num_devices=4, host_memory_bytes_per_device=5 * GB)
    assert four.kv_copy_time_s(1000) == pytest.approx(toy.kv_copy_time_s(1000) / 4)
    assert four.host_memory_bytes == 20 * GB


def test_named_profiles_have_pcie_links_and_host_memory() -> None:
    assert H100_SXM.host_link_bandwidth == 64 * GB  # PCIe Gen5 x16, one direction
    assert A100_SXM.host_link_bandwidth == 32 * GB  # PCIe Gen4 x16
    h100 = get_sim_profile("h100-llama3.1-8b")
    assert h100.host_link_bytes_per_s == pytest.approx(51.2 * GB)
    # Loading a 32k-token context costs tenths of a second, far below prefilling it.
    assert 0.05 < h100.kv_copy_time_s(32768) < 0.2 < h100.prefill_time_s(32768)
    for named in SIM_PROFILES.values():
        assert 100 * GB <= named.host_memory_bytes_per_device <= 200 * GB
        assert named.host_memory_bytes == named.host_memory_bytes_per_device * named.num_devices
        # The tier holds more KV than the device pool.
        assert named.host_memory_bytes / named.model.kv_bytes_per_token > named.num_kv_tokens


@pytest.mark.parametrize(("build", "message"), [
    (lambda: profile(host_link_efficiency=0.0), "host_link_efficiency"),
    (lambda: profile(host_link_efficiency=1.5), "host_link_efficiency"),
    (lambda: profile(host_memory_bytes_per_device=0.0), "host_memory_bytes_per_device"),
    (lambda: profile(host_memory_bytes_per_device=float("inf")),
     "host_memory_bytes_per_device"),
    (lambda: DeviceSpec("bad", 1e12, 1e11, 10 * GB, host_link_bandwidth=0.0),
     "device bad: host_link_bandwidth"),
    (lambda: DeviceSpec("bad", 1e12, -1.0, 10 * GB, host_link_bandwidth=1e10),
     "device bad: memory_bandwidth"),
])
def test_bad_host_figures_are_refused(build: Callable[[], object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build()
