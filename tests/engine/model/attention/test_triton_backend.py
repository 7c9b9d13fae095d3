"""The `triton` backend's plan of a step and its attention against the `sdpa` backend's, on
random paged steps (under Triton's interpreter without a GPU, so the shapes are small)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("triton")  # run under the interpreter without a GPU (tests/conftest.py)

from engine.model.attention.backend import AttentionLayout, ProfiledStep
from engine.model.attention.sdpa import SdpaBackend
from engine.model.attention.triton_backend import TritonBackend

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
BLOCK_SIZE = 16
NUM_KV_HEADS, GROUP, HEAD_DIM = 2, 2, 32
MAX_MODEL_LEN = 2048


def make_layout() -> AttentionLayout:
    return AttentionLayout(num_heads=NUM_KV_HEADS * GROUP, num_kv_heads=NUM_KV_HEADS,
                           head_dim=HEAD_DIM, block_size=BLOCK_SIZE, sliding_window=None,
                           device=DEVICE, dtype=torch.float32, max_model_len=MAX_MODEL_LEN)


def test_chunks_over_long_cached_contexts_split_their_keys_and_attend_as_sdpa_does() -> None:
    # An agent's next turns: a decode and a chunk of 9 tokens over 1,100 cached tokens each
    # (sharing their first 40 blocks), beside a short prompt. Few programs, long key ranges:
    # the plan splits each program's keys, and the step matches SDPA over gathered K/V.
    context_lens, query_lens = np.array([1100, 1100, 0]), np.array([1, 9, 20])
    generator = torch.Generator().manual_seed(0)
    blocks_per_seq = MAX_MODEL_LEN // BLOCK_SIZE
    block_table = (np.arange(3)[:, None] * blocks_per_seq + np.arange(blocks_per_seq)[None])
    block_table[1, :40] = block_table[0, :40]
    num_tokens = int(query_lens.sum())

    def draw(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator).to(DEVICE)

    query = draw(num_tokens, NUM_KV_HEADS * GROUP, HEAD_DIM)
    key, value = draw(num_tokens, NUM_KV_HEADS, HEAD_DIM), draw(num_tokens, NUM_KV_HEADS,
                                                                 HEAD_DIM)
    kv_cache = draw(2, (3 * blocks_per_seq + 1) * BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    outputs, caches = [], []
    for backend in (TritonBackend(make_layout()), SdpaBackend(make_layout())):
        metadata = backend.build_metadata(query_lens, context_lens, block_table)
        cache = kv_cache.clone()
        outputs.append(metadata.attend(query, key, value, cache, HEAD_DIM ** -0.5).cpu())
        caches.append(cache.cpu())
        if backend.name == "triton":
            assert metadata.prefill is not None and metadata.prefill.num_splits == 2
    torch.testing.assert_close(outputs[0], outputs[1], atol=1e-4, rtol=1e-4)
    assert torch.equal(caches[0], caches[1])


def test_start_up_profiles_the_kernel_with_and_without_splits() -> None:
    # With two KV heads a full-budget prompt launches under 132 programs, so its keys split:
    # a chunk too short to split is profiled too, so that both variants compile.
    backend = TritonBackend(make_layout())
    assert backend.attention_of(ProfiledStep(2048, 0)) == "split kernel"
    assert backend.profiled_steps(2048) == ((2048, 0), (1022, 1))
    metadata = backend.build_metadata(np.array([2048]), np.array([0]), np.arange(128)[None])
    assert metadata.prefill is not None and metadata.prefill.num_splits > 1
    metadata = backend.build_metadata(np.array([1022]), np.array([1]), np.arange(64)[None])
    assert metadata.prefill is not None and metadata.prefill.num_splits == 1
