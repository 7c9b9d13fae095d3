"""What one engine step costs the host and the device, from the torch profiler: kernel
launches (the CPU's calls that start work on the device: kernels, and whole CUDA graphs,
each counting one), the device's busy time (the sum of its kernels' and copies' durations),
the host's time a step, and where the device sat idle inside the profiled steps (before its
first activity, between activities, after its last: `DeviceIdle`). `python -m lab forward --profile`
adds these to each shape.
`profile_run` profiles a whole run instead (`bench throughput --profile`): its wall time, the
device's busy time, and that time split by kind of kernel (`KERNEL_GROUPS`).

On the CPU there is no device activity: launches and device time are 0.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, record_function

# The runtime and driver calls that launch work on a CUDA device.
LAUNCH_CALLS = frozenset({"cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel",
                          "cuLaunchKernelEx", "cudaGraphLaunch", "cudaLaunchCooperativeKernel"})
TOP_KERNELS = 12
_STEPS_RANGE = "profiled steps"  # the host's range of the steps, in the profiler's events
# (group, substrings of the kernel names it takes, lower case); a kernel matching none is
# "other" (sampling, embedding, torch's elementwise ops)
KERNEL_GROUPS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("matmul", ("nvjet", "gemm", "cutlass", "splitkreduce", "xmma", "cublas")),
    ("attention decode", ("_decode_split", "_decode_reduce")),
    ("attention prefill", ("_prefill",)),
    ("layer kernels", ("_rms_norm", "_rotary", "_silu_and_mul", "_store_kv")),
    ("copies", ("memcpy", "memset")),
)


@dataclass(frozen=True)
class DeviceIdle:
    """Milliseconds the device did nothing inside a host time range: before its first
    activity began, in the gaps between activities (overlapping ones merged), and after its
    last ended. All 0 when it had no activity (the CPU)."""

    before_first_ms: float
    between_ms: float
    after_last_ms: float


def device_idle(activities_us: list[tuple[float, float]], start_us: float,
                end_us: float) -> DeviceIdle:
    """The device's idle time in `[start_us, end_us]` around its `(start, end)` activities
    (microseconds on one clock)."""
    if not activities_us:
        return DeviceIdle(0.0, 0.0, 0.0)
    ordered = sorted(activities_us)
    between_us = 0.0
    busy_until_us = ordered[0][1]
    for begin_us, finish_us in ordered[1:]:
        between_us += max(0.0, begin_us - busy_until_us)
        busy_until_us = max(busy_until_us, finish_us)
    return DeviceIdle(before_first_ms=max(0.0, ordered[0][0] - start_us) / 1e3,
                      between_ms=between_us / 1e3,
                      after_last_ms=max(0.0, end_us - busy_until_us) / 1e3)


@dataclass(frozen=True)
class StepProfile:
    """Per-step averages over a profiled run; `top_kernels` is the profiler's table of the
    kernels that took the most device time (empty on the CPU), `top_host_ops` its table of
    the operators that took the most host time of their own (where a step whose host time
    exceeds its device time spends it); `idle` is the device's idle time inside the run, a
    step (a run of one step: where the host held the device up). `host_stacks`, empty
    here, is for a caller that samples the host's Python in a run of its own
    (`lab.host_stacks`: sampling slows the host, so not in this run)."""

    launches_per_step: float
    graph_launches_per_step: float
    device_ms_per_step: float
    host_ms_per_step: float
    top_kernels: str
    top_host_ops: str
    idle: DeviceIdle
    host_stacks: str = ""


def device_activities(events: Iterable[Any]) -> list[Any]:
    """The profiler events that are the device's work (kernels, copies, memsets): on the
    device, and not a `record_function` range, which the profiler mirrors onto the device's
    timeline from its first kernel to its last."""
    return [event for event in events
            if event.device_type == DeviceType.CUDA and not event.is_user_annotation]


def _profiled(run: Callable[[], float], device: torch.device) -> tuple[float, profile]:
    """`run()`'s host seconds and the profile of it, with the device's activity (waited for)
    when `device` is CUDA; `run` is wrapped in the `_STEPS_RANGE` range."""
    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        with record_function(_STEPS_RANGE):
            host_s = run()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    return host_s, prof


def _top_kernels(prof: profile, device: torch.device) -> str:
    """The profiler's table of the costliest kernels; empty without a CUDA device."""
    if device.type != "cuda":
        return ""
    return prof.key_averages().table(sort_by="self_device_time_total", row_limit=TOP_KERNELS)


def _top_host_ops(prof: profile) -> str:
    """The profiler's table of the operators that took the most host time of their own."""
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=TOP_KERNELS)


def profile_steps(run_steps: Callable[[], float], num_steps: int,
                  device: torch.device) -> StepProfile:
    """Profiles `run_steps` (which runs `num_steps` steps and returns their host seconds)."""
    host_s, prof = _profiled(run_steps, device)
    events = prof.events()
    launches = sum(1 for event in events if event.name in LAUNCH_CALLS)
    graph_launches = sum(1 for event in events if event.name == "cudaGraphLaunch")
    activities_us = [(event.time_range.start, event.time_range.end)
                     for event in device_activities(events)]
    device_us = sum(end - start for start, end in activities_us)
    steps = next((event for event in events
                  if event.name == _STEPS_RANGE and event.device_type == DeviceType.CPU), None)
    if steps is None:
        raise RuntimeError(f"the profiler recorded no {_STEPS_RANGE!r} range")
    idle = device_idle(activities_us, steps.time_range.start, steps.time_range.end)
    return StepProfile(launches_per_step=launches / num_steps,
                       graph_launches_per_step=graph_launches / num_steps,
                       device_ms_per_step=device_us / 1e3 / num_steps,
                       host_ms_per_step=host_s * 1e3 / num_steps,
                       top_kernels=_top_kernels(prof, device),
                       top_host_ops=_top_host_ops(prof),
                       idle=DeviceIdle(idle.before_first_ms / num_steps,
                                       idle.between_ms / num_steps,
                                       idle.after_last_ms / num_steps))


@dataclass(frozen=True)
class RunProfile:
    """A whole profiled run: its host wall seconds, the device's busy seconds (the sum of its
    kernels' and copies' durations: kernels overlapping on several streams count each), those
    seconds by `KERNEL_GROUPS` (largest first), and the profiler's table of the costliest
    kernels (empty on the CPU)."""

    wall_s: float
    device_busy_s: float
    device_s_by_group: dict[str, float]
    top_kernels: str


def kernel_group(name: str) -> str:
    """The `KERNEL_GROUPS` group of a device activity's name, else "other"."""
    lowered = name.lower()
    for group, patterns in KERNEL_GROUPS:
        if any(pattern in lowered for pattern in patterns):
            return group
    return "other"


def profile_run(run: Callable[[], float], device: torch.device) -> RunProfile:
    """Profiles `run` (which returns its host seconds) with the device's activity."""
    wall_s, prof = _profiled(run, device)
    by_group: dict[str, float] = {}
    for event in device_activities(prof.events()):
        group = kernel_group(event.name)
        by_group[group] = by_group.get(group, 0.0) + event.time_range.elapsed_us() / 1e6
    return RunProfile(wall_s=wall_s, device_busy_s=sum(by_group.values()),
                      device_s_by_group=dict(sorted(by_group.items(), key=lambda item: -item[1])),
                      top_kernels=_top_kernels(prof, device))
