"""Attention-level settings: log-n query scaling, the query temperature, and which position-remapping method runs.
Pure math.

- **log-n** multiplies the query at 1-based position n by max(1, ln n / ln L). Nothing changes inside L.
  It is a flag (`logn`) that combines with every method.
- **Query temperature** (Llama 4, Ministral 3) multiplies the query at 0-based position p by
  1 + beta ln(1 + floor(p / L)). Nothing changes inside L. A setting (`query_temperature: beta`) for every method.
- **Position remapping** (ReRoPE, Leaky ReRoPE, SelfExtend, Dual Chunk Attention, STRING) gives each
  (query, key) pair a remapped relative position; the methods live in `ctxext.methods.remapping`.

`AttentionSettings` is what a patched model's attention does beyond plain RoPE, and what a checkpoint records
as `ctxext_attention` in config.json. The model side lives in `ctxext.patching.attention` (hooks) and
`ctxext.patching.remap_kernel` (the blockwise kernel).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import torch

from ..errors import CtxextError
from ..validate import boolean, whole_number
from .registry import MethodParams, get_method
from .remapping import (  # noqa: F401  (re-exported: the ReRoPE names have always lived here)
    LeakyReRopeParams,
    RemapParams,
    ReRopeParams,
    check_leak_factor,
    check_window,
    far_key_positions,
    far_query_positions,
    rerope_relative_position,
)


# --------------------------------------------------------------------------------------------- log-n
def check_original_length_for_logn(original_max_position_embeddings) -> int:
    """L for log-n scaling, or a CtxextError saying how to give it."""
    value = original_max_position_embeddings
    if value is None:
        raise CtxextError(
            "log-n scaling needs the original context length L (original_max_position_embeddings) and none is "
            "known; give it with --original-max-position-embeddings (API: original_max_position_embeddings=...)"
        )
    value = whole_number("original_max_position_embeddings", value, minimum=None)
    if value < 2:  # ln L must be positive: L = 1 would divide by zero
        raise CtxextError(f"log-n scaling needs an original length L >= 2, got {value!r}")
    return value


def logn_scale(positions: torch.Tensor, original_max_position_embeddings: int) -> torch.Tensor:
    """Per-query factor max(1, ln n / ln L) for 0-based `positions` (n = position + 1), float32.

    Positions inside L give exactly 1.0, so multiplying by it leaves the query bit-identical.
    """
    L = check_original_length_for_logn(original_max_position_embeddings)
    n = positions.to(torch.float64) + 1
    # max(n, 1): padded tokens of a left-padded batch can carry positions below 0.
    return (torch.log(n.clamp(min=1.0)) / math.log(L)).clamp(min=1.0).to(torch.float32)


# ------------------------------------------------------------------------------- query temperature
def check_query_temperature(beta) -> float:
    """beta of the query temperature, a finite number >= 0, or a CtxextError."""
    if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not math.isfinite(beta) or beta < 0:
        raise CtxextError(f"query_temperature (beta) must be a finite number >= 0, got {beta!r}")
    return float(beta)


def query_temperature_scale(
    positions: torch.Tensor, beta: float, original_max_position_embeddings: int
) -> torch.Tensor:
    """Per-query factor 1 + beta * ln(1 + floor(p / L)) for 0-based positions p (Llama 4, Ministral 3), float32.

    Positions inside L give exactly 1.0; each further multiple of L raises it (1 + beta ln 2 from L to 2L - 1)."""
    L = check_original_length_for_logn(original_max_position_embeddings)
    p = positions.to(torch.float64).clamp(min=0.0)  # padded tokens of a left-padded batch: factor 1
    return (1 + check_query_temperature(beta) * torch.log1p(torch.floor(p / L))).to(torch.float32)


# ------------------------------------------------------------------------------------ settings
@dataclass(frozen=True)
class AttentionSettings:
    """What a patched attention does beyond plain RoPE; saved as `ctxext_attention` in config.json."""

    logn: bool = False
    method: str | None = None  # a position-remapping method; None = plain RoPE positions
    params: dict[str, Any] = field(default_factory=dict)  # its parameters, length-dependent defaults resolved
    original_max_position_embeddings: int | None = None  # L for log-n and the query temperature
    query_temperature: float | None = None  # beta of q *= 1 + beta ln(1 + floor(p / L)); None = off

    def __post_init__(self):
        boolean("logn", self.logn)
        if self.query_temperature is not None:
            object.__setattr__(self, "query_temperature", check_query_temperature(self.query_temperature))
        if self.method is not None:
            if not issubclass(get_method(self.method).params_cls, RemapParams):
                raise CtxextError(f"'{self.method}' is not a position-remapping method")
            _ = self.remap  # building it validates the parameters
        elif self.params:
            raise CtxextError(f"'ctxext_attention' has parameters {sorted(self.params)} but no 'method'")
        if self.scales_queries:
            object.__setattr__(
                self,
                "original_max_position_embeddings",
                check_original_length_for_logn(self.original_max_position_embeddings),
            )

    @cached_property
    def remap(self) -> RemapParams | None:
        """The remapping method's parameters (None without one)."""
        if self.method is None:
            return None
        return get_method(self.method).make_params(**self.params)

    @property
    def scales_queries(self) -> bool:
        """Whether queries are scaled by their position (log-n, the query temperature): both need L."""
        return self.logn or self.query_temperature is not None

    @property
    def active(self) -> bool:
        return self.scales_queries or self.method is not None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"logn": self.logn}
        if self.method is not None:
            out["method"] = self.method
            out.update(self.params)
        if self.query_temperature is not None:
            out["query_temperature"] = self.query_temperature
        if self.scales_queries:
            out["original_max_position_embeddings"] = self.original_max_position_embeddings
        return out

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> AttentionSettings:
        if not isinstance(values, dict):
            raise CtxextError(f"'ctxext_attention' must be a mapping, got {values!r}")
        values = dict(values)
        logn = values.pop("logn", False)
        method = values.pop("method", None)
        L = values.pop("original_max_position_embeddings", None)
        beta = values.pop("query_temperature", None)
        return cls(logn, method, values, L, beta)

    @classmethod
    def for_method(
        cls,
        method: str,
        params: MethodParams,
        logn: bool,
        original_max_position_embeddings,
        query_temperature: float | None = None,
    ) -> AttentionSettings:
        """The settings a method (with its parameters), the `logn` flag and the query temperature call for."""
        remap_values = {}
        if isinstance(params, RemapParams):
            resolved = params.resolved(original_max_position_embeddings)
            remap_values = {k: v for k, v in resolved.to_dict().items() if k != "factor"}
        return cls(
            logn=logn,
            method=method if isinstance(params, RemapParams) else None,
            params=remap_values,
            original_max_position_embeddings=(
                original_max_position_embeddings if logn or query_temperature is not None else None
            ),
            query_temperature=query_temperature,
        )
