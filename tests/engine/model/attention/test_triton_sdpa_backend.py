"""The `triton-sdpa` backend: long prompts without a cached prefix attended by torch's SDPA,
everything else by the Triton kernels, computes what `triton` computes (within each dtype's
rounding).

Without a GPU the kernels run under Triton's interpreter and SDPA on the CPU; on a GPU
(`scripts/gpu_bench.sh --part smoke`) the bfloat16 cases run SDPA's flash kernel, and an
engine on the backend starts (its start-up profile) and generates.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

pytest.importorskip("triton")  # run under the interpreter without a GPU (tests/conftest.py)

from engine.frontend.llm import LLM
from engine.model.attention import make_attention_backend, triton_backend
from engine.model.attention.backend import AttentionLayout
from engine.model.attention.triton_backend import (
    TritonBackend,
    TritonMetadata,
    TritonSdpaBackend,
    sdpa_padded_rows,
)
from engine.model.attention.triton_kernels import FP8_KV_DTYPE
from engine.sampling_params import SamplingParams

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
BLOCK_SIZE = 8
NUM_KV_HEADS, GROUP, HEAD_DIM = 2, 3, 32
MAX_BLOCKS = 8
TOLERANCES = {torch.float32: {"atol": 1e-4, "rtol": 1e-4},
              torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2}}


def make_layout(dtype: torch.dtype, sliding_window: int | None = None,
                kv_dtype: torch.dtype | None = None) -> AttentionLayout:
    return AttentionLayout(num_heads=NUM_KV_HEADS * GROUP, num_kv_heads=NUM_KV_HEADS,
                           head_dim=HEAD_DIM, block_size=BLOCK_SIZE,
                           sliding_window=sliding_window, device=DEVICE, dtype=dtype,
                           max_model_len=MAX_BLOCKS * BLOCK_SIZE, kv_dtype=kv_dtype)


class Step:
    """A step's sequences (decodes first, as the runner lays them out) with random queries and
    K/V, and a cache whose context slots hold random K/V; sequence i owns blocks
    i * MAX_BLOCKS onwards."""

    def __init__(self, context_lens: list[int], query_lens: list[int], dtype: torch.dtype,
                 seed: int = 0) -> None:
        generator = torch.Generator().manual_seed(seed)
        num_tokens = sum(query_lens)

        def draw(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, generator=generator).to(DEVICE, dtype)

        self.query = draw(num_tokens, NUM_KV_HEADS * GROUP, HEAD_DIM)
        self.key = draw(num_tokens, NUM_KV_HEADS, HEAD_DIM)
        self.value = draw(num_tokens, NUM_KV_HEADS, HEAD_DIM)
        num_slots = (len(query_lens) * MAX_BLOCKS + 1) * BLOCK_SIZE
        self.kv_cache = draw(2, num_slots, NUM_KV_HEADS, HEAD_DIM)
        self.context_lens = np.array(context_lens)
        self.query_lens = np.array(query_lens)
        self.block_table = (np.arange(len(query_lens))[:, None] * MAX_BLOCKS
                            + np.arange(MAX_BLOCKS)[None, :])

    def attend(self, backend: TritonBackend) -> tuple[TritonMetadata, torch.Tensor,
                                                      torch.Tensor]:
        """The backend's plan, output (float32 on the CPU) and cache after the step."""
        metadata = backend.build_metadata(self.query_lens, self.context_lens, self.block_table)
        kv_cache = self.kv_cache.clone()
        out = metadata.attend(self.query, self.key, self.value, kv_cache, HEAD_DIM ** -0.5)
        return metadata, out.float().cpu(), kv_cache.cpu()


