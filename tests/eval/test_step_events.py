"""`eval.step_events`: collections and Triton compiles between takes."""

import gc
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest

from eval import step_events
from eval.step_events import NUM_GENERATIONS, StepEventRecorder, StepEvents

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def no_automatic_collections() -> Iterator[None]:
    """Only the test's own `gc.collect` calls collect (an allocation could start one)."""
    was_enabled = gc.isenabled()
    gc.disable()
    yield
    if was_enabled:
        gc.enable()


def test_collections_are_counted_by_generation_and_timed_until_the_next_take(
        no_automatic_collections: None) -> None:
    with StepEventRecorder() as recorder:
        recorder.take()
        gc.collect(2)
        gc.collect(0)
        events = recorder.take()
        assert events.gc_collections == (1, 0, 1)
        assert events.gc_ms > 0
        assert recorder.take() == StepEvents()
    assert recorder._on_collection not in gc.callbacks


def test_nothing_is_recorded_after_the_block(no_automatic_collections: None) -> None:
    with StepEventRecorder() as recorder:
        pass
    gc.collect()
    events = recorder.take()
    assert events.gc_collections == (0,) * NUM_GENERATIONS and events.gc_ms == 0


def test_a_compile_and_a_disk_cache_load_are_told_apart_and_the_replaced_listener_called(
        monkeypatch: pytest.MonkeyPatch) -> None:
    heard = []

    def earlier_listener(**kwargs: object) -> None:
        heard.append(kwargs["cache_hit"])

    knobs = SimpleNamespace(listener=earlier_listener)
    monkeypatch.setattr(step_events, "_triton_compilation_knobs", lambda: knobs)
    kernel = SimpleNamespace(name="_prefill_kernel")
    with StepEventRecorder() as recorder:
        listener = knobs.listener
        assert listener is not earlier_listener
        # As Triton's compiler calls it (keywords only); times in microseconds.
        listener(src=kernel, metadata={}, metadata_group={},
                 times=SimpleNamespace(total=412_000), cache_hit=False)
        listener(src=kernel, metadata={}, metadata_group={},
                 times=SimpleNamespace(total=900), cache_hit=True)
        assert recorder.take().triton_compiles == (
            "_prefill_kernel (412 ms)", "_prefill_kernel (from the disk cache)")
        assert recorder.take().triton_compiles == ()
    assert heard == [False, True]
    assert knobs.listener is earlier_listener


def test_without_triton_only_collections_are_recorded(
        monkeypatch: pytest.MonkeyPatch, no_automatic_collections: None) -> None:
    monkeypatch.setattr(step_events, "_triton_compilation_knobs", lambda: None)
    with StepEventRecorder() as recorder:
        gc.collect(1)
        events = recorder.take()
    assert events == StepEvents((0, 1, 0), events.gc_ms, None)


def test_triton_itself_reports_a_compile_then_a_load_from_its_disk_cache(
        tmp_path: Path) -> None:
    """A real compile for sm_90 (no GPU needed), twice: the second finds the first's files."""
    pytest.importorskip("triton")
    script = (
        "import json\n"
        "import triton\n"
        "import triton.language as tl\n"
        "from triton.backends.compiler import GPUTarget\n"
        "from triton.compiler import ASTSource\n"
        "from eval.step_events import StepEventRecorder\n"
        "@triton.jit\n"
        "def _add_one(x_ptr, n, BLOCK: tl.constexpr):\n"
        "    offsets = tl.arange(0, BLOCK)\n"
        "    mask = offsets < n\n"
        "    tl.store(x_ptr + offsets, tl.load(x_ptr + offsets, mask=mask) + 1, mask=mask)\n"
        "def compile_once():\n"
        "    source = ASTSource(fn=_add_one, signature={'x_ptr': '*fp32', 'n': 'i32',\n"
        "                       'BLOCK': 'constexpr'}, constexprs={'BLOCK': 64})\n"
        "    triton.compile(source, target=GPUTarget('cuda', 90, 32))\n"
        "with StepEventRecorder() as recorder:\n"
        "    compile_once()\n"
        "    first = recorder.take()\n"
        "    compile_once()\n"
        "    second = recorder.take()\n"
        "print(json.dumps([first.triton_compiles, second.triton_compiles]))\n"
    )
    path = tmp_path / "compile_twice.py"  # Triton reads a kernel's source from its file
    path.write_text(script)
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "cache")
    env["PYTHONPATH"] = str(REPO)
    result = subprocess.run([sys.executable, str(path)], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    first, second = json.loads(result.stdout)
    assert len(first) == 1 and first[0].startswith("_add_one (") and first[0].endswith(" ms)")
    assert second == ["_add_one (from the disk cache)"]
