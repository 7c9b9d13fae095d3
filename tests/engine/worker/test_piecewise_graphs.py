"""Steps that are not decode-only, by pieces on static buffers: buckets, padding, the runner's
use of them and their memory. Off CUDA the pieces run eagerly; where CUDA is
(`scripts/gpu_bench.sh --part smoke`) the same tests replay the captured graphs."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from engine.model.attention import AttentionMetadata
from engine.worker.model_runner import ModelRunner
from engine.worker.piecewise_graphs import PiecewiseGraphs, piecewise_buckets
from tests.engine.worker.test_model_runner import make_runner, prompt, request, run

BLOCK_SIZE = 8
ON_CUDA = torch.cuda.is_available()
# A bucket's product and the whole forward's may take GEMM kernels of different row counts.
HIDDEN_TOLERANCE = {"atol": 1e-4, "rtol": 1e-4} if ON_CUDA else {"atol": 1e-5, "rtol": 1e-5}


def test_buckets_step_up_to_the_budget_or_the_largest_captured_step() -> None:
    assert piecewise_buckets(2048, 512)[:8] == (8, 16, 32, 48, 64, 96, 128, 160)
    assert piecewise_buckets(2048, 512)[-3:] == (384, 448, 512)
    assert piecewise_buckets(100, 512)[-3:] == (64, 96, 100)
    assert piecewise_buckets(5, 512) == (5,)
    assert piecewise_buckets(2048, 40)[-2:] == (32, 40)
    assert all(b - a <= 64 for a, b in itertools.pairwise(piecewise_buckets(4096, 512)))


def test_beyond_512_tokens_each_doubling_takes_four_buckets() -> None:
    assert piecewise_buckets(2048, 2048)[-9:] == (512, 640, 768, 896, 1024, 1280, 1536, 1792,
                                                  2048)
    assert piecewise_buckets(16384, 8192)[-4:] == (5120, 6144, 7168, 8192)
    assert piecewise_buckets(1000, 2048)[-2:] == (896, 1000)
    # Beyond 512 a step of n tokens pads fewer than n / 4 rows: the worst is one token past a
    # bucket.
    buckets = piecewise_buckets(16384, 16384)
    assert all(b - (a + 1) < (a + 1) / 4 for a, b in itertools.pairwise(buckets) if a >= 512)


def piecewise_runner(attention_backend: str = "sdpa", max_num_batched_tokens: int = 64,
                     enabled: bool = True, piecewise_max_tokens: int = 512) -> ModelRunner:
    return ModelRunner(EngineConfig(
        model=ModelConfig(model="tiny", attention_backend=attention_backend,  # type: ignore[arg-type]
                          dtype="float32", piecewise_graphs=enabled,
                          piecewise_max_tokens=piecewise_max_tokens),
        cache=CacheConfig(block_size=BLOCK_SIZE, num_kv_blocks=64),
        scheduler=SchedulerConfig(max_model_len=64, max_num_batched_tokens=max_num_batched_tokens,
                                  max_num_seqs=8),
    ))


def mixed_step(runner: ModelRunner, query_lens: list[int], context_lens: list[int]
               ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """Input ids, positions and metadata of a step whose sequences own blocks in turn: decodes
    first, then chunks over cached contexts, then a prompt."""
    blocks_per_seq = min(64 // BLOCK_SIZE, runner.num_kv_blocks // len(query_lens))
    table = np.arange(len(query_lens) * blocks_per_seq).reshape(len(query_lens), -1)
    metadata = runner.attention.build_metadata(np.array(query_lens), np.array(context_lens),
                                               table)
    num_tokens = sum(query_lens)
    input_ids = torch.tensor(prompt(num_tokens, seed=num_tokens), device=runner.device)
    return input_ids, torch.from_numpy(metadata.positions).to(runner.device), metadata


@pytest.mark.parametrize("attention_backend", ["sdpa", "triton"])
@torch.inference_mode()
def test_a_step_by_pieces_matches_the_whole_forward_whatever_the_padding_rows_hold(
        attention_backend: str) -> None:
    if attention_backend == "triton":
        pytest.importorskip("triton")  # under the interpreter without a GPU
    runner = piecewise_runner(attention_backend)
    graphs = runner.piecewise_graphs
    assert graphs is not None and graphs.buckets == (8, 16, 32, 48, 64)
    # Captured where CUDA is: every bucket's every piece.
    assert len(graphs._graphs) == (5 * runner.model.num_pieces if ON_CUDA else 0)
    generator = torch.Generator().manual_seed(0)
    for cache in runner.kv_caches:
        cache.copy_(torch.randn(cache.shape, generator=generator))
    # A large step, then smaller ones into the rows it filled. Before each, the attention
    # output's rows past the step's are poisoned (the one buffer a piece reads that the
    # eager attention, not a piece, writes) and the hidden states' rows marked: the pieces
    # must run the padding rows into NaN, no real row may read them, and nothing may write
    # past the bucket.
    for query_lens, context_lens in (([1, 1, 9, 30], [7, 12, 3, 0]), ([1, 6], [5, 10]),
                                     ([1, 1, 1, 4, 2], [3, 9, 4, 0, 6])):
        num_tokens = sum(query_lens)
        bucket = {41: 48, 7: 8, 9: 16}[num_tokens]
        graphs._attention_out[num_tokens:] = float("nan")
        graphs._hidden[:] = 7.0
        input_ids, positions, metadata = mixed_step(runner, query_lens, context_lens)
        caches = [cache.clone() for cache in runner.kv_caches]
        expected = runner.model(input_ids, positions, caches, metadata)
        hidden = graphs.run(input_ids, positions, runner.kv_caches, metadata)
        assert hidden.shape == expected.shape
        torch.testing.assert_close(hidden, expected, **HIDDEN_TOLERANCE)
        assert torch.isnan(graphs._hidden[num_tokens:bucket]).all()  # the padding ran
        assert (graphs._hidden[bucket:] == 7.0).all()
        for cache, expected_cache in zip(runner.kv_caches, caches, strict=True):
            torch.testing.assert_close(cache, expected_cache, atol=1e-6, rtol=1e-6)


@torch.inference_mode()
def test_a_step_beyond_the_largest_bucket_is_refused() -> None:
    runner = piecewise_runner(max_num_batched_tokens=16)
    graphs = runner.piecewise_graphs
    assert graphs is not None and graphs.fits(16) and not graphs.fits(17)
    input_ids, positions, metadata = mixed_step(runner, [17], [0])
    with pytest.raises(ValueError, match="exceeds the largest bucket"):
        graphs.run(input_ids, positions, runner.kv_caches, metadata)


def test_without_layers_or_buckets_there_are_no_pieces() -> None:
    runner = make_runner()
    with pytest.raises(ValueError, match="need a bucket"):
        PiecewiseGraphs(runner.model, (), runner.device, runner.dtype, use_graphs=False)


def test_the_runner_takes_steps_that_fit_by_pieces_and_samples_as_without(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Prompts chunked by a 16-token budget beside decodes, prefix-cache hits on a shared
    # prefix, a seeded random sampler and penalties: the same tokens with and without.
    requests = [
        ("shared-a", prompt(24, 1), {"max_tokens": 6}),
        ("shared-b", prompt(24, 1)[:20] + prompt(5, 2), {"max_tokens": 5}),
        ("seeded", prompt(13, 3), {"max_tokens": 7, "temperature": 0.9, "seed": 11}),
        ("penalised", prompt(9, 4), {"max_tokens": 4, "presence_penalty": 0.5}),
    ]

    def run_requests(runner: ModelRunner) -> dict[str, list[int]]:
        return run(runner, [request(req_id, tokens, **params)
                            for req_id, tokens, params in requests])[0]

    expected = run_requests(piecewise_runner(max_num_batched_tokens=16, enabled=False))
    runner = piecewise_runner(max_num_batched_tokens=16)
    graphs = runner.piecewise_graphs
    assert graphs is not None
    steps_by_pieces = []
    graphs_run = graphs.run

    def spy(input_ids: torch.Tensor, *args: object) -> torch.Tensor:
        steps_by_pieces.append(input_ids.shape[0])
        return graphs_run(input_ids, *args)

    monkeypatch.setattr(graphs, "run", spy)
    assert run_requests(runner) == expected
    # Every step fits the largest bucket (the budget's 16 tokens), chunks and, as `sdpa`
    # has no decode graphs, decode-only steps too.
    assert max(steps_by_pieces) == 16 and min(steps_by_pieces) < 8


def test_the_memory_profile_reserves_the_largest_bucket_by_pieces_with_its_buffers(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # On CUDA the pool leaves room for the buffers and the graphs' pool; here the same code
    # runs (its peaks not measured): each profiled run's peak is told apart by its order.
    built_inside: list[bool] = []
    measuring = False

    class Recorded(PiecewiseGraphs):
        def __init__(self, *args: object, **kwargs: object) -> None:
            built_inside.append(measuring)
            super().__init__(*args, **kwargs)  # type: ignore[arg-type]

    def reserved(runner: ModelRunner) -> tuple[int, list[object]]:
        results: list[object] = []

        def peak_bytes(device: torch.device, run) -> int:
            nonlocal measuring
            measuring = True
            results.append(run())
            measuring = False
            return 1000 * len(results)

        with monkeypatch.context() as patch:
            patch.setattr("engine.worker.model_runner._peak_bytes", peak_bytes)
            patch.setattr("engine.worker.model_runner.PiecewiseGraphs", Recorded)
            return runner._profile_reserved_bytes(), results

    without, runs_without = reserved(piecewise_runner(max_num_batched_tokens=40, enabled=False))
    with_pieces, runs = reserved(piecewise_runner(max_num_batched_tokens=40))
    # The prefill, the piecewise step (its buffers built inside it), then sampling.
    assert len(runs_without) == 2 and len(runs) == 3 and built_inside == [True]
    hidden = runs[1]
    assert hidden.shape == (40, 128) and torch.isfinite(hidden).all()
    # Sampling's peak is the largest either way (the third run's 3000 against 2000); the
    # piecewise step's adds its own, 2000.
    assert with_pieces - without == (3000 - 2000) + 2000


def test_without_the_option_or_with_enforce_eager_no_step_runs_by_pieces() -> None:
    assert make_runner().piecewise_graphs is None  # off by default
    runner = ModelRunner(EngineConfig(
        model=ModelConfig(model="tiny", piecewise_graphs=True, enforce_eager=True),
        cache=CacheConfig(block_size=BLOCK_SIZE, num_kv_blocks=16),
        scheduler=SchedulerConfig(max_model_len=64, max_num_batched_tokens=16, max_num_seqs=2)))
    assert runner.piecewise_graphs is None and runner._piecewise_peak_bytes([]) == 0


def test_a_step_beyond_the_largest_captured_step_runs_eagerly_and_samples_as_without(
        monkeypatch: pytest.MonkeyPatch) -> None:
    runner = piecewise_runner(max_num_batched_tokens=32, piecewise_max_tokens=16)
    graphs = runner.piecewise_graphs
    assert graphs is not None and graphs.buckets[-1] == 16
    steps_by_pieces: list[int] = []
    graphs_run = graphs.run

    def spy(input_ids: torch.Tensor, *args: object) -> torch.Tensor:
        steps_by_pieces.append(input_ids.shape[0])
        return graphs_run(input_ids, *args)

    eager_steps: list[int] = []
    model_forward = runner.model.forward

    def eager_spy(input_ids: torch.Tensor, *args: object) -> torch.Tensor:
        eager_steps.append(input_ids.shape[0])
        return model_forward(input_ids, *args)

    monkeypatch.setattr(graphs, "run", spy)
    monkeypatch.setattr(runner.model, "forward", eager_spy)

    def requests() -> list:
        return [request("long", prompt(30, 5), max_tokens=4),
                request("short", prompt(6, 6), max_tokens=4)]

    expected = run(piecewise_runner(max_num_batched_tokens=32, enabled=False), requests())[0]
    assert run(runner, requests())[0] == expected
    # The prompts' first step fills the 32-token budget and runs eagerly; the rest, by pieces.
    assert eager_steps == [32] and steps_by_pieces and max(steps_by_pieces) <= 16


def test_the_largest_captured_step_must_be_positive() -> None:
    with pytest.raises(ValueError, match="piecewise_max_tokens must be a positive integer"):
        ModelConfig(piecewise_graphs=True, piecewise_max_tokens=0)
