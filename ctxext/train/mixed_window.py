"""Mixed-window fine-tuning (LongRoPE2, Shang et al. 2025, arXiv 2502.20082): short sequences train with the
model's original rotary, long ones with the patched (rescaled) rotary, so that the short context keeps its quality.

The data schedule, which depends on the micro-batch's index alone (so a resumed run, or a run over several
processes, has the same short micro-batches as an uninterrupted single-process one):
- the global micro-batch i (the samples i*m .. i*m+m-1, m = train.micro_batch_size) is short when
  floor((i + 1) F) > floor(i F), F = mixed_window.short_fraction: of the first n micro-batches, floor(n F) are
  short, spread evenly (F = 0.5: every second one);
- a short micro-batch holds the same packed samples as a long one would, each cut into seq_len // S sequences of
  S = mixed_window.short_length tokens (default L): the same tokens, in the same order, as in plain fine-tuning.

The rotary switch: while a step runs, the patched rotary answers every forward whose positions all lie below L
with the model's own module (`ctxext.patching.rotary.original_rotary_within`), so a short micro-batch
(S <= L tokens) runs the unpatched model bit for bit, and a long one the patched model. At inference the same
setting gives the LongRoPE-style model: the original rotary within L, the patched one past it.
"""

from __future__ import annotations

import contextlib
import math

import torch

from ..errors import CtxextError
from ..patching import applied_method
from ..patching.rotary import original_rotary_within


def is_short_micro_batch(index: int, short_fraction: float) -> bool:
    """Whether global micro-batch `index` (0-based) is short: floor((index+1) F) > floor(index F)."""
    return math.floor((index + 1) * short_fraction) > math.floor(index * short_fraction)


def micro_batch_index(first_sample: int, micro_batch_size: int) -> int:
    """The global index of the micro-batch that starts at sample `first_sample` (the same on any process count)."""
    return first_sample // micro_batch_size


def cut_into_short_sequences(batch: torch.Tensor, short_length: int) -> torch.Tensor:
    """[b, T] -> [b * (T // S), S]: every sequence cut into consecutive pieces of S tokens (a tail < S dropped)."""
    pieces = batch.shape[1] // short_length
    return batch[:, : pieces * short_length].reshape(-1, short_length)


def short_length_for(mixed, method_length: int) -> int:
    """The short sequences' length: mixed_window.short_length, or the original length L; never past L."""
    length = mixed.short_length or method_length
    if length > method_length:
        raise CtxextError(
            f"mixed_window.short_length ({length}) must not exceed the model's original length ({method_length}): "
            "short sequences train with the original rotary, which is only meant for positions below it"
        )
    return length


def check_switchable(model, method_label: str) -> None:
    """Refuse a patch the switch cannot undo: one that changes attention (log-n, ReRoPE, remapping) as well."""
    applied = applied_method(model)
    if applied is None:
        raise CtxextError(f"mixed_window: {method_label} leaves the rotary unpatched; there is nothing to switch")
    if applied.get("attention"):
        raise CtxextError(
            f"mixed_window switches the rotary only, but {method_label} also changes the attention layers; "
            "use a frequency method (linear, ntk, yarn, longrope, ...) without logn or query_temperature"
        )


def rotary_switch(enabled: bool, model, method_length: int):
    """The block a training step or an evaluation runs in: the original rotary below L when mixed-window is on."""
    return original_rotary_within(model, method_length) if enabled else contextlib.nullcontext(model)


def rotary_used(length: int, method_length: int, method_label: str) -> str:
    """Which rotary a mixed-window model uses for a window of `length` tokens (for the metrics record)."""
    return "original" if length <= method_length else method_label
