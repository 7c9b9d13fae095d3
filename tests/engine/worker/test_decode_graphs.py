"""Decode steps on static buffers: buckets, padding, and the eager replay used off CUDA."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from engine.model.attention import AttentionLayout, AttentionMetadata, DecodeBuffers
from engine.model.attention.backend import AttentionBackend
from engine.worker.decode_graphs import (
    DecodeGraphs,
    DecodeStep,
    StaticDecodeBuffers,
    bucket_for,
    decode_buckets,
)

CPU = torch.device("cpu")
BLOCK_SIZE = 4
NULL_SLOT = 99 * BLOCK_SIZE


def test_buckets_are_powers_of_two_then_steps_up_to_the_batch_limit() -> None:
    assert decode_buckets(256)[:12] == (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 80)
    assert decode_buckets(256)[-2:] == (240, 256)
    assert decode_buckets(100)[-3:] == (80, 96, 100)
    assert decode_buckets(3) == (1, 2, 3)
    assert all(b - a <= 16 for a, b in itertools.pairwise(decode_buckets(512)))


def test_a_batch_takes_the_smallest_bucket_that_holds_it() -> None:
    buckets = decode_buckets(40)
    assert [bucket_for(n, buckets) for n in (1, 3, 5, 9, 17, 40)] == [1, 4, 8, 16, 24, 40]
    assert bucket_for(41, buckets) is None


def step(lengths: list[int]) -> DecodeStep:
    """Rows whose new token sits at `length - 1`, each in its own run of blocks."""
    positions = np.array(lengths, dtype=np.int64) - 1
    num_blocks = -(-max(lengths) // BLOCK_SIZE)
    table = np.arange(len(lengths) * num_blocks).reshape(len(lengths), num_blocks)
    slots = table[np.arange(len(lengths)), positions // BLOCK_SIZE] * BLOCK_SIZE \
        + positions % BLOCK_SIZE
    return DecodeStep(input_ids=np.arange(len(lengths)) + 10, positions=positions,
                      slot_mapping=slots, block_table=table)


def test_fill_copies_the_rows_and_pads_the_bucket_to_the_null_block() -> None:
    buffers = StaticDecodeBuffers(max_batch=8, max_blocks_per_seq=6, null_slot=NULL_SLOT,
                                  device=CPU)
    buffers.fill(step([9, 3, 17, 5, 2, 2, 2, 2]), bucket=8)  # leaves stale rows behind
    small = step([6, 1, 12])
    buffers.fill(small, bucket=4)
    view = buffers.view(4)
    assert view.seq_lens.tolist() == [6, 1, 12, 0]
    assert view.slot_mapping.tolist() == [*small.slot_mapping.tolist(), NULL_SLOT]
    assert buffers.device["input_ids"][:4].tolist() == [10, 11, 12, 0]
    assert buffers.device["positions"][:4].tolist() == [5, 0, 11, 0]
    assert view.block_table[:3, :3].tolist() == small.block_table.tolist()


class RecordingBackend(AttentionBackend):
    """Records what a static decode plan is built over; its plan only reports the buffers."""

    name = "recording"
    supports_static_decode = True

    def build_metadata(self, query_lens, context_lens, block_table) -> AttentionMetadata:
        raise AssertionError("a static decode never builds per-step metadata")

    def build_decode_metadata(self, buffers: DecodeBuffers) -> AttentionMetadata:
        return buffers  # type: ignore[return-value]


def test_eager_replay_runs_the_bucket_and_returns_the_real_rows() -> None:
    seen: list[tuple[int, list[int]]] = []

    def forward(input_ids: torch.Tensor, positions: torch.Tensor,
                buffers: DecodeBuffers) -> torch.Tensor:
        seen.append((input_ids.shape[0], buffers.seq_lens.tolist()))
        return (input_ids * 2).float()[:, None]

    buffers = StaticDecodeBuffers(max_batch=8, max_blocks_per_seq=6, null_slot=NULL_SLOT,
                                  device=CPU)
    layout = AttentionLayout(num_heads=2, num_kv_heads=1, head_dim=32, block_size=BLOCK_SIZE,
                             sliding_window=None, device=CPU, dtype=torch.float32,
                             max_model_len=24)
    graphs = DecodeGraphs(RecordingBackend(layout), forward, (1, 2, 4, 8), buffers,
                          use_graphs=False)
    graphs.capture()  # a no-op without graphs
    hidden = graphs.run(step([3, 7, 2]))
    assert hidden[:, 0].tolist() == [20.0, 22.0, 24.0]
    assert seen == [(4, [3, 7, 2, 0])]
    with pytest.raises(ValueError, match="exceeds the largest bucket"):
        graphs.run(step([2] * 9))
