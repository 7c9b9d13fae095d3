"""`eval.bench.step_events`: collections and Triton compiles between takes."""

import gc
from types import SimpleNamespace

import pytest

from eval.bench import step_events
from eval.bench.step_events import NUM_GENERATIONS, StepEventRecorder, StepEvents


@pytest.fixture
def no_automatic_collections():
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


def test_nothing_is_recorded_outside_the_block() -> None:
    recorder = StepEventRecorder()
    gc.collect()
    assert recorder.take() == StepEvents((0,) * NUM_GENERATIONS, 0.0, ())


def test_compiles_are_named_and_the_replaced_hook_still_called_then_restored(
        monkeypatch: pytest.MonkeyPatch) -> None:
    seen = []

    def earlier_hook(**kwargs: object) -> bool:
        seen.append(kwargs["fn"].name)
        return False

    knobs = SimpleNamespace(jit_post_compile_hook=earlier_hook)
    monkeypatch.setattr(step_events, "_triton_runtime_knobs", lambda: knobs)
    with StepEventRecorder() as recorder:
        hook = knobs.jit_post_compile_hook
        assert hook is not earlier_hook
        # As Triton's JIT calls it after each compile (keywords only).
        assert hook(key="k", repr="r", fn=SimpleNamespace(name="_prefill_kernel"), compile={},
                    is_manual_warmup=False, already_compiled=False) is False
        assert recorder.take().triton_compiles == ("_prefill_kernel",)
        assert recorder.take().triton_compiles == ()
    assert seen == ["_prefill_kernel"]
    assert knobs.jit_post_compile_hook is earlier_hook


def test_the_real_triton_hook_is_set_inside_the_block_only() -> None:
    knobs = step_events._triton_runtime_knobs()
    if knobs is None:
        pytest.skip("triton is not installed")
    before = knobs.jit_post_compile_hook
    with StepEventRecorder() as recorder:
        assert knobs.jit_post_compile_hook == recorder._on_compile
    assert knobs.jit_post_compile_hook is before


def test_without_triton_only_collections_are_recorded(
        monkeypatch: pytest.MonkeyPatch, no_automatic_collections: None) -> None:
    monkeypatch.setattr(step_events, "_triton_runtime_knobs", lambda: None)
    with StepEventRecorder() as recorder:
        gc.collect(1)
        events = recorder.take()
    assert events == StepEvents((0, 1, 0), events.gc_ms, ())
