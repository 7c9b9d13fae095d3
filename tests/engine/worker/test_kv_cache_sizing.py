"""KV pool sizing against a fake device budget: the pool plus whatever attention gathers over
it fit what the device has."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from engine.config import CacheConfig
from engine.model.attention import AttentionLayout
from engine.model.attention.sdpa import SdpaBackend
from engine.model.directory import load_arch
from engine.worker.kv_cache_sizing import determine_num_kv_blocks, kv_block_bytes

GIB = 2**30
BLOCK_SIZE = 16
MAX_MODEL_LEN = 1024


def sdpa(dtype: torch.dtype = torch.bfloat16) -> SdpaBackend:
    arch = load_arch("tiny")
    return SdpaBackend(AttentionLayout.of_model(arch, BLOCK_SIZE, torch.device("cpu"), dtype,
                                                MAX_MODEL_LEN))


def gathered_bytes(backend: SdpaBackend, seq_lens: list[int], context_len: int) -> int:
    """The largest K+V gather of one layer in a step: every decode group's padded rows and
    one prefill of 8 tokens over `context_len` cached tokens."""
    lens = np.array(sorted(seq_lens, reverse=True), dtype=np.int64)
    table = np.zeros((len(lens) + 1, MAX_MODEL_LEN // BLOCK_SIZE), dtype=np.int64)
    metadata = backend.build_metadata(np.array([*[1] * len(lens), 8]),
                                      np.array([*(lens - 1), context_len]), table)
    layout = backend.layout
    row_bytes = 2 * layout.num_kv_heads * layout.head_dim * layout.dtype.itemsize
    largest = max((group.block_table.numel() * BLOCK_SIZE for group in metadata.decode_groups),
                  default=0)
    largest = max(largest, metadata.prefills[0].kv_slots.numel())
    return largest * row_bytes


@given(st.lists(st.integers(1, MAX_MODEL_LEN), min_size=1, max_size=200),
       st.integers(1, MAX_MODEL_LEN - 8))
def test_sdpa_scratch_bound_covers_every_batch_the_pool_holds(seq_lens, context_len) -> None:
    backend = sdpa()
    pool_tokens = sum(-(-n // BLOCK_SIZE) * BLOCK_SIZE for n in seq_lens) \
        + -(-(context_len + 8) // BLOCK_SIZE) * BLOCK_SIZE
    assert gathered_bytes(backend, seq_lens, context_len) <= backend.scratch_bytes(pool_tokens)


def test_cuda_pool_leaves_room_for_the_reserve_and_attention_scratch(monkeypatch) -> None:
    free_bytes, total_bytes = 20 * GIB, 24 * GIB
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free_bytes, total_bytes))
    arch = load_arch("tiny")
    backend = sdpa()
    config = CacheConfig(block_size=BLOCK_SIZE, gpu_memory_utilization=0.9)
    reserved = 3 * GIB
    num_blocks = determine_num_kv_blocks(config, arch, torch.bfloat16, torch.device("cuda"),
                                         MAX_MODEL_LEN, reserved, backend.scratch_bytes)
    budget = int(0.9 * total_bytes) - (total_bytes - free_bytes) - reserved
    pool_bytes = num_blocks * kv_block_bytes(arch, BLOCK_SIZE, torch.bfloat16)
    assert pool_bytes + backend.scratch_bytes(num_blocks * BLOCK_SIZE) <= budget
    assert pool_bytes + backend.scratch_bytes(num_blocks * BLOCK_SIZE) > 0.99 * budget
    in_place = determine_num_kv_blocks(config, arch, torch.bfloat16, torch.device("cuda"),
                                       MAX_MODEL_LEN, reserved)
    assert in_place > num_blocks  # a backend reading in place leaves the pool all the room


def test_a_device_too_full_for_one_sequence_is_refused(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (GIB, 24 * GIB))
    with pytest.raises(ValueError, match="cannot hold one sequence"):
        determine_num_kv_blocks(CacheConfig(block_size=BLOCK_SIZE), load_arch("tiny"),
                                torch.bfloat16, torch.device("cuda"), MAX_MODEL_LEN, 0,
                                sdpa().scratch_bytes)
