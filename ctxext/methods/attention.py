"""Attention-level methods (Su 2023): ReRoPE, Leaky ReRoPE and log-n query scaling. Pure math, no model code.

These change how attention scores are formed, so they cannot be written as new frequencies:

- **log-n** multiplies the query at 1-based position n by max(1, ln n / ln L). Nothing changes inside L.
  It is a flag (`logn`) that combines with every method.
- **ReRoPE** (window w) uses the relative position m-n inside the band m-n < w and w outside it.
- **Leaky ReRoPE** (window w, factor k > 1) uses w + (m-n-w)/k outside the band.

`rerope` and `leaky_rerope` are registered as methods whose frequencies are plain RoPE (as in Su's
experiments); they are not combined with another frequency method. The model side (blocked attention,
KV cache) lives in `ctxext.patching.attention`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import CtxextError
from .frequency import none_inv_freq
from .registry import Method, MethodParams, _check_number, param, register

# --------------------------------------------------------------------------------------------- log-n
def check_original_length_for_logn(original_max_position_embeddings) -> int:
    """L for log-n scaling, or a CtxextError saying how to give it."""
    value = original_max_position_embeddings
    if value is None:
        raise CtxextError(
            "log-n scaling needs the original context length L (original_max_position_embeddings) and none is "
            "known; give it with --original-max-position-embeddings (API: original_max_position_embeddings=...)"
        )
    if isinstance(value, bool) or not isinstance(value, (int, float)) or int(value) != value or value < 2:
        # ln L must be positive: L = 1 would divide by zero.
        raise CtxextError(f"log-n scaling needs an original length L >= 2, got {value!r}")
    return int(value)


def logn_scale(positions: torch.Tensor, original_max_position_embeddings: int) -> torch.Tensor:
    """Per-query factor max(1, ln n / ln L) for 0-based `positions` (n = position + 1), float32.

    Positions inside L give exactly 1.0, so multiplying by it leaves the query bit-identical.
    """
    L = check_original_length_for_logn(original_max_position_embeddings)
    n = positions.to(torch.float64) + 1
    # max(n, 1): padded tokens of a left-padded batch can carry positions below 0.
    return (torch.log(n.clamp(min=1.0)) / math.log(L)).clamp(min=1.0).to(torch.float32)


# ------------------------------------------------------------------------------------ ReRoPE, Leaky
@dataclass
class ReRopeParams(MethodParams):
    """ReRoPE: relative positions beyond the window are all read as the window."""

    window: int = param(512, "w: pairs closer than w keep their relative position m-n, farther ones see w "
                             "(Su's defaults: 512 for L=4096; his results use 1024)")

    def validate(self):
        super().validate()
        check_window(self.window)

    @property
    def leak(self) -> float:
        """1/k: how fast the relative position still grows past the window (0 for ReRoPE)."""
        return 0.0


@dataclass
class LeakyReRopeParams(ReRopeParams):
    """Leaky ReRoPE: beyond the window the relative position grows k times more slowly."""

    k: float = param(16.0, "k > 1: past the window the relative position is w + (m-n-w)/k (Su's default 16)")

    def validate(self):
        super().validate()
        check_leak_factor(self.k)

    @property
    def leak(self) -> float:
        return 1.0 / self.k


def check_window(window) -> int:
    if isinstance(window, bool) or not isinstance(window, (int, float)) or not math.isfinite(window):
        raise CtxextError(f"'window' must be a whole number of tokens, got {window!r}")
    if window <= 0:
        raise CtxextError(f"'window' must be > 0, got {window!r}")
    if int(window) != window:
        raise CtxextError(f"'window' must be a whole number of tokens, got {window!r}")
    return int(window)


def check_leak_factor(k) -> float:
    _check_number("k", k)
    if k <= 1:
        raise CtxextError(f"'k' must be > 1 for Leaky ReRoPE (k = 1 is plain RoPE), got {k!r}")
    return float(k)


def rerope_relative_position(distance: torch.Tensor, window: int, leak: float = 0.0) -> torch.Tensor:
    """The relative position ReRoPE uses for a pair at distance m-n >= 0 (METHODS.md).

    m-n below the window; w + (m-n-w)*leak from the window on (leak = 1/k; 0 for ReRoPE, which caps at w).
    """
    distance = distance.to(torch.float64)
    return torch.where(distance < window, distance, window + (distance - window) * leak)


def far_query_positions(positions: torch.Tensor, window: int, leak: float = 0.0) -> torch.Tensor:
    """Where queries are rotated for the far region: w + (m-w)/k, i.e. w for ReRoPE."""
    positions = positions.to(torch.float64)
    return window + (positions - window) * leak


def far_key_positions(positions: torch.Tensor, leak: float = 0.0) -> torch.Tensor:
    """Where keys are rotated for the far region: n/k, i.e. unrotated (0) for ReRoPE.

    With the query at w + (m-w)/k this gives the relative position w + (m-n-w)/k.
    """
    return positions.to(torch.float64) * leak


# ------------------------------------------------------------------------------------ settings
@dataclass(frozen=True)
class AttentionSettings:
    """What a patched attention does beyond plain RoPE; saved as `ctxext_attention` in config.json."""

    logn: bool = False
    window: int | None = None  # ReRoPE window; None = no ReRoPE
    k: float | None = None  # Leaky ReRoPE factor; None = ReRoPE (no leak)
    original_max_position_embeddings: int | None = None  # L for log-n

    def __post_init__(self):
        if not isinstance(self.logn, bool):
            raise CtxextError(f"'logn' must be true or false, got {self.logn!r}")
        if self.window is not None:
            object.__setattr__(self, "window", check_window(self.window))
        if self.k is not None:
            if self.window is None:
                raise CtxextError("Leaky ReRoPE's 'k' needs a 'window'")
            object.__setattr__(self, "k", check_leak_factor(self.k))
        if self.logn:
            object.__setattr__(
                self, "original_max_position_embeddings",
                check_original_length_for_logn(self.original_max_position_embeddings),
            )

    @property
    def rerope(self) -> bool:
        return self.window is not None

    @property
    def leak(self) -> float:
        return 0.0 if self.k is None else 1.0 / self.k

    @property
    def active(self) -> bool:
        return self.logn or self.rerope

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"logn": self.logn}
        if self.rerope:
            out["method"] = "rerope" if self.k is None else "leaky_rerope"
            out["window"] = self.window
            if self.k is not None:
                out["k"] = self.k
        if self.logn:
            out["original_max_position_embeddings"] = self.original_max_position_embeddings
        return out

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "AttentionSettings":
        if not isinstance(values, dict):
            raise CtxextError(f"'ctxext_attention' must be a mapping, got {values!r}")
        known = {"logn", "method", "window", "k", "original_max_position_embeddings"}
        unknown = set(values) - known
        if unknown:
            raise CtxextError(f"'ctxext_attention' has unknown keys: {', '.join(sorted(unknown))}")
        return cls(
            logn=values.get("logn", False),
            window=values.get("window"),
            k=values.get("k"),
            original_max_position_embeddings=values.get("original_max_position_embeddings"),
        )

    @classmethod
    def for_method(cls, params: MethodParams, logn: bool, original_max_position_embeddings) -> "AttentionSettings":
        """The settings a method (with its parameters) plus the `logn` flag call for."""
        window = getattr(params, "window", None) if isinstance(params, ReRopeParams) else None
        k = params.k if isinstance(params, LeakyReRopeParams) else None
        return cls(logn=logn, window=window, k=k,
                   original_max_position_embeddings=original_max_position_embeddings if logn else None)


# ------------------------------------------------------------------------------------ registry
register(Method(
    name="rerope",
    summary="ReRoPE: relative positions past a window w are read as w (attention-level; plain RoPE frequencies)",
    source="Su 2023, kexue.fm/archives/9708",
    params_cls=ReRopeParams,
    inv_freq_fn=none_inv_freq,
))
register(Method(
    name="leaky_rerope",
    summary="Leaky ReRoPE: past the window w the relative position grows k times more slowly (attention-level)",
    source="Su 2023, kexue.fm/archives/9728",
    params_cls=LeakyReRopeParams,
    inv_freq_fn=none_inv_freq,
))
