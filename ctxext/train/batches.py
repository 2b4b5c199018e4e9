"""The samples each process trains on, and the model inputs built from them. Every optimizer step's global batch
is split by index over micro-steps and processes, so 1 process and N processes see the same data.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .mixed_window import cut_into_short_sequences, is_short_micro_batch, micro_batch_index
from .pose import pose_generator, pose_position_ids
from .recipe import Recipe

if TYPE_CHECKING:
    from .state import Setup


def sample_indices(
    step: int, micro_step: int, rank: int, world_size: int, micro_batch: int, global_batch: int
) -> list[int]:
    """The samples one process uses in one micro-step: the step's global batch is split across processes."""
    first = step * global_batch + (micro_step * world_size + rank) * micro_batch
    return list(range(first, first + micro_batch))


def micro_batch(setup: Setup, step: int, micro: int) -> dict[str, torch.Tensor]:
    """The model inputs of this process in one micro-step: its share of the step's samples, by index (under
    mixed_window, a short micro-batch has them cut into short sequences; ctxext.train.mixed_window), whole: under
    sequence parallelism each process then keeps its slice (`sequence_parallel.slice_of_sequence`)."""
    recipe, accelerator = setup.recipe, setup.runtime.accelerator
    sp = setup.runtime.sp_size  # the processes of one SP group take the same samples (sequence_parallel.py)
    indices = sample_indices(
        step,
        micro,
        accelerator.process_index // sp,
        accelerator.num_processes // sp,
        recipe.train.micro_batch_size,
        recipe.train.global_batch_size,
    )
    batch = setup.train_data.batch(indices)
    if setup.mixed_window and is_short_micro_batch(
        micro_batch_index(indices[0], recipe.train.micro_batch_size), recipe.mixed_window.short_fraction
    ):
        batch = cut_into_short_sequences(batch, setup.short_length)
    batch = batch.to(accelerator.device)
    inputs = {"input_ids": batch, "labels": batch}
    if recipe.pose.enabled:
        inputs["position_ids"] = pose_positions(recipe, indices).to(accelerator.device)
        # Without a mask, transformers reads a jump in position_ids as the start of another packed
        # sequence and blocks attention across it; PoSE chunks are one text and must see each other.
        inputs["attention_mask"] = torch.ones_like(batch)
    return inputs


def pose_positions(recipe: Recipe, indices: list[int]) -> torch.Tensor:
    """The PoSE position ids of these samples, one row each (ctxext.train.pose)."""
    return torch.stack(
        [
            pose_position_ids(
                recipe.pose.train_window, recipe.seq_len, recipe.pose.num_chunks, pose_generator(recipe.seed, i)
            )
            for i in indices
        ]
    )
