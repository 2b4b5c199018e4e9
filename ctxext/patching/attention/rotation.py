"""RoPE rotation as transformers applies it and its inverse, and (cos, sin) from the model's own rotary embedding
at any positions, made once per forward (`PlanRotary`, what a region's rotation asks for its queries and keys)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from .memo import ForwardPlan


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotation(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x (batch, heads, seq, head_dim) by cos/sin (batch, seq, rotary_dim), as transformers does."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    rotary = cos.shape[-1]
    if rotary == x.shape[-1]:
        return (x * cos) + (_rotate_half(x) * sin)
    # Partial rotary: only the first rotary_dim channels turn.
    turned, kept = x[..., :rotary], x[..., rotary:]
    return torch.cat(((turned * cos) + (_rotate_half(turned) * sin), kept), dim=-1)


def undo_rotation(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The inverse of `apply_rotation` with the same cos/sin (which may carry an attention factor), in float32."""
    cos, sin = cos.unsqueeze(1).float(), sin.unsqueeze(1).float()
    rotary = cos.shape[-1]
    turned = x[..., :rotary].float()
    norm = cos * cos + sin * sin  # a^2 per channel: 1 unless the method scales cos and sin
    back = (turned * cos - _rotate_half(turned) * sin) / norm
    return back if rotary == x.shape[-1] else torch.cat((back, x[..., rotary:].float()), dim=-1)


def is_dynamic_rotary(rotary: nn.Module) -> bool:
    """ctxext's dynamic methods and transformers' dynamic rope types: frequencies that follow the length."""
    return bool(getattr(rotary, "dynamic", False)) or "dynamic" in str(getattr(rotary, "rope_type", ""))


@dataclass(frozen=True)
class RotaryIdentity:
    """Which rotary module, with which frequencies: (cos, sin) and keys rotated under another differ."""

    module_id: int  # id() of the rotary module
    frequencies_address: int | None  # data_ptr() of its inv_freq (None where it keeps none)

    @classmethod
    def of(cls, rotary: nn.Module) -> RotaryIdentity:
        frequencies = getattr(rotary, "inv_freq", None)
        return cls(id(rotary), frequencies.data_ptr() if isinstance(frequencies, torch.Tensor) else None)


@dataclass(frozen=True)
class RotaryTableKey:
    """What a (cos, sin) kept in a `ForwardPlan` is: a named set of positions (("query", region index),
    ("key", region index, first new key), ...) under one rotary's frequencies, for one dtype and device."""

    positions: tuple
    layer_type: str | None
    rotary: RotaryIdentity
    dtype: torch.dtype
    device: torch.device
    blended: bool  # GALI's blend of the two integer neighbours of each fractional position


@dataclass(frozen=True)
class PerPairTableKey:
    """What a (cos, sin) assembled pair by pair (DPE) is: named positions, each rotary pair at its own scale."""

    positions: tuple
    layer_type: str | None
    scales: tuple[int, ...]  # G_p, one per rotary pair
    dtype: torch.dtype
    device: torch.device


def _rotary_at(
    host: nn.Module, like: torch.Tensor, positions: torch.Tensor, layer_type: str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) of the model's own rotary embedding at arbitrary (possibly fractional) positions.

    Positions are computed on the CPU (in float64 where a rule needs it) and reach the device as float32, so
    devices without float64 (MPS) never see it.
    """
    positions = positions.to(device=like.device, dtype=torch.float32)
    if layer_type is None:  # one set of frequencies for every layer
        return host.rotary_emb(like, positions)
    return host.rotary_emb(like, positions, layer_type)


def _blended_rotary_at(
    host: nn.Module, like: torch.Tensor, positions: torch.Tensor, layer_type: str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) that rotate a key at a fractional position p as GALI reads it: the blend (1 - f) R(floor p) +
    f R(floor p + 1), f = p - floor p. Dotted with a query rotated at an integer position, this is the logit
    interpolated linearly between the key's two integer neighbours (the dot product is linear in the key)."""
    low = positions.floor()
    weight = (positions - low).to(device=like.device, dtype=torch.float32)[..., None]
    cos_low, sin_low = _rotary_at(host, like, low, layer_type)
    cos_high, sin_high = _rotary_at(host, like, low + 1, layer_type)
    cos = torch.lerp(cos_low.float(), cos_high.float(), weight).to(cos_low.dtype)
    sin = torch.lerp(sin_low.float(), sin_high.float(), weight).to(sin_low.dtype)
    return cos, sin


