"""Our model code against transformers on tiny random checkpoints (float32, CPU).

Logits are compared at every computed position through the same attention-metadata builder the
model runner uses; greedy continuations run through the real scheduler and model runner. On a
GPU, float32 is compared with float32 and bfloat16 with transformers in bfloat16 (bfloat16's own
rounding moves these logits by a tenth or more, so no float32 tolerance fits it).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import PreTrainedModel

from engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from engine.model.attention import AttentionLayout, make_attention_backend
from engine.model.attention.sdpa import group_decodes
from engine.model.llama import LlamaForCausalLM
from engine.model.loader import load_model
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.scheduler.policies import FCFSPolicy
from engine.scheduler.scheduler import Scheduler
from engine.worker.model_runner import ModelRunner
from tests.engine.helpers import FakeClock
from tests.engine.model.checkpoints import (
    ARCHITECTURES,
    VOCAB_SIZE,
    make_hf_model,
    save_checkpoint,
)

ATOL = 1e-4
BLOCK_SIZE = 4
NUM_BLOCKS = 640


@dataclass
class Checkpoint:
    name: str
    path: Path
    hf_model: PreTrainedModel
    model: LlamaForCausalLM


@pytest.fixture(scope="module", params=ARCHITECTURES)
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
               ) -> Checkpoint:
    hf_model = make_hf_model(request.param)
    path = save_checkpoint(hf_model, tmp_path_factory.mktemp(request.param))
    model = load_model(ModelConfig(model=str(path)), torch.device("cpu"), torch.float32, 512)
    return Checkpoint(request.param, path, hf_model, model)


def hf_logits(hf_model: PreTrainedModel, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([token_ids])).logits[0].float()


def random_tokens(count: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB_SIZE, (count,), generator=generator).tolist()


@dataclass
class PagedSequences:
    """Drives the model directly over a paged cache: sequences, block tables, one step at a time."""

    model: LlamaForCausalLM
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    kv_caches: list[torch.Tensor] = field(init=False)
    tokens: dict[str, list[int]] = field(default_factory=dict)
    num_computed: dict[str, int] = field(default_factory=dict)
    blocks: dict[str, list[int]] = field(default_factory=dict)
    next_block: int = 0
    attention_backend: str = "sdpa"
    block_size: int = BLOCK_SIZE

    def __post_init__(self) -> None:
        arch = self.model.arch
        shape = (2, NUM_BLOCKS * self.block_size, arch.num_key_value_heads, arch.head_dim)
        # Unwritten slots hold a huge value: attending to one by mistake ruins the logits.
        dtype = self.model.lm_head.weight.dtype
        self.backend = make_attention_backend(self.attention_backend, AttentionLayout.of_model(
            arch, self.block_size, self.device, dtype,
            max_model_len=NUM_BLOCKS * self.block_size))
        self.kv_caches = [torch.full(shape, 1e3, dtype=dtype, device=self.device)
                          for _ in range(arch.num_hidden_layers)]

    def add(self, seq_id: str, tokens: list[int], shared_from: str | None = None,
            num_shared_blocks: int = 0) -> None:
        """A sequence, optionally reusing the first blocks (KV) of another one."""
        self.tokens[seq_id] = list(tokens)
        self.blocks[seq_id] = list(self.blocks[shared_from][:num_shared_blocks]) if shared_from \
            else []
        self.num_computed[seq_id] = num_shared_blocks * self.block_size

    def step(self, query_lens: dict[str, int]) -> dict[str, torch.Tensor]:
        """Computes `query_lens[seq]` more tokens of each sequence; returns their logits."""
        order = sorted(query_lens, key=lambda seq_id: (query_lens[seq_id] != 1,
                                                       -self.num_computed[seq_id]))
        for seq_id in order:
            needed = -(-(self.num_computed[seq_id] + query_lens[seq_id]) // self.block_size)
            while len(self.blocks[seq_id]) < needed:
                self.blocks[seq_id].append(self.next_block)
                self.next_block += 1
        table = np.zeros((len(order), NUM_BLOCKS), dtype=np.int64)
        for row, seq_id in enumerate(order):
            table[row, : len(self.blocks[seq_id])] = self.blocks[seq_id]
        lens = np.array([query_lens[s] for s in order])
        contexts = np.array([self.num_computed[s] for s in order])
        metadata = self.backend.build_metadata(lens, contexts, table)
        input_ids = torch.tensor([
            token for seq_id in order for token in
            self.tokens[seq_id][self.num_computed[seq_id]:][: query_lens[seq_id]]
        ], device=self.device)
        with torch.no_grad():
            hidden = self.model(input_ids, torch.from_numpy(metadata.positions).to(self.device),
                                self.kv_caches, metadata)
            logits = self.model.compute_logits(hidden).cpu()
        result, start = {}, 0
        for seq_id in order:
            result[seq_id] = logits[start : start + query_lens[seq_id]]
            start += query_lens[seq_id]
            self.num_computed[seq_id] += query_lens[seq_id]
        return result


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.shape == expected.shape
    assert (actual - expected).abs().max().item() < ATOL


def test_single_prefill(checkpoint: Checkpoint) -> None:
    tokens = random_tokens(50, seed=1)
    paged = PagedSequences(checkpoint.model)
    paged.add("a", tokens)
    assert_close(paged.step({"a": 50})["a"], hf_logits(checkpoint.hf_model, tokens))


def test_chunked_prefill(checkpoint: Checkpoint) -> None:
    tokens = random_tokens(50, seed=2)
    paged = PagedSequences(checkpoint.model)
    paged.add("a", tokens)
    chunks = [paged.step({"a": size})["a"] for size in (16, 21, 13)]
    assert_close(torch.cat(chunks), hf_logits(checkpoint.hf_model, tokens))


def test_admission_with_prefix_cache_hit(checkpoint: Checkpoint) -> None:
    first = random_tokens(45, seed=3)
    second = first[:36] + random_tokens(14, seed=4)
    paged = PagedSequences(checkpoint.model)
    paged.add("first", first)
    paged.step({"first": 45})
    paged.add("second", second, shared_from="first", num_shared_blocks=9)
    logits = paged.step({"second": 14})["second"]
    assert_close(logits, hf_logits(checkpoint.hf_model, second)[36:])


def triton_device() -> torch.device:
    """Where Triton kernels run in this suite: the GPU if there is one, else the CPU under the
    interpreter."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


