"""Dependency rules of docs/architecture.md, 'Layers', checked mechanically."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

SCHEDULER_SIDE = [
    "engine.config",
    "engine.request",
    "engine.sampling_params",
    "engine.outputs",
    "engine.kv_cache",
    "engine.scheduler",
    "engine.bench.scheduler",
    "engine.core.engine_core",
    "engine.core.wire",
    "engine.structured_output.manager",
    "engine.executor.base",
    "engine.model.directory",
]


def test_scheduler_side_does_not_import_torch() -> None:
    pytest.importorskip("torch")  # the check means something only where torch is installed
    imports = "; ".join(f"import {module}" for module in SCHEDULER_SIDE)
    code = (
        f"import sys; {imports}; "
        "from engine.scheduler.registry import POLICY_REGISTRY, make_policy; "
        "[make_policy(name, tool_duration_s=dict().get) if name == 'continuum-oracle' "
        "else make_policy(name) for name in POLICY_REGISTRY]; "
        "print('torch' in sys.modules)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "False"


def _engine_sources() -> list[Path]:
    return sorted((ROOT / "engine").rglob("*.py"))


def test_engine_has_no_policy_branches() -> None:
    pattern = re.compile(
        r"policy(_name)?\s*(==|!=|\bin\b|\bis\b(?!\s+(not\s+)?None\b))|isinstance\([^)]*Policy\)"
    )
    offenders = [
        f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
        for path in _engine_sources()
        for number, line in enumerate(path.read_text().splitlines(), start=1)
        if pattern.search(line)
    ]
    assert offenders == []


def test_engine_never_imports_policy_or_estimator_packages() -> None:
    pattern = re.compile(r"^\s*(import|from)\s+(continuum|estimator|eval)\b")
    offenders = [
        f"{path.relative_to(ROOT)}:{number}"
        for path in _engine_sources()
        for number, line in enumerate(path.read_text().splitlines(), start=1)
        if pattern.search(line)
    ]
    assert offenders == []


def _imports_of(package: str) -> list[tuple[Path, int, str]]:
    return [
        (path, number, line)
        for path in sorted((ROOT / package).rglob("*.py"))
        for number, line in enumerate(path.read_text().splitlines(), start=1)
    ]


def test_estimator_never_imports_the_engine_or_policies() -> None:
    pattern = re.compile(r"^\s*(import|from)\s+(engine|continuum|eval)\b")
    offenders = [
        f"{path.relative_to(ROOT)}:{number}"
        for path, number, line in _imports_of("estimator")
        if pattern.search(line)
    ]
    assert offenders == []


def test_policies_import_only_engine_interfaces_and_the_estimator() -> None:
    pattern = re.compile(
        r"^\s*(import|from)\s+(eval\b|torch\b|engine\.(model|worker|executor|core|frontend|"
        r"entrypoints))"
    )
    offenders = [
        f"{path.relative_to(ROOT)}:{number}"
        for path, number, line in _imports_of("continuum")
        if pattern.search(line)
    ]
    assert offenders == []


def test_tracing_imports_only_the_stdlib_msgspec_and_plotting_for_analysis() -> None:
    project = re.compile(r"^\s*(import|from)\s+(engine|continuum|estimator|eval)\b")
    plotting = re.compile(r"^\s*(import|from)\s+matplotlib\b")
    offenders = [
        f"{path.relative_to(ROOT)}:{number}"
        for path, number, line in _imports_of("tracing")
        if project.search(line) or (plotting.search(line) and path.name != "timeline.py")
    ]
    assert offenders == []
