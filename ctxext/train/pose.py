"""PoSE: positional skip-wise training (Zhu et al. 2023, "PoSE: Efficient Context Window Extension of LLMs via
Positional Skip-wise Training").

A training sequence of `window` tokens is split into `num_chunks` contiguous chunks; chunk i keeps its tokens
but its position ids are shifted by a skip u_i, with u_0 = 0 and u_i drawn uniformly from [u_{i-1}, target - window].
Relative distances up to the target length are then seen in training while every forward pass stays `window`
tokens long: the cheap path to a long context on a small GPU. The text inside the window stays contiguous.
"""

from __future__ import annotations

import torch


def pose_position_ids(window: int, target_length: int, num_chunks: int, generator: torch.Generator) -> torch.Tensor:
    """Position ids (1-D, increasing, all < target_length) for one PoSE training sequence of `window` tokens."""
    if not 1 <= num_chunks <= window:
        raise ValueError(f"num_chunks must be between 1 and the window ({window}), got {num_chunks}")
    if window > target_length:
        raise ValueError(f"the window ({window}) must not exceed the target length ({target_length})")
    # Chunk boundaries: num_chunks - 1 distinct cut points inside the window.
    cuts = torch.randperm(window - 1, generator=generator)[: num_chunks - 1] + 1
    bounds = [0, *sorted(cuts.tolist()), window]
    max_skip = target_length - window
    positions, skip = [], 0
    for i in range(num_chunks):
        if i > 0:
            skip = int(torch.randint(skip, max_skip + 1, (1,), generator=generator))
        positions.append(torch.arange(bounds[i], bounds[i + 1]) + skip)
    return torch.cat(positions)


def pose_generator(seed: int, sample_index: int) -> torch.Generator:
    """One generator per training sample: the positions depend on (seed, sample) only, so resume is exact."""
    return torch.Generator().manual_seed(seed * 1_000_003 + sample_index + 7)