# The triton kernels run on the GPU where there is one, else under Triton's interpreter; the
# attention kernels need blocks of >= 8. (attention backend, layer kernels, block size): sdpa
# with torch's ops is the CPU default, triton with fused layer kernels the CUDA one, sdpa
# with them CUDA's sdpa.
BACKENDS = [("sdpa", "torch", BLOCK_SIZE),
            pytest.param("triton", "triton", 8, id="triton"),
            pytest.param("sdpa", "triton", BLOCK_SIZE, id="sdpa-triton-layers")]


@pytest.mark.parametrize(("backend", "layer_kernels", "block_size"), BACKENDS)
def test_mixed_batch_of_decodes_chunks_prefills_and_hits(checkpoint: Checkpoint, backend: str,
                                                         layer_kernels: str,
                                                         block_size: int) -> None:
    model, device = checkpoint.model, torch.device("cpu")
    if layer_kernels == "triton" or backend == "triton":
        pytest.importorskip("triton")
        # The interpreter runs the kernels on CPU tensors only where there is no GPU
        # (tests/conftest.py); on a GPU machine they run on it, still in float32.
        device = triton_device()
        model = load_model(ModelConfig(model=str(checkpoint.path), layer_kernels=layer_kernels),
                           device, torch.float32, 512)
        assert model.model.norm.use_triton == (layer_kernels == "triton")
    if backend == "triton" and model.arch.head_dim not in (32, 64, 128):
        with pytest.raises(ValueError, match="does not cover head_dim"):
            PagedSequences(model, device=device, attention_backend=backend)
        return
    hf_model = checkpoint.hf_model
    seqs = {name: random_tokens(length, seed=10 + i)
            for i, (name, length) in enumerate([("d1", 40), ("d2", 7), ("chunk", 33)])}
    paged = PagedSequences(model, device=device, attention_backend=backend,
                           block_size=block_size)
    for name, tokens in seqs.items():
        paged.add(name, tokens)
    paged.step({"d1": 39, "d2": 6, "chunk": 20})
    seqs["new"] = random_tokens(26, seed=20)
    seqs["hit"] = seqs["d1"][:32] + random_tokens(9, seed=21)
    paged.add("new", seqs["new"])
    paged.add("hit", seqs["hit"], shared_from="d1", num_shared_blocks=32 // block_size)
    for step in range(3):
        query_lens = {"d1": 1, "d2": 1}
        if step == 0:
            query_lens.update({"chunk": 13, "new": 26, "hit": 9})
        for name in ("d1", "d2"):
            seqs[name].append(random_tokens(1, seed=100 * step + len(name))[0])
            paged.tokens[name] = list(seqs[name])
        logits = paged.step(query_lens)
        for name, rows in logits.items():
            end = paged.num_computed[name]
            assert_close(rows, hf_logits(hf_model, seqs[name][:end])[end - query_lens[name]:])


def test_many_decodes_of_varied_lengths_attend_in_groups(checkpoint: Checkpoint) -> None:
    lengths = list(range(6, 6 + 3 * 34, 3))
    seqs = {f"s{i}": random_tokens(length, seed=200 + i) for i, length in enumerate(lengths)}
    assert len(group_decodes(np.array(sorted(lengths, reverse=True)))) > 1
    paged = PagedSequences(checkpoint.model)
    for name, tokens in seqs.items():
        paged.add(name, tokens)
    paged.step({name: len(tokens) - 1 for name, tokens in seqs.items()})
    logits = paged.step(dict.fromkeys(seqs, 1))
    for name, rows in logits.items():
        assert_close(rows, hf_logits(checkpoint.hf_model, seqs[name])[-1:])


def test_greedy_continuations_of_a_batch_match_generate(checkpoint: Checkpoint) -> None:
    prompts = [random_tokens(length, seed=30 + i)
               for i, length in enumerate([3, 9, 17, 24, 31, 40, 52, 61, 70, 12])]
    prompts.append(prompts[6][:28] + random_tokens(5, seed=50))  # shares a cached prefix
    max_tokens = 12
    config = EngineConfig(
        model=ModelConfig(model=str(checkpoint.path), device="cpu", dtype="float32"),
        cache=CacheConfig(block_size=BLOCK_SIZE, num_kv_blocks=NUM_BLOCKS),
        scheduler=SchedulerConfig(max_model_len=128, max_num_batched_tokens=64, max_num_seqs=16),
    )
    runner = ModelRunner(config)
    scheduler = Scheduler(config.scheduler, config.cache, FCFSPolicy(),
                          num_kv_blocks=runner.num_kv_blocks, clock=FakeClock())
    for index, prompt in enumerate(prompts):
        scheduler.add_request(Request(str(index), prompt, SamplingParams(
            temperature=0.0, max_tokens=max_tokens, ignore_eos=True), arrival_time_s=0.0))
    outputs: dict[str, list[int]] = {str(index): [] for index in range(len(prompts))}
    while scheduler.requests:
        scheduler_output = scheduler.schedule()
        for output in scheduler.update_from_output(
            scheduler_output, runner.execute_model(scheduler_output)
        ):
            outputs[output.request_id].extend(output.new_token_ids)
        scheduler.check_invariants()
    runner.execute_model(scheduler.schedule())  # delivers the last finished ids
    assert runner.batch.num_reqs == 0

    def hf_generate(prompt: list[int]) -> list[int]:
        generated = checkpoint.hf_model.generate(
            torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=max_tokens, do_sample=False, pad_token_id=0,
        )
        return generated[0, len(prompt):].tolist()

    expected = [hf_generate(prompt) for prompt in prompts]
    assert [outputs[str(index)] for index in range(len(prompts))] == expected


def mixed_batch_logits(model: LlamaForCausalLM, device: torch.device
                       ) -> tuple[dict[str, torch.Tensor], dict[str, list[int]]]:
    """A step of one decode, one chunk and one prefix-cache hit after a first step of two
    prefills: each sequence's logits (float32, on the CPU) and its tokens so far."""
    paged = PagedSequences(model, device)
    first, second = random_tokens(45, seed=60), random_tokens(30, seed=61)
    paged.add("first", first)
    paged.add("second", second)
    paged.step({"first": 45, "second": 17})
    third = first[:36] + random_tokens(9, seed=62)
    paged.add("third", third, shared_from="first", num_shared_blocks=9)
    first.append(7)
    paged.tokens["first"] = list(first)
    logits = paged.step({"first": 1, "second": 13, "third": 9})
    tokens = {"first": first, "second": second, "third": third}
    return {name: rows.float() for name, rows in logits.items()}, tokens


def last_rows(hf_model: PreTrainedModel, tokens: list[int], count: int) -> torch.Tensor:
    """Transformers' logits of the last `count` positions, float32 on the CPU."""
    device = next(hf_model.parameters()).device
    with torch.no_grad():
        logits = hf_model(torch.tensor([tokens], device=device)).logits[0, -count:]
    return logits.float().cpu()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_float32_mixed_batch_matches_transformers(checkpoint: Checkpoint) -> None:
    device = torch.device("cuda")
    model = load_model(ModelConfig(model=str(checkpoint.path)), device, torch.float32, 512)
    logits, tokens = mixed_batch_logits(model, device)
    for name, rows in logits.items():
        assert_close(rows, last_rows(checkpoint.hf_model, tokens[name], len(rows)))


@pytest.mark.parametrize("device", [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                  reason="needs a CUDA device")),
])
def test_bfloat16_mixed_batch_is_as_close_as_transformers_bfloat16(
    checkpoint: Checkpoint, device: str
) -> None:
    """Two bfloat16 computations of the same logits each round off about as much as
    transformers' bfloat16 run differs from its float32 one (`error`); so ours may differ from
    transformers' bfloat16 by their sum at most (2x `error`: bound 3x) and on average by their
    independent sum (about 1.4x: bound 2x). Measured on CPU: up to 1.7x and 0.8x."""
    model = load_model(ModelConfig(model=str(checkpoint.path)), torch.device(device),
                       torch.bfloat16, 512)
    hf_bfloat16 = copy.deepcopy(checkpoint.hf_model).to(device=device, dtype=torch.bfloat16)
    logits, tokens = mixed_batch_logits(model, torch.device(device))
    ours, theirs, reference = (
        torch.cat(list(logits.values())),
        torch.cat([last_rows(hf_bfloat16, tokens[name], len(rows))
                   for name, rows in logits.items()]),
        torch.cat([last_rows(checkpoint.hf_model, tokens[name], len(rows))
                   for name, rows in logits.items()]),
    )
    error = (theirs - reference).abs()
    difference = (ours - theirs).abs()
    assert difference.max().item() <= 3 * error.max().item()
    assert difference.mean().item() <= 2 * error.mean().item()
