"""The usable cores: the affinity mask, lowered by the cgroup's CPU quota."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from engine.cpu_cores import cgroup_cpu_quota, usable_cores


def _cgroup(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text + "\n")
    return root


@pytest.mark.parametrize(("files", "quota"), [
    ({"cpu.max": "max 100000"}, None),
    ({"cpu.max": "150000 100000"}, 1.5),
    ({"cpu.max": "400000 100000"}, 4.0),
    ({"cpu/cpu.cfs_quota_us": "-1", "cpu/cpu.cfs_period_us": "100000"}, None),
    ({"cpu/cpu.cfs_quota_us": "50000", "cpu/cpu.cfs_period_us": "100000"}, 0.5),
    ({"cpu/cpu.cfs_quota_us": "50000"}, None),
    ({"cpu.max": "garbage"}, None),
    ({}, None),
], ids=["v2-none", "v2-1.5", "v2-4", "v1-none", "v1-0.5", "v1-no-period", "unreadable",
        "no-cgroup"])
def test_the_quota_is_read_from_cgroup_v2_or_v1(tmp_path, files, quota):
    assert cgroup_cpu_quota(_cgroup(tmp_path, files)) == quota


def test_the_quota_lowers_the_affinity_mask_rounded_up(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(64)), raising=False)
    assert usable_cores(_cgroup(tmp_path / "none", {"cpu.max": "max 100000"})) == 64
    assert usable_cores(_cgroup(tmp_path / "quota", {"cpu.max": "150000 100000"})) == 2
    assert usable_cores(_cgroup(tmp_path / "small", {"cpu.max": "10000 100000"})) == 1
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    assert usable_cores(_cgroup(tmp_path / "large", {"cpu.max": "800000 100000"})) == 2
