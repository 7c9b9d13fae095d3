"""The model runner on the embedded tiny model, driven by the real scheduler."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch

from engine.config import CacheConfig, EngineConfig, KVCacheDtype, ModelConfig, SchedulerConfig
from engine.model.directory import load_arch
from engine.request import Request
from engine.sample import sampler as sampler_module
from engine.sample.metadata import SamplingMetadata
from engine.sampling_params import SamplingParams
from engine.scheduler.output import NewRequestData
from engine.scheduler.policies import FCFSPolicy
from engine.scheduler.scheduler import Scheduler
from engine.worker.input_batch import InputBatch
from engine.worker.kv_cache_sizing import (
    determine_num_kv_blocks,
    kv_block_bytes,
    resolve_kv_cache_dtype,
)
from engine.worker.model_runner import ModelRunner
from engine.worker.token_counts import TokenCounts
from tests.engine.helpers import FakeClock

BLOCK_SIZE = 4


def make_runner(num_kv_blocks: int = 128, max_num_batched_tokens: int = 64) -> ModelRunner:
    return ModelRunner(EngineConfig(
        model=ModelConfig(model="tiny"),
        cache=CacheConfig(block_size=BLOCK_SIZE, num_kv_blocks=num_kv_blocks),
        scheduler=SchedulerConfig(max_model_len=64, max_num_batched_tokens=max_num_batched_tokens,
                                  max_num_seqs=8),
    ))


def prompt(length: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (length,), generator=generator).tolist()


def run(runner: ModelRunner, requests: list[Request],
        check_step: Callable[[ModelRunner], None] | None = None
        ) -> tuple[dict[str, list[int]], int]:
    """Runs the requests to completion, calling `check_step` after every step; returns their
    tokens and the number of preemptions."""
    config = runner.config
    scheduler = Scheduler(config.scheduler, config.cache, FCFSPolicy(),
                          num_kv_blocks=runner.num_kv_blocks, clock=FakeClock())
    for request in requests:
        scheduler.add_request(request)
    outputs: dict[str, list[int]] = {request.request_id: [] for request in requests}
    num_preempted = 0
    while scheduler.requests:
        scheduler_output = scheduler.schedule()
        num_preempted += len(scheduler_output.preempted_req_ids)
        runner_output = runner.execute_model(scheduler_output)
        for output in scheduler.update_from_output(scheduler_output, runner_output):
            outputs[output.request_id].extend(output.new_token_ids)
        scheduler.check_invariants()
        if check_step is not None:
            check_step(runner)
    runner.execute_model(scheduler.schedule())
    assert runner.batch.num_reqs == 0
    return outputs, num_preempted


def request(req_id: str, tokens: list[int], **params: object) -> Request:
    return Request(req_id, tokens, SamplingParams(ignore_eos=True, **params), arrival_time_s=0.0)


def check_penalty_counts(runner: ModelRunner) -> None:
    """The device's counts of every penalised row are those of the tokens the row holds."""
    batch = runner.batch
    rows = [row for row, state in enumerate(batch.rows) if state.sampling_params.has_penalties]
    if not rows:
        return
    penalties = batch.sampling_metadata(rows).penalties
    assert penalties is not None
    vocab_size = runner.arch.vocab_size
    for index, row in enumerate(rows):
        tokens = batch.token_ids[row, : batch.num_tokens[row]]
        outputs = tokens[batch.rows[row].num_prompt_tokens :]
        expected_counts = np.bincount(outputs, minlength=vocab_size)
        assert penalties.output_counts[index].tolist() == expected_counts.tolist()
        seen = np.zeros(vocab_size, dtype=bool)
        seen[tokens] = True
        assert penalties.seen_mask[index].tolist() == seen.tolist()


def test_penalties_count_the_tokens_rows_hold_through_moves_and_preemption() -> None:
    penalised = {"temperature": 1.0, "max_tokens": 12, "frequency_penalty": 0.5,
                 "repetition_penalty": 1.3}
    requests = [request(f"r{i}", prompt(6 + 3 * i, i), seed=i,
                        **(penalised if i % 3 else {"temperature": 1.0, "max_tokens": 5 + i}))
                for i in range(7)]
    checks = []

    def check(runner: ModelRunner) -> None:
        check_penalty_counts(runner)
        checks.append(runner.batch.num_reqs)

    _, num_preempted = run(make_runner(num_kv_blocks=16), requests, check)
    assert num_preempted > 0 and max(checks) > 2


