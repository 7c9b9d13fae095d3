"""The usable cores: the affinity mask, lowered by the CPU quotas of the process's cgroups."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from engine.cpu_cores import cgroup_cpu_quota, usable_cores

NAMESPACED = "0::/\n"  # inside a cgroup namespace: the process's cgroup is the mount's root


def _cgroup(root: Path, files: dict[str, str], proc_cgroup: str = NAMESPACED
            ) -> tuple[Path, Path]:
    """(a cgroup mount holding `files`, a /proc/self/cgroup file saying `proc_cgroup`)."""
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text + "\n")
    (root / "proc-cgroup").write_text(proc_cgroup)
    return root, root / "proc-cgroup"


@pytest.mark.parametrize(("files", "quota"), [
    ({"cpu.max": "max 100000"}, None),
    ({"cpu.max": "150000 100000"}, 1.5),
    ({"cpu.max": "400000 100000"}, 4.0),
    ({"cpu/cpu.cfs_quota_us": "-1", "cpu/cpu.cfs_period_us": "100000"}, None),
    ({"cpu/cpu.cfs_quota_us": "50000", "cpu/cpu.cfs_period_us": "100000"}, 0.5),
    ({"cpu,cpuacct/cpu.cfs_quota_us": "300000", "cpu,cpuacct/cpu.cfs_period_us": "100000"},
     3.0),
    ({"cpu/cpu.cfs_quota_us": "50000"}, None),
    ({"cpu.max": "garbage"}, None),
    ({}, None),
], ids=["v2-none", "v2-1.5", "v2-4", "v1-none", "v1-0.5", "v1-cpu,cpuacct", "v1-no-period",
        "malformed", "no-cgroup"])
def test_the_quota_is_read_from_cgroup_v2_or_v1(tmp_path, files, quota):
    assert cgroup_cpu_quota(*_cgroup(tmp_path, files)) == quota


def test_the_quota_of_a_nested_cgroup_is_the_smallest_along_its_path(tmp_path):
    """Without a cgroup namespace (a systemd service, `docker --cgroupns=host`) the quota
    sits in the process's own cgroup, or in one of its ancestors, not at the mount's root."""
    files = {"system.slice/cpu.max": "200000 100000",
             "system.slice/app.service/cpu.max": "400000 100000",
             "other.slice/cpu.max": "50000 100000"}
    assert cgroup_cpu_quota(*_cgroup(tmp_path / "v2", files,
                                     "0::/system.slice/app.service\n")) == 2.0
    v1 = {"cpu,cpuacct/docker/abc/cpu.cfs_quota_us": "150000",
          "cpu,cpuacct/docker/abc/cpu.cfs_period_us": "100000"}
    assert cgroup_cpu_quota(*_cgroup(tmp_path / "v1", v1,
                                     "4:memory:/docker/abc\n3:cpu,cpuacct:/docker/abc\n0::/\n"
                                     )) == 1.5


def test_the_quota_lowers_the_affinity_mask_rounded_up(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(64)), raising=False)
    assert usable_cores(*_cgroup(tmp_path / "none", {"cpu.max": "max 100000"})) == 64
    assert usable_cores(*_cgroup(tmp_path / "quota", {"cpu.max": "150000 100000"})) == 2
    assert usable_cores(*_cgroup(tmp_path / "small", {"cpu.max": "10000 100000"})) == 1
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    assert usable_cores(*_cgroup(tmp_path / "large", {"cpu.max": "800000 100000"})) == 2
