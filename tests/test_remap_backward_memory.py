"""The remapping kernel's memory-lean pieces stay exact: query blocks that restart where a region's key bounds
jump (chunk boundaries), and the blockwise backward that recomputes probabilities and score gradients in one
buffer. Gradients are compared with autograd through the "naive" backend (full score matrices, one softmax).
Memory itself is measured by benchmarks/remap_train_memory.py, not here."""

from __future__ import annotations

import pytest
import torch

from ctxext.methods.remapping import DualChunkParams, GaliParams, StringParams
from ctxext.patching.remap_kernel import (
    RegionPlan,
    band_and_far_ranges,
    block_rows,
    bound_jumps,
    remapped_attention,
)
from tests.helpers import assert_same_gradients, kernel_gradients


def region_bounds(regions, q_len: int, k_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """key_lo/key_hi of a method's regions for the last q_len of k_len tokens, from its own Region rules."""
    positions = torch.arange(k_len - q_len, k_len)
    lo, hi = zip(*(region.key_range(positions) for region in regions))
    return torch.stack(lo), torch.stack(hi)


def dual_chunk_bounds(q_len: int, k_len: int):
    return region_bounds(DualChunkParams(chunk_size=13, local_window=2).regions(), q_len, k_len)  # chunks of 11


def string_bounds(q_len: int, k_len: int):
    return region_bounds(StringParams(shifted_offset=9, local_value=3).regions(), q_len, k_len)


def rerope_bounds(q_len: int, k_len: int):
    return band_and_far_ranges(q_len, k_len, window=6)


# ----------------------------------------------------------------------------------------- block rows
def test_block_rows_cover_every_row_once_and_restart_at_each_jump():
    bounds = block_rows(50, 8, [11, 22, 33, 44])
    rows = [row for b0, b1 in bounds for row in range(b0, b1)]
    assert rows == list(range(50))
    assert all(0 < b1 - b0 <= 8 for b0, b1 in bounds)
    assert {11, 22, 33, 44} <= {b0 for b0, _ in bounds}


def test_block_rows_ignore_a_jump_that_would_leave_a_sliver():
    assert block_rows(40, 16, [1, 17]) == [(0, 16), (16, 17), (17, 33), (33, 40)]  # 1 - 0 <= 16 // 8: ignored


def test_bound_jumps_find_chunk_boundaries_and_nothing_in_a_sliding_band():
    assert bound_jumps(*dual_chunk_bounds(40, 40)) == [11, 22, 33]
    assert bound_jumps(*rerope_bounds(30, 40)) == []
    assert bound_jumps(*string_bounds(40, 40)) == []
    # GALI's far edge advances by one or two keys a row: a jump only where the group size g changes (R 16, w 2:
    # g 2 from 17 tokens, 3 from 31, 4 from 45, 5 from 59), where one far region's rows end and the next one's begin
    gali = GaliParams(local_window=2, position_range=16)
    assert bound_jumps(*region_bounds(gali.regions_for(torch.arange(60)), 60, 60)) == [16, 30, 44, 58]


def test_no_ragged_key_span_is_wider_than_its_block_once_blocks_restart_at_jumps():
    lo, hi = dual_chunk_bounds(64, 64)
    plan = RegionPlan(lo, hi, 64, query_block=8)
    for b0, b1, parts in plan.blocks(torch.device("cpu")):
        for _, c0, c1, mask in parts:
            assert mask is None or c1 - c0 <= b1 - b0, (b0, b1, c0, c1)


# ------------------------------------------------------------------------------------------ gradients
@pytest.mark.parametrize(
    "bounds,q_len,k_len,query_block",
    [
        (dual_chunk_bounds, 40, 40, 16),  # blocks cut at the chunk boundaries 11, 22, 33
        (dual_chunk_bounds, 29, 40, 64),  # one block per chunk
        (string_bounds, 40, 40, 16),
        (rerope_bounds, 25, 40, 8),
    ],
)
@pytest.mark.parametrize("padded", [False, True])
def test_blockwise_gradients_match_autograd_through_naive(bounds, q_len, k_len, query_block, padded):
    lo, hi = bounds(q_len, k_len)
    padding = 5 if padded else 0
    got = kernel_gradients("blockwise", lo, hi, query_block, padding, heads=6, seed=11, scale=0.35)
    want = kernel_gradients("naive", lo, hi, query_block, padding, heads=6, seed=11, scale=0.35)
    assert_same_gradients(got, want, atol=1e-5)


def test_blockwise_forward_is_the_same_whatever_the_block_size():
    lo, hi = dual_chunk_bounds(40, 40)
    generator = torch.Generator().manual_seed(3)
    queries = [torch.randn(1, 4, 40, 8, generator=generator) for _ in range(3)]
    keys = [torch.randn(1, 2, 40, 8, generator=generator) for _ in range(3)]
    value = torch.randn(1, 2, 40, 8, generator=generator)
    outs = [
        remapped_attention(queries, keys, value, lo, hi, 0.3, query_block=b, kernel="blockwise") for b in (3, 16, 64)
    ]
    for out in outs[1:]:
        torch.testing.assert_close(out, outs[0], atol=1e-6, rtol=1e-5)
