import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from engine.model.attention.sdpa import (
    _DECODE_GROUP_LENGTH_RATIO,
    _MIN_DECODE_GROUP,
    GatherWorkspace,
    group_decodes,
)


@given(st.lists(st.integers(1, 4096), max_size=300))
def test_decode_groups_cover_the_batch_in_order_with_bounded_padding(lengths) -> None:
    seq_lens = np.array(sorted(lengths, reverse=True), dtype=np.int64)
    groups = group_decodes(seq_lens)
    starts = [start for start, _ in groups]
    assert starts == ([0] if groups else []) + [end for _, end in groups[:-1]]
    assert (groups[-1][1] if groups else 0) == len(seq_lens)
    for start, end in groups[:-1]:
        assert end - start >= _MIN_DECODE_GROUP
    for start, end in groups:
        members = seq_lens[start:end]
        if end - start > _MIN_DECODE_GROUP:  # grown past the minimum only while lengths agree
            assert members.min() >= _DECODE_GROUP_LENGTH_RATIO * members.max()


def test_gather_workspace_reuses_its_buffer() -> None:
    import torch

    workspace = GatherWorkspace()
    source = torch.arange(40.0).view(10, 4)
    first = workspace.gather(0, source, torch.tensor([3, 1]))
    assert first.tolist() == [source[3].tolist(), source[1].tolist()]
    second = workspace.gather(0, source, torch.tensor([0]))
    assert second.data_ptr() == first.data_ptr()
    assert workspace.gather(0, source, torch.arange(10)).equal(source)


def test_masked_prefill_in_row_slices_equals_one_call() -> None:
    import torch

    from engine.model.attention.sdpa import sdpa_in_row_slices

    generator = torch.Generator().manual_seed(0)
    query = torch.randn(37, 4, 32, generator=generator)
    key, value = (torch.randn(90, 2, 32, generator=generator) for _ in range(2))
    query_positions = torch.arange(53, 90)[:, None]
    mask = (torch.arange(90)[None, :] <= query_positions)[None, None]
    whole = sdpa_in_row_slices(query, key, value, mask, 0.2, None)
    row_bytes = 2 * 4 * 4 * 90
    sliced = sdpa_in_row_slices(query, key, value, mask, 0.2, 5 * row_bytes)  # 8 slices
    torch.testing.assert_close(sliced, whole)
    assert sdpa_in_row_slices(query, key, value, mask, 0.2, 1).shape == whole.shape