# Two decodes, a chunk over a cached prefix, then prompts with no cached prefix, shortest
# first: 5 tokens (under the bound of 16) and 16 and 27 (at and over it).
MIXED = ([30, 12, 16, 0, 0, 0], [1, 1, 8, 5, 16, 27])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_long_fresh_prompts_go_to_sdpa_and_the_step_attends_as_with_the_kernels(
        dtype: torch.dtype) -> None:
    step = Step(*MIXED, dtype=dtype)
    kernels = TritonBackend(make_layout(dtype))
    hybrid = TritonSdpaBackend(make_layout(dtype), min_sdpa_prompt_tokens=16)
    _, expected, expected_cache = step.attend(kernels)
    metadata, out, cache = step.attend(hybrid)
    if DEVICE.type == "cuda" and dtype == torch.float32:
        assert metadata.sdpa_prompts == ()  # SDPA's flash kernel takes 16-bit inputs only
    else:
        assert metadata.sdpa_prompts == ((15, 31), (31, 58))
        assert metadata.prefill is not None
        assert metadata.prefill.seq_lens.tolist() == [24, 5]  # the chunk, the short prompt
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, expected, **TOLERANCES[dtype])
    assert torch.equal(cache, expected_cache)  # every token's K/V written alike


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_step_of_one_long_prompt_is_sdpa_alone(dtype: torch.dtype) -> None:
    step = Step([0], [40], dtype=dtype, seed=1)
    _, expected, expected_cache = step.attend(TritonBackend(make_layout(dtype)))
    metadata, out, cache = step.attend(TritonSdpaBackend(make_layout(dtype), 16))
    if not (DEVICE.type == "cuda" and dtype == torch.float32):
        assert metadata.sdpa_prompts == ((0, 40),)
        assert metadata.prefill is None and metadata.decode is None
    torch.testing.assert_close(out, expected, **TOLERANCES[dtype])
    assert torch.equal(cache, expected_cache)


def test_prompts_before_a_short_one_or_a_chunk_stay_with_the_kernel() -> None:
    backend = TritonSdpaBackend(make_layout(torch.float32), min_sdpa_prompt_tokens=16)
    # Only a suffix goes to SDPA: a long prompt before a short one is the kernel's.
    metadata = backend.build_metadata(np.array([20, 5]), np.array([0, 0]),
                                      np.zeros((2, MAX_BLOCKS), dtype=np.int64))
    assert metadata.sdpa_prompts == ()
    metadata = backend.build_metadata(np.array([20, 30]), np.array([0, 8]),
                                      np.zeros((2, MAX_BLOCKS), dtype=np.int64))
    assert metadata.sdpa_prompts == ()


def test_a_sliding_window_keeps_every_prompt_with_the_kernel() -> None:
    step = Step([0, 0], [20, 30], dtype=torch.float32)
    windowed = make_layout(torch.float32, sliding_window=8)
    _, expected, _ = step.attend(TritonBackend(windowed))
    metadata, out, _ = step.attend(TritonSdpaBackend(windowed, 16))
    assert metadata.sdpa_prompts == ()
    torch.testing.assert_close(out, expected, **TOLERANCES[torch.float32])


def test_an_fp8_cache_keeps_every_prompt_with_the_kernel() -> None:
    # The kernels read the cache's rounded K/V; SDPA would read the step's own, and a
    # prompt's result would then depend on whether it hit the prefix cache.
    backend = TritonSdpaBackend(make_layout(torch.float32, kv_dtype=FP8_KV_DTYPE), 16)
    assert not backend.sdpa_applies
    metadata = backend.build_metadata(np.array([20, 30]), np.array([0, 0]),
                                      np.zeros((2, MAX_BLOCKS), dtype=np.int64))
    assert metadata.sdpa_prompts == ()


