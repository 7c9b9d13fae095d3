"""How many CPU cores this process can use: its affinity mask, lowered by its cgroup's CPU
quota (a container's `--cpus`, a Kubernetes CPU limit), which the mask does not show: a
container limited to two cores of a 64-core host sees all 64 in its mask."""

from __future__ import annotations

import math
import os
from pathlib import Path

CGROUP_DIR = Path("/sys/fs/cgroup")


def usable_cores(cgroup_dir: Path = CGROUP_DIR) -> int:
    """The cores in this process's affinity mask (the machine's count where there is no
    mask), at most its cgroup's quota rounded up (`cgroup_cpu_quota`), at least 1."""
    try:
        num_cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        num_cores = os.cpu_count() or 1
    quota = cgroup_cpu_quota(cgroup_dir)
    if quota is not None:
        num_cores = min(num_cores, math.ceil(quota))
    return max(1, num_cores)


def cgroup_cpu_quota(cgroup_dir: Path = CGROUP_DIR) -> float | None:
    """The cores' worth of CPU time the cgroup mounted at `cgroup_dir` may use (quota over
    period): from cgroup v2's `cpu.max` ("max 100000" is no quota, "150000 100000" is 1.5),
    else cgroup v1's `cpu/cpu.cfs_quota_us` and `cpu/cpu.cfs_period_us` (a quota of -1 is
    none). None without a quota, or where neither can be read."""
    v2 = _read(cgroup_dir / "cpu.max")
    if v2 is not None:
        fields = v2.split()
        return None if len(fields) != 2 or fields[0] == "max" else _ratio(*fields)
    quota = _read(cgroup_dir / "cpu" / "cpu.cfs_quota_us")
    period = _read(cgroup_dir / "cpu" / "cpu.cfs_period_us")
    if quota is None or period is None:
        return None
    return _ratio(quota, period)


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _ratio(quota: str, period: str) -> float | None:
    try:
        quota_us, period_us = int(quota), int(period)
    except ValueError:
        return None
    return quota_us / period_us if quota_us > 0 and period_us > 0 else None