def test_seeded_request_is_reproducible_across_batches_and_preemption() -> None:
    seeded = {"seed": 1234, "temperature": 1.0, "max_tokens": 14}
    alone, _ = run(make_runner(), [request("r", prompt(10, 0), **seeded)])
    crowd = [request(f"o{i}", prompt(6 + 3 * i, i + 1), temperature=1.0, max_tokens=14)
             for i in range(5)]
    together, num_preempted = run(make_runner(num_kv_blocks=16),
                                  [*crowd[:2], request("r", prompt(10, 0), **seeded), *crowd[2:]])
    assert num_preempted > 0
    assert together["r"] == alone["r"]
    assert len(set(alone["r"])) > 1


def test_unseeded_sampling_follows_the_model_seed() -> None:
    params = {"temperature": 1.0, "max_tokens": 10}
    first, _ = run(make_runner(), [request("r", prompt(8, 0), **params)])
    again, _ = run(make_runner(), [request("r", prompt(8, 0), **params)])
    assert first == again


def test_partial_prefill_samples_nothing_and_logprobs_are_returned() -> None:
    runner = make_runner(max_num_batched_tokens=16)
    scheduler = Scheduler(runner.config.scheduler, runner.config.cache, FCFSPolicy(),
                          num_kv_blocks=runner.num_kv_blocks, clock=FakeClock())
    scheduler.add_request(request("long", prompt(30, 1), temperature=0.0, logprobs=3))
    scheduler.add_request(request("plain", prompt(3, 2), temperature=0.0))
    scheduler_output = scheduler.schedule()
    output = runner.execute_model(scheduler_output)
    scheduler.update_from_output(scheduler_output, output)
    tokens = dict(zip(output.req_ids, output.sampled_token_ids, strict=True))
    assert tokens == {"long": []}  # the budget holds only a chunk of it
    assert output.logprobs is None
    while True:
        scheduler_output = scheduler.schedule()
        output = runner.execute_model(scheduler_output)
        scheduler.update_from_output(scheduler_output, output)
        index = output.req_ids.index("long") if "long" in output.req_ids else None
        if index is not None and output.sampled_token_ids[index]:
            break
    assert output.logprobs is not None
    entry, = output.logprobs[index]
    assert entry.token_id == output.sampled_token_ids[index][0]
    assert entry.rank == 1 and len(entry.top_token_ids) == 3
    assert entry.top_token_ids[0] == entry.token_id
    assert entry.top_logprobs == sorted(entry.top_logprobs, reverse=True)
    assert all(lp is None for i, lp in enumerate(output.logprobs) if i != index)


def make_batch() -> InputBatch:
    return InputBatch(max_num_reqs=4, max_model_len=16, max_blocks_per_req=4, vocab_size=32,
                      device=torch.device("cpu"))


def new_request(req_id: str, tokens: list[int], outputs: list[int], blocks: list[int],
                **params: object) -> NewRequestData:
    return NewRequestData(req_id=req_id, prompt_token_ids=tokens, output_token_ids=outputs,
                          sampling_params=SamplingParams(**params), block_ids=blocks,
                          num_computed_tokens=0, eos_token_id=9)


def test_input_batch_keeps_rows_dense() -> None:
    batch = make_batch()
    for index in range(3):
        batch.add(new_request(f"r{index}", [index] * (index + 2), [], [10 * index, 10 * index + 1]))
    batch.remove("r0")
    assert batch.num_reqs == 2 and batch.row_of == {"r2": 0, "r1": 1}
    assert batch.token_ids[0, : batch.num_tokens[0]].tolist() == [2, 2, 2, 2]
    assert batch.block_table[0, :2].tolist() == [20, 21]
    batch.append_blocks("r2", [22])
    assert batch.append_placeholders(np.array([0])).tolist() == [4]
    batch.set_token(0, 4, 7)
    assert batch.token_ids[0, : batch.num_tokens[0]].tolist() == [2, 2, 2, 2, 7]
    assert batch.block_table[0, :3].tolist() == [20, 21, 22]


