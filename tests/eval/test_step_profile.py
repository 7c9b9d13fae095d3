"""`eval.step_profile`: kernels grouped by kind, and a whole run profiled on the CPU."""

import time

import torch

from eval.step_profile import kernel_group, profile_run


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