def test_start_up_profiles_a_step_for_each_kernel_variant() -> None:
    # A prompt alone would leave the prefill kernel (under triton-sdpa) and its split variant
    # uncompiled and their tiles untuned until a serving step reached them. In bfloat16,
    # which SDPA takes on every device (on CUDA, no float32).
    short = make_layout(torch.bfloat16)
    assert short.max_model_len == 64  # no step splits its keys
    long = dataclasses.replace(short, max_model_len=4096)
    assert TritonBackend(short).profiled_steps(64) == ((64, 0),)
    # Under the bound (1,792) the budget's prompt is the kernel's; at 16, SDPA's.
    assert TritonSdpaBackend(short).min_sdpa_prompt_tokens == 1792
    assert TritonSdpaBackend(short).profiled_steps(64) == ((64, 0),)
    assert TritonSdpaBackend(short, 16).profiled_steps(64) == ((64, 0), (63, 1))
    fp8 = TritonSdpaBackend(dataclasses.replace(short, kv_dtype=FP8_KV_DTYPE))
    assert fp8.profiled_steps(64) == ((64, 0),)
    chunk = (256, 4096 - 256)
    assert TritonBackend(long).profiled_steps(2048) == ((2048, 0), chunk)
    # Then, for each count of SDPA's rows, a prompt padded to it and one of it exactly (its
    # own strided rows): 1,792 exactly, 1,793 padded to 2,048 (2,048: the budget's prompt);
    # from a bound of 256, every multiple of 256 and the length after it.
    assert TritonSdpaBackend(long).profiled_steps(2048) == (
        (2048, 0), (2047, 1), chunk, (1792, 0), (1793, 0))
    buckets = tuple((query_len, 0) for rows in range(256, 2048, 256)
                    for query_len in (rows, rows + 1))
    assert TritonSdpaBackend(long, 256).profiled_steps(2048) == (
        (2048, 0), (2047, 1), chunk, *buckets)
    # Prompts of 1,500 to 2,000 tokens: 1,536, 1,792 and 2,048 rows (the budget's prompt,
    # padded).
    assert TritonSdpaBackend(long, 1500).profiled_steps(2000) == (
        (2000, 0), (1999, 1), chunk, (1500, 0), (1536, 0), (1537, 0), (1792, 0))
    # No prompt of one token (a step's shortest prefill is two).
    assert TritonSdpaBackend(long, 1).profiled_steps(300)[-2:] == ((2, 0), (256, 0))
    assert TritonBackend(long).profiled_steps(100) == ((100, 0), (100, 3996))
    # The smallest budget still reaches every variant: SDPA, the kernel, its split.
    assert TritonSdpaBackend(long, 2).profiled_steps(2) == ((2, 0), (2, 1), (2, 4094))
    metadata = TritonBackend(long).build_metadata(
        np.array([chunk[0]]), np.array([chunk[1]]), np.zeros((1, 512), dtype=np.int64))
    assert metadata.prefill is not None and metadata.prefill.num_splits > 1


def test_sdpa_rows_come_in_buckets() -> None:
    assert [sdpa_padded_rows(n) for n in (1, 256, 257, 1792, 1793, 2048)] == [
        256, 256, 512, 1792, 2048, 2048]
    assert [sdpa_padded_rows(n) for n in (2049, 2561, 4096, 4097, 16385)] == [
        2560, 3072, 4096, 5120, 20480]