def bans(metadata: SamplingMetadata) -> list[tuple[int, int]]:
    """The (row, token) entries of minus infinity in the metadata's sparse logit bias."""
    bias = metadata.logit_bias
    if bias is None:
        return []
    return [(row, token_id) for row, token_id, value in zip(
        bias.rows.tolist(), bias.token_ids.tolist(), bias.values.tolist(), strict=True)
        if value == float("-inf")]


@pytest.mark.parametrize(("params", "max_top_k"), [
    ([{}, {"temperature": 0.0}], None),  # no filter
    ([{"top_k": 5}, {"top_k": 20, "top_p": 0.9}, {}], 20),  # every top-p has a top-k
    ([{"top_k": 5}, {"top_p": 0.9}], None),  # a top-p alone: the whole vocabulary
    ([{"top_k": 500}], 32),  # no more than the vocabulary
])
def test_sampling_metadata_bounds_the_filters_candidates_by_top_k(
        params: list[dict[str, object]], max_top_k: int | None) -> None:
    batch = make_batch()
    for index, row_params in enumerate(params):
        batch.add(new_request(f"r{index}", [1], [], [index], **row_params))
    assert batch.sampling_metadata(list(range(len(params)))).max_top_k == max_top_k


def test_sampling_metadata_bans_stops_until_min_tokens_and_counts_penalties() -> None:
    batch = make_batch()
    batch.add(new_request("a", [1, 2], [5, 5], [0], min_tokens=3, stop_token_ids=(4,),
                          frequency_penalty=0.5))
    batch.add(new_request("b", [3], [], [1], min_tokens=3, ignore_eos=True, temperature=0.0,
                          repetition_penalty=1.2))
    metadata = batch.sampling_metadata([0, 1])
    assert bans(metadata) == [(0, 4), (0, 9)]  # b's stop list is empty, EOS ignored
    assert metadata.output_positions == [2, 0]
    assert metadata.penalties is not None
    assert metadata.penalties.output_counts[0].tolist() == [0] * 5 + [2] + [0] * 26
    assert metadata.penalties.seen_mask[0].nonzero().flatten().tolist() == [1, 2, 5]
    assert metadata.penalties.seen_mask[1].nonzero().flatten().tolist() == [3]
    # A step samples 7 for b and 5 for a: counted on the device, from the sampled ids.
    batch.count_sampled([1, 0], torch.tensor([7, 5]))
    batch.append_placeholders(np.array([1, 0]))
    counted = batch.sampling_metadata([1, 0]).penalties
    assert counted is not None
    assert counted.output_counts[:, [5, 7]].tolist() == [[0, 1], [3, 0]]
    assert counted.seen_mask[0].nonzero().flatten().tolist() == [3, 7]
    assert bans(batch.sampling_metadata([0])) == []  # a has its three tokens


def test_kv_pool_sized_from_the_cpu_budget() -> None:
    arch = load_arch("tiny")
    block_bytes = kv_block_bytes(arch, 16, torch.float32)
    assert block_bytes == 16 * 2 * 4 * 2 * 32 * 4
    config = CacheConfig(block_size=16, cpu_kv_cache_space_gib=0.01)
    num_blocks = determine_num_kv_blocks(config, arch, torch.float32, torch.device("cpu"), 2048)
    assert num_blocks == int(0.01 * 2**30) // block_bytes
    fixed = CacheConfig(block_size=16, num_kv_blocks=300)
    assert determine_num_kv_blocks(fixed, arch, torch.float32, torch.device("cpu"), 2048) == 300
    tiny_budget = CacheConfig(block_size=16, cpu_kv_cache_space_gib=0.0001)
    with pytest.raises(ValueError, match="cannot hold one sequence"):
        determine_num_kv_blocks(tiny_budget, arch, torch.float32, torch.device("cpu"), 2048)


def test_runner_allocates_the_pool_it_reports() -> None:
    runner = make_runner(num_kv_blocks=40)
    arch = runner.arch
    assert len(runner.kv_caches) == arch.num_hidden_layers
    # The pool and the null block, where padding rows of a static decode batch write.
    assert runner.kv_caches[0].shape == (2, 41 * BLOCK_SIZE, arch.num_key_value_heads,
                                         arch.head_dim)
    assert np.all(runner.batch.num_tokens == 0)


