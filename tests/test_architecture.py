"""Dependency rules of docs/architecture.md, 'Layers', checked mechanically: the import
contracts of pyproject.toml (`[tool.importlinter]`, run with import-linter), no import circle
between modules, the torch-free scheduler side at run time, and no policy branches."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
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
    "engine.core.engine_core",
    "engine.core.wire",
    "engine.structured_output.output_manager",
    "engine.executor.base",
    "engine.model.directory",
    "eval.bench.scheduler",
]


def test_scheduler_side_does_not_import_torch() -> None:
    pytest.importorskip("torch")  # the check means something only where torch is installed
    imports = "; ".join(f"import {module}" for module in SCHEDULER_SIDE)
    code = (
        f"import sys; {imports}; "
        "from engine.scheduler.policy_registry import POLICIES, make_policy; "
        "from eval.policy_variants import EVAL_POLICIES; "
        "[make_policy(name) for name in POLICIES]; "
        "[make_policy(path, tool_duration_s=dict().get) if name == 'continuum-oracle' "
        "else make_policy(path) for name, path in EVAL_POLICIES.items()]; "
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


def _lint_imports(root: Path) -> subprocess.CompletedProcess[str]:
    pytest.importorskip("importlinter")  # the dev extra installs it on Python 3.11 and later
    return subprocess.run(
        [sys.executable, "-c", "import sys; from importlinter.cli import lint_imports_command; "
                               "sys.exit(lint_imports_command())", "--no-cache"], cwd=root,
        env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"},
        capture_output=True, text=True, check=False,
    )


def test_the_layer_contracts_hold() -> None:
    result = _lint_imports(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert ", 0 broken." in result.stdout


def _configuration() -> dict:
    api = pytest.importorskip("importlinter.api")  # on Python 3.11 and later
    return api.read_configuration(str(ROOT / "pyproject.toml"))


def _root_packages() -> list[str]:
    return _configuration()["session_options"]["root_packages"]


def _layers() -> list[str]:
    return _configuration()["contracts_options"][0]["layers"]


def _copy_packages(destination: Path) -> None:
    shutil.copy(ROOT / "pyproject.toml", destination)
    for package in _root_packages():
        shutil.copytree(ROOT / package, destination / package,
                        ignore=shutil.ignore_patterns("__pycache__", "*.json*", "*.md"))


@pytest.mark.parametrize(("importer", "imported", "contract"), [
    ("engine/kv_cache/block.py", "engine.scheduler.scheduler", "Layers only point down"),
    ("estimator/eq2.py", "continuum.agent_policy", "Layers only point down"),
    ("engine/core/engine_core.py", "continuum.agent_policy", "without importing them"),
    ("engine/scheduler/sweep.py", "torch", "never import torch"),
])
def test_an_upward_import_breaks_a_contract(
    tmp_path: Path, importer: str, imported: str, contract: str
) -> None:
    _copy_packages(tmp_path)
    module = tmp_path / importer
    module.write_text(module.read_text() + f"\nimport {imported}  # noqa\n")
    result = _lint_imports(tmp_path)
    assert result.returncode == 1
    _, _, broken = result.stdout.partition("Broken contracts")
    assert contract in broken and imported in broken, result.stdout + result.stderr


def _module_graph() -> dict[str, set[str]]:
    grimp = pytest.importorskip("grimp")  # on Python 3.11 and later
    graph = grimp.build_graph(*_root_packages(), cache_dir=None)
    return {module: graph.find_modules_directly_imported_by(module) for module in graph.modules}


def _circles(graph: dict[str, set[str]]) -> Iterator[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()

    def visit(module: str) -> Iterator[list[str]]:
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for imported in graph.get(module, ()):
            if imported not in index:
                yield from visit(imported)
                low[module] = min(low[module], low[imported])
            elif imported in on_stack:
                low[module] = min(low[module], index[imported])
        if low[module] == index[module]:
            component = []
            while not component or component[-1] != module:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            if len(component) > 1:
                yield sorted(component)

    for module in sorted(graph):
        if module not in index:
            yield from visit(module)


def test_no_import_circle_between_modules() -> None:
    assert list(_circles(_module_graph())) == []
    assert list(_circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}})) == [["a", "b", "c"]]


def test_every_module_has_a_layer() -> None:
    listed = [name.strip() for layer in _layers() for name in re.split(r"[:|]", layer)]
    facades = {"engine", "engine.structured_output"}  # package docstrings and lazy names only
    unplaced = [module for module in _module_graph()
                if module not in facades
                and not any(module == name or module.startswith(f"{name}.") for name in listed)]
    assert unplaced == []