def rotary_tables(
    plan: ForwardPlan,
    host: nn.Module,
    like: torch.Tensor,
    name: tuple,
    positions: Callable[[], torch.Tensor],
    layer_type: str | None = None,
    blended: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) at `positions()`, once per forward; dynamic rotary types, whose frequencies follow each call's
    positions, are asked every time. `blended`: GALI's blend at fractional positions."""
    rotary = host.rotary_emb
    rotary_at = _blended_rotary_at if blended else _rotary_at
    if is_dynamic_rotary(rotary):
        return rotary_at(host, like, positions(), layer_type)
    key = RotaryTableKey(name, layer_type, RotaryIdentity.of(rotary), like.dtype, like.device, blended)
    return plan.remember(key, lambda: rotary_at(host, like, positions(), layer_type))


def rotated_per_pair(
    plan: ForwardPlan,
    host: nn.Module,
    x: torch.Tensor,
    name: tuple,
    scales: torch.Tensor,
    positions_at: Callable[[int], torch.Tensor],
    layer_type: str | None = None,
) -> torch.Tensor:
    """x rotated pair by pair, pair p at `positions_at(scales[p])`: one (cos, sin) per distinct scale (once per
    forward), then each channel takes its pair's (channels c and c + d/2 are pair c, as in rotate_half)."""
    distinct = sorted(set(scales.tolist()))
    tables = [rotary_tables(plan, host, x, (*name, G), lambda G=G: positions_at(G), layer_type) for G in distinct]

    def assembled() -> tuple[torch.Tensor, torch.Tensor]:
        # Made once per forward, not per layer: on a GPU the index is a host-to-device copy, which waits for
        # the device to finish what was queued (two waits in every layer of every decode step, otherwise).
        rotary = tables[0][0].shape[-1]
        pick = torch.tensor([distinct.index(G) for G in scales.tolist()], dtype=torch.int64).repeat(2)
        pick, channels = pick.to(x.device), torch.arange(rotary, device=x.device)
        cos, sin = (torch.stack([table[which] for table in tables], dim=-1)[..., channels, pick] for which in (0, 1))
        return cos, sin

    cos, sin = plan.remember(PerPairTableKey(name, layer_type, tuple(scales.tolist()), x.dtype, x.device), assembled)
    return apply_rotation(x, cos, sin)


class PlanRotary:
    """The model's rotary embedding as one patched layer of one forward reads it: what a region's rotation
    (ctxext.methods.remapping, `RotaryLookup`) asks for to rotate its queries and keys, made once per forward."""

    def __init__(self, plan: ForwardPlan, host: nn.Module, layer_type: str | None, layer_index: int, n_pairs: int):
        self.plan, self.host, self.layer_type = plan, host, layer_type
        self.layer_index = layer_index
        self.n_pairs = n_pairs  # rotary pairs per head

    def rotate(self, x: torch.Tensor, name: tuple, positions: Callable[[], torch.Tensor]) -> torch.Tensor:
        """x rotated at `positions()`, every pair alike."""
        return apply_rotation(x, *rotary_tables(self.plan, self.host, x, name, positions, self.layer_type))

    def rotate_blended(self, x: torch.Tensor, name: tuple, positions: Callable[[], torch.Tensor]) -> torch.Tensor:
        """x rotated by the blend of the rotations at each fractional position's two integer neighbours (GALI)."""
        cos, sin = rotary_tables(self.plan, self.host, x, name, positions, self.layer_type, blended=True)
        return apply_rotation(x, cos, sin)

    def rotate_per_pair(
        self, x: torch.Tensor, name: tuple, scales: torch.Tensor, positions_at: Callable[[int], torch.Tensor]
    ) -> torch.Tensor:
        """x rotated pair by pair, pair p at `positions_at(scales[p])` (DPE)."""
        return rotated_per_pair(self.plan, self.host, x, name, scales, positions_at, self.layer_type)