def test_an_fp8_cache_takes_a_quarter_of_float32s_bytes_and_decodes_alike() -> None:
    pytest.importorskip("triton")  # the triton backend reads fp8; on CPU under the interpreter
    arch, cpu = load_arch("tiny"), torch.device("cpu")
    budget = CacheConfig(block_size=16, cpu_kv_cache_space_gib=0.01)
    float8 = resolve_kv_cache_dtype("fp8", torch.float32)
    assert float8 is torch.float8_e4m3fn
    block_bytes = kv_block_bytes(arch, 16, float8)
    assert 4 * block_bytes == kv_block_bytes(arch, 16, torch.float32)
    assert determine_num_kv_blocks(budget, arch, float8, cpu, 2048) == int(
        0.01 * 2**30) // block_bytes

    def runner(kv_cache_dtype: KVCacheDtype) -> ModelRunner:
        return ModelRunner(EngineConfig(
            model=ModelConfig(model="tiny", attention_backend="triton"),
            cache=CacheConfig(block_size=8, num_kv_blocks=64, kv_cache_dtype=kv_cache_dtype),
            scheduler=SchedulerConfig(max_model_len=64, max_num_batched_tokens=64,
                                      max_num_seqs=8)))

    requests = [[request(f"r{i}", prompt(20 + 7 * i, i), max_tokens=8) for i in range(3)]
                for _ in range(2)]
    fp8_runner = runner("fp8")
    assert all(cache.dtype is torch.float8_e4m3fn for cache in fp8_runner.kv_caches)
    # The tiny model's greedy continuations of these prompts survive the cache's rounding.
    assert run(fp8_runner, requests[0]) == run(runner("auto"), requests[1])
    with pytest.raises(ValueError, match="sdpa attention backend reads a KV cache"):
        ModelRunner(EngineConfig(
            model=ModelConfig(model="tiny", attention_backend="sdpa"),
            cache=CacheConfig(block_size=8, num_kv_blocks=64, kv_cache_dtype="fp8"),
            scheduler=SchedulerConfig(max_model_len=64, max_num_batched_tokens=64)))


