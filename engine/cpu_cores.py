"""How many CPU cores this process can use: its affinity mask, lowered by the CPU quotas of
its cgroups (a container's `--cpus`, a Kubernetes CPU limit, a systemd `CPUQuota=`), which the
mask does not show: a container limited to two cores of a 64-core host sees all 64 in its
mask."""

from __future__ import annotations

import math
import os
from pathlib import Path

CGROUP_DIR = Path("/sys/fs/cgroup")
PROC_CGROUP = Path("/proc/self/cgroup")
# Where cgroup v1 mounts the CPU controller, under `CGROUP_DIR`.
_V1_CPU_MOUNTS = ("cpu", "cpu,cpuacct")


def usable_cores(cgroup_dir: Path = CGROUP_DIR, proc_cgroup: Path = PROC_CGROUP) -> int:
    """The cores in this process's affinity mask (the machine's count where there is no
    mask), at most its cgroups' quota rounded up (`cgroup_cpu_quota`), at least 1."""
    try:
        num_cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        num_cores = os.cpu_count() or 1
    quota = cgroup_cpu_quota(cgroup_dir, proc_cgroup)
    if quota is not None:
        num_cores = min(num_cores, math.ceil(quota))
    return max(1, num_cores)


def cgroup_cpu_quota(cgroup_dir: Path = CGROUP_DIR, proc_cgroup: Path = PROC_CGROUP
                     ) -> float | None:
    """The cores' worth of CPU time this process may use (quota over period): the smallest
    quota of its cgroup and the cgroup's ancestors (as `proc_cgroup` names them, under the
    hierarchies mounted at `cgroup_dir`). cgroup v2's `cpu.max` ("max 100000" is no quota,
    "150000 100000" is 1.5), else cgroup v1's `cpu.cfs_quota_us` over `cpu.cfs_period_us` (a
    quota of -1 is none). None without a quota, or where none can be read."""
    quotas = [quota for directory in _candidate_dirs(cgroup_dir, proc_cgroup)
              if (quota := _quota(directory)) is not None]
    return min(quotas, default=None)


def _candidate_dirs(cgroup_dir: Path, proc_cgroup: Path) -> list[Path]:
    """The directories of this process's cgroups and of their ancestors, for the v2 hierarchy
    (mounted at `cgroup_dir`) and v1's CPU controller; the mounts alone when the process's
    cgroups are unknown (inside a cgroup namespace its cgroup is the mount's root anyway)."""
    v2_path, v1_path = _own_cgroup_paths(proc_cgroup)
    mounts = [(cgroup_dir, v2_path)] + [(cgroup_dir / name, v1_path) for name in _V1_CPU_MOUNTS]
    directories: list[Path] = []
    for mount, path in mounts:
        directory = mount / path.strip("/") if path else mount
        while directory != mount and mount in directory.parents:
            directories.append(directory)
            directory = directory.parent
        directories.append(mount)
    return directories


def _own_cgroup_paths(proc_cgroup: Path) -> tuple[str | None, str | None]:
    """(this process's cgroup v2 path, its v1 CPU controller's path), each None if absent."""
    v2_path = v1_path = None
    for line in (_read(proc_cgroup) or "").splitlines():
        fields = line.split(":", 2)
        if len(fields) != 3:
            continue
        hierarchy, controllers, path = fields
        if hierarchy == "0" and not controllers:
            v2_path = path
        elif "cpu" in controllers.split(","):
            v1_path = path
    return v2_path, v1_path


def _quota(directory: Path) -> float | None:
    v2 = _read(directory / "cpu.max")
    if v2 is not None:
        fields = v2.split()
        return None if len(fields) != 2 or fields[0] == "max" else _ratio(*fields)
    quota = _read(directory / "cpu.cfs_quota_us")
    period = _read(directory / "cpu.cfs_period_us")
    return None if quota is None or period is None else _ratio(quota, period)


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