@pytest.mark.parametrize("tokens", [300, 256])
def test_a_prompt_padded_for_sdpa_attends_as_it_would_alone(
        tokens: int, monkeypatch: pytest.MonkeyPatch) -> None:
    rows: list[int] = []
    sdpa = triton_backend.sdpa_in_row_slices

    def counted(query: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        rows.append(query.shape[0])
        return sdpa(query, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(triton_backend, "sdpa_in_row_slices", counted)
    generator = torch.Generator().manual_seed(tokens)
    query = torch.randn(tokens, NUM_KV_HEADS * GROUP, HEAD_DIM, generator=generator)
    key, value = (torch.randn(tokens, NUM_KV_HEADS, HEAD_DIM, generator=generator)
                  for _ in range(2))
    out = triton_backend.causal_sdpa(query, key, value, 0.3)
    assert rows == [512 if tokens == 300 else 256]
    assert out.shape == query.shape
    expected = sdpa(query, key, value, mask=None, scale=0.3, max_score_bytes=None)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_the_backend_is_chosen_by_name_and_checks_its_bound() -> None:
    backend = make_attention_backend("triton-sdpa", make_layout(torch.float32))
    assert isinstance(backend, TritonSdpaBackend) and backend.name == "triton-sdpa"
    with pytest.raises(ValueError, match="min_sdpa_prompt_tokens"):
        TritonSdpaBackend(make_layout(torch.float32), min_sdpa_prompt_tokens=0)


@pytest.fixture
def sdpa_rows(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The rows of each call `triton-sdpa` makes to SDPA, in order, with the bound on its
    prompts at 256 tokens (1,792 by default): small models' engines reach it."""
    monkeypatch.setattr(triton_backend, "MIN_SDPA_PROMPT_TOKENS", 256)  # the default's
    rows: list[int] = []
    causal_sdpa = triton_backend.causal_sdpa

    def counted(query: torch.Tensor, *args: object) -> torch.Tensor:
        rows.append(query.shape[0])
        return causal_sdpa(query, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(triton_backend, "causal_sdpa", counted)
    return rows


@pytest.mark.skipif(torch.cuda.is_available(),
                    reason="the kernels run under the interpreter, on CPU tensors, only without "
                           "a GPU; with one, the next test runs the backend")
def test_an_engine_on_triton_sdpa_computes_what_sdpa_does(sdpa_rows: list[int]) -> None:
    # A 300-token prompt (over the bound of 256: SDPA) and a short one (the kernel)
    # in one step, each position's logprobs compared; then a prompt sharing the long one's
    # first 256 tokens: a prefix-cache hit, whose 44 new tokens the kernel attends over the
    # cached blocks. One token each: decode steps are slow under the interpreter.
    generator = torch.Generator().manual_seed(3)
    long_prompt = torch.randint(0, 256, (300,), generator=generator).tolist()
    short_prompt = torch.randint(0, 256, (20,), generator=generator).tolist()
    hit_prompt = long_prompt[:256] + torch.randint(0, 256, (44,), generator=generator).tolist()
    first_params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, logprobs=2,
                                  prompt_logprobs=2)
    hit_params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, logprobs=2)
    results = {}
    for backend in ("sdpa", "triton-sdpa"):
        # fcfs: the continuum policy's start-up prefill profile is slow under the interpreter.
        llm = LLM(attention_backend=backend, block_size=BLOCK_SIZE, num_kv_blocks=128,
                  max_model_len=512, scheduling_policy="fcfs", device="cpu")
        sdpa_rows.clear()
        try:
            first = llm.generate([long_prompt, short_prompt], first_params, use_tqdm=False)
            (hit,) = llm.generate([hit_prompt], hit_params, use_tqdm=False)
        finally:
            llm.shutdown()
        assert hit.num_cached_tokens == 256
        results[backend] = [*first, hit]
        # The runner put the long prompt after the short one, though it came first: SDPA
        # took it in every layer, and nothing else.
        assert sdpa_rows == ([300] * 4 if backend == "triton-sdpa" else [])
    for sdpa, hybrid in zip(results["sdpa"], results["triton-sdpa"], strict=True):
        assert hybrid.outputs[0].token_ids == sdpa.outputs[0].token_ids
        for ours, theirs in zip([*(hybrid.prompt_logprobs or [None])[1:],
                                 *hybrid.outputs[0].logprobs],
                                [*(sdpa.prompt_logprobs or [None])[1:],
                                 *sdpa.outputs[0].logprobs], strict=True):
            assert ours is not None and theirs is not None
            assert ours.top_token_ids == theirs.top_token_ids
            np.testing.assert_allclose(ours.top_logprobs, theirs.top_logprobs, atol=1e-4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_an_engine_on_triton_sdpa_computes_what_triton_does_on_cuda(
        sdpa_rows: list[int]) -> None:
    # In bf16: each prompt position's logprob of its token against an engine on `triton`,
    # SDPA called for the 300-token prompt in every layer (the start-up profile's calls
    # aside), and the same tokens again through a prefix-cache hit.
    generator = torch.Generator().manual_seed(4)
    prompt = torch.randint(0, 256, (300,), generator=generator).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, prompt_logprobs=1)
    # Prompt logprobs are computed, not read from the prefix cache: the hit asks for none.
    hit_params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    results = {}
    for backend in ("triton", "triton-sdpa"):
        llm = LLM(attention_backend=backend, device="cuda", num_kv_blocks=128,
                  max_model_len=512)
        sdpa_rows.clear()
        try:
            (first,) = llm.generate([prompt], params, use_tqdm=False)
            (again,) = llm.generate([prompt], hit_params, use_tqdm=False)
        finally:
            llm.shutdown()
        assert sdpa_rows == ([300] * 4 if backend == "triton-sdpa" else [])
        assert again.num_cached_tokens > 0
        assert again.outputs[0].token_ids == first.outputs[0].token_ids
        results[backend] = first
    kernel, hybrid = results["triton"], results["triton-sdpa"]
    assert kernel.prompt_logprobs is not None and hybrid.prompt_logprobs is not None
    np.testing.assert_allclose(
        [entry.logprob for entry in hybrid.prompt_logprobs[1:] if entry is not None],
        [entry.logprob for entry in kernel.prompt_logprobs[1:] if entry is not None],
        atol=5e-2)