def test_an_fp8_cache_needs_a_gpu_that_compiles_float8(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("triton")
    from engine.model.attention.triton_backend import check_float8_runs_on

    cuda = torch.device("cuda")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    with pytest.raises(ValueError, match=r"compute capability 8\.9 or newer.*has 8\.0"):
        check_float8_runs_on(cuda)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    check_float8_runs_on(cuda)
    check_float8_runs_on(torch.device("cpu"))  # the interpreter converts float8


def test_placeholders_take_the_next_positions_until_their_tokens_are_set() -> None:
    batch = make_batch()
    batch.add(new_request("a", [1, 2], [], [0]))
    batch.add(new_request("b", [3], [7], [1], presence_penalty=0.5))
    positions = batch.append_placeholders(np.array([1, 0]))
    assert positions.tolist() == [2, 2] and batch.num_tokens.tolist()[:2] == [3, 3]
    batch.count_sampled([1, 0], torch.tensor([8, 9]))  # the placeholders' tokens, on the device
    batch.set_token(0, 2, 9)
    batch.remove("a")  # b moves into row 0, its placeholder and its counts with it
    batch.set_token(0, 2, 8)
    assert batch.token_ids[0, :3].tolist() == [3, 7, 8]
    penalties = batch.sampling_metadata([0]).penalties
    assert penalties is not None
    assert penalties.output_counts[0].nonzero().flatten().tolist() == [7, 8]
    assert penalties.seen_mask[0].nonzero().flatten().tolist() == [3, 7, 8]
    batch.remove("b")
    assert batch.num_reqs == 0


def test_the_start_up_profile_runs_each_step_the_backend_names_over_the_scratch(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # On CUDA these forwards compile and tune every kernel variant before the pool is sized;
    # here the same code runs on the CPU (its peaks not measured). The split variant's step,
    # a chunk over the longest context, reads the few scratch blocks again and again.
    pytest.importorskip("triton")
    runner = ModelRunner(EngineConfig(
        model=ModelConfig(model="tiny", attention_backend="triton"),
        cache=CacheConfig(block_size=16, num_kv_blocks=65),
        scheduler=SchedulerConfig(max_model_len=1030, max_num_batched_tokens=16,
                                  max_num_seqs=2)))
    build_metadata = runner.attention.build_metadata
    plans = []

    def spy(query_lens: np.ndarray, context_lens: np.ndarray, block_table: np.ndarray):
        metadata = build_metadata(query_lens, context_lens, block_table)
        plans.append((query_lens.tolist(), context_lens.tolist(), int(block_table.max()),
                      metadata.prefill.num_splits))
        return metadata

    peaks = iter([10, 20, 30, 40])  # the two prefill forwards, the decode one, sampling

    def peak_bytes(device: torch.device, run) -> int:
        result = run()  # the forwards' hidden states, or the sampler's output
        assert not isinstance(result, torch.Tensor) or torch.isfinite(result).all()
        return next(peaks)

    monkeypatch.setattr(runner.attention, "build_metadata", spy)
    monkeypatch.setattr("engine.worker.model_runner._peak_bytes", peak_bytes)
    reserved_bytes = runner._profile_reserved_bytes()
    # The scratch holds 2 blocks (the largest decode bucket's) and the null block; the
    # chunk's 65 blocks read them in turn.
    assert plans == [([16], [0], 0, 1), ([16], [1014], 2, 2)]
    # The largest peak (sampling's), the decode forward's again for the graphs' pool, the
    # null block, and the penalties' counts of 2 rows.
    assert reserved_bytes == (40 + 30 + kv_block_bytes(runner.arch, 16, runner.kv_dtype)
                              + TokenCounts.num_bytes(2, runner.arch.vocab_size))


def test_the_memory_profile_samples_with_every_feature(monkeypatch: pytest.MonkeyPatch
                                                      ) -> None:
    """On CUDA the pool leaves room for what a step does after its forward, sampling the
    most rows with everything on; here the same code runs (its peak not measured) and each
    of the sampler's steps sees every row."""
    runner = make_runner(max_num_batched_tokens=16)
    rows_seen: dict[str, int] = {}

    def spy(name: str) -> None:
        function = getattr(sampler_module, name)

        def recording(logits: torch.Tensor, *args: object) -> torch.Tensor:
            rows_seen[name] = logits.shape[0]
            return function(logits, *args)

        monkeypatch.setattr(sampler_module, name, recording)

    for name in ("apply_logit_bias", "apply_grammar", "apply_penalties", "apply_min_p",
                 "apply_top_k_top_p", "gather_logprobs"):
        spy(name)
    outputs = []

    def peak_bytes(device: torch.device, run) -> int:
        outputs.append(run())
        return 7

    monkeypatch.setattr("engine.worker.model_runner._peak_bytes", peak_bytes)
    assert runner._sampling_peak_bytes(num_tokens=16, num_rows=5) == 7
    sampled, = outputs
    assert sampled.sampled_token_ids.shape == (5,) and sampled.logprobs.token_ids.shape == (5, 21)
    assert rows_seen == dict.fromkeys(rows_seen, 5) and len(rows_seen) == 6


def test_the_penalties_counts_are_rewritten_whole_and_take_the_bytes_reserved() -> None:
    counts = TokenCounts(max_num_reqs=3, vocab_size=50, device=torch.device("cpu"))
    counts.allocate()
    counts.write_row(1, [4, 4, 9], [2])
    counts.add_sampled(torch.tensor([1, 1]), torch.tensor([2, 7]))
    output_counts, seen = counts.gather(torch.tensor([1]))
    assert output_counts[0].nonzero().flatten().tolist() == [2, 7]
    assert output_counts[0, [2, 7]].tolist() == [2, 1]
    assert seen[0].nonzero().flatten().tolist() == [2, 4, 7, 9]
    counts.write_row(1, [5], [])  # another request takes the row: nothing of the first stays
    output_counts, seen = counts.gather(torch.tensor([1]))
    assert not output_counts.any() and seen[0].nonzero().flatten().tolist() == [5]
    tables = counts._tables()
    assert sum(t.numel() * t.element_size() for t in tables) == TokenCounts.num_bytes(3, 50)
