"""`eval.step_profile`: kernels grouped by kind, and a whole run profiled on the CPU."""

import time
from types import SimpleNamespace

import torch
from torch.autograd import DeviceType

from eval.step_profile import (
    DeviceIdle,
    device_activities,
    device_idle,
    kernel_group,
    profile_run,
    profile_steps,
)


def test_kernels_are_grouped_by_their_names() -> None:
    assert kernel_group("nvjet_sm90_tst_64x8_64x16_2x1_v_bz_TNT") == "matmul"
    assert kernel_group("void cublasLt::splitKreduce_kernel<32, 16, int>") == "matmul"
    assert kernel_group("_decode_split_kernel") == "attention decode"
    assert kernel_group("_tuned_prefill_kernel") == "attention prefill"
    assert kernel_group("_silu_and_mul_kernel") == "layer kernels"
    assert kernel_group("Memcpy HtoD (Pinned -> Device)") == "copies"
    assert kernel_group("void at::native::vectorized_elementwise_kernel<4>") == "other"


def test_a_run_on_the_cpu_has_its_wall_time_and_no_device_time() -> None:
    def run() -> float:
        start = time.perf_counter()
        torch.ones(64, 64) @ torch.ones(64, 64)
        return time.perf_counter() - start

    profile = profile_run(run, torch.device("cpu"))
    assert profile.wall_s > 0
    assert profile.device_busy_s == 0 and profile.device_s_by_group == {}
    assert profile.top_kernels == ""


def test_device_idle_splits_the_gaps_around_and_between_activities() -> None:
    # Activities (us) 10-20 and 15-30 overlap (merged), then a gap to 40-45; range 0-60.
    idle = device_idle([(40.0, 45.0), (10.0, 20.0), (15.0, 30.0)], 0.0, 60.0)
    assert idle == DeviceIdle(before_first_ms=0.010, between_ms=0.010, after_last_ms=0.015)
    assert device_idle([], 0.0, 60.0) == DeviceIdle(0.0, 0.0, 0.0)
    # An activity that outlasts the range leaves no idle time after it.
    assert device_idle([(5.0, 70.0)], 0.0, 60.0).after_last_ms == 0.0


def test_profiled_steps_on_the_cpu_have_host_time_and_no_device_idle() -> None:
    def run() -> float:
        start = time.perf_counter()
        for _ in range(2):
            torch.ones(32, 32) @ torch.ones(32, 32)
        return time.perf_counter() - start

    profile = profile_steps(run, 2, torch.device("cpu"))
    assert profile.host_ms_per_step > 0 and profile.device_ms_per_step == 0
    assert profile.idle == DeviceIdle(0.0, 0.0, 0.0)
    assert profile.top_kernels == ""
    assert "aten::mm" in profile.top_host_ops  # the host's operators, on every device
    assert profile.host_stacks == ""  # sampled by a caller, in runs of its own


def test_a_record_function_range_on_the_device_is_not_device_work() -> None:
    def event(name: str, device_type: DeviceType, annotation: bool) -> SimpleNamespace:
        return SimpleNamespace(name=name, device_type=device_type,
                               is_user_annotation=annotation)

    kernel = event("_prefill_kernel", DeviceType.CUDA, False)
    events = [kernel, event("profiled steps", DeviceType.CUDA, True),
              event("profiled steps", DeviceType.CPU, True), event("aten::mm", DeviceType.CPU,
                                                                   False)]
    assert device_activities(events) == [kernel]
