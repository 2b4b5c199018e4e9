"""Position-remapping methods: each (query i, key j) pair attends at a remapped relative position r'. Pure math.

Every method here has the same shape. The keys a query sees are split into a few *regions*; inside one region
the query is rotated at one position rule q(i) and the key at one rule k(j), so that q(i) - k(j) is the
remapped relative position r'. Region 0 is always the local one, where r' = r = i - j. The attention kernel
(`ctxext.patching.remap_kernel`) attends each region separately and merges them exactly, so no method needs a
T x T matrix. With r = i - j >= 0 and L the original length (docs/METHODS.md has the sources):

- `rerope` (w): r' = r for r < w, else w.                       far region: q = w, k = 0
- `leaky_rerope` (w, k): r' = r for r < w, else w + (r - w)/k.    far region: q = w + (i - w)/k, k = j/k
- `self_extend` (G, w): r' = r for r < w, else
  floor(i/G) - floor(j/G) + w - floor(w/G).                       far region: q = floor(i/G) + w - floor(w/G),
                                                                   k = floor(j/G)
- `dual_chunk` (s, w; c = s - w): keys sit at j mod c. Same chunk: r' = r (q = i mod c); previous chunk:
  q = min(i mod c + c, s); older chunks: q = min(2c - 1, s).
- `string` (S, W): r' = r for r < S, else r - S + W.                far region: q = i - S + W, k = j
- `dpe` (w, G_g per group of rotary pairs): self_extend's rule with G = G_g in pair p of group g; pairs not
  selected keep r' = r (G = 1).                                    far region: q and k per pair, as self_extend
- `gali` (w, R): per query, T = i + 1 tokens are spread over positions 0..R-1: the n(T) nearest keys keep
  integer steps (r' = r), the others sit 1/g(T) apart, and a fractional key position's logit is interpolated
  between its two integer neighbours.                            far region per g: q = R - 1, k = j/g (blended)

Positions are absolute token positions (0-based). A rule of None means "the token's own position", which
lets the kernel use the model's own rotation untouched.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar, Protocol

import torch

from ..errors import CtxextError
from ..validate import number, whole_number
from .frequency import none_inv_freq
from .registry import Method, MethodParams, param, register

# A lower bound for "every earlier key": clamped to the first key by the kernel.
FIRST_KEY = -(1 << 60)

PositionRule = Callable[[torch.Tensor], torch.Tensor]


class RotaryLookup(Protocol):
    """What a region's rotation asks of the model's rotary embedding (ctxext.patching.attention.rotation's
    `PlanRotary`): `x` rotated at positions, kept under `name` for the forward."""

    n_pairs: int  # rotary pairs per head
    layer_index: int

    def rotate(self, x: torch.Tensor, name: tuple, positions: Callable[[], torch.Tensor]) -> torch.Tensor:
        """Every pair at `positions()`."""

    def rotate_blended(self, x: torch.Tensor, name: tuple, positions: Callable[[], torch.Tensor]) -> torch.Tensor:
        """By the blend (1 - f) R(floor p) + f R(floor p + 1) at each position p, f = p - floor p."""

    def rotate_per_pair(
        self, x: torch.Tensor, name: tuple, scales: torch.Tensor, positions_at: Callable[[int], torch.Tensor]
    ) -> torch.Tensor:
        """Pair p at `positions_at(scales[p])`."""


@dataclass(frozen=True)
class PlainRotation:
    """Every rotary pair turns at the rule's position: the query at q(i), the key at k(j)."""

    def rotate_queries(self, rotary: RotaryLookup, x, name: tuple, rule: Callable, at: torch.Tensor) -> torch.Tensor:
        return rotary.rotate(x, name, lambda: rule(at))

    def rotate_keys(self, rotary: RotaryLookup, x, name: tuple, rule: Callable, at: torch.Tensor) -> torch.Tensor:
        return rotary.rotate(x, name, lambda: rule(at))


@dataclass(frozen=True)
class BlendedKeyRotation(PlainRotation):
    """GALI: a key at a fractional position p is not rotated at p; its logit is interpolated between floor(p) and
    floor(p) + 1, i.e. the key is rotated by (1 - f) R(floor p) + f R(floor p + 1), f = p - floor p. The query
    turns at its position as in `PlainRotation`, which must be an integer, so that the blend is exactly the
    interpolated logit."""

    def rotate_keys(self, rotary: RotaryLookup, x, name: tuple, rule: Callable, at: torch.Tensor) -> torch.Tensor:
        return rotary.rotate_blended(x, name, lambda: rule(at))


@dataclass(frozen=True)
class PerPairRotation:
    """DPE: the rules take a second argument, a scale G, and rotary pair p turns at q(i, G_p) and k(j, G_p), where
    pair_scales(n_pairs, layer_index) gives G_p (int64, one per pair)."""

    pair_scales: Callable[[int, int], torch.Tensor]

    def rotate_queries(self, rotary: RotaryLookup, x, name: tuple, rule: Callable, at: torch.Tensor) -> torch.Tensor:
        scales = self.pair_scales(rotary.n_pairs, rotary.layer_index)
        return rotary.rotate_per_pair(x, name, scales, lambda G: rule(at, G))

    def rotate_keys(self, rotary: RotaryLookup, x, name: tuple, rule: Callable, at: torch.Tensor) -> torch.Tensor:
        return self.rotate_queries(rotary, x, name, rule, at)  # the keys turn pair by pair as the queries do


RegionRotation = PlainRotation | BlendedKeyRotation | PerPairRotation


@dataclass(frozen=True)
class Region:
    """Query i sees the keys at positions [lo(i), hi(i)) with the query rotated at q(i), the key at k(j), each as
    `rotation` turns a token at a rule's position (`PlainRotation`; DPE's `PerPairRotation`, GALI's
    `BlendedKeyRotation`)."""

    name: str
    key_range: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
    query_position: PositionRule | None = None  # None: the query's own position
    key_position: PositionRule | None = None  # None: the key's own position
    rotation: RegionRotation = PlainRotation()


def _floor_div(x: torch.Tensor, d: int) -> torch.Tensor:
    return torch.div(x, d, rounding_mode="floor")


def local_band(width: int) -> Region:
    """Region 0 of the band methods: the `width` nearest keys, plain RoPE (r' = r < width)."""
    return Region("band", lambda i: (i - width + 1, i + 1))


def beyond_band(
    width: int,
    query_position: PositionRule | None,
    key_position: PositionRule | None,
    rotation: RegionRotation = PlainRotation(),
) -> Region:
    """Every key at distance >= width."""
    return Region(
        "far", lambda i: (torch.full_like(i, FIRST_KEY), i - width + 1), query_position, key_position, rotation
    )


@dataclass
class RemapParams(MethodParams):
    """Parameters of a position-remapping method (attention-level; plain RoPE frequencies)."""

    # Whether r' depends on i - j alone: then a shift of every position (left padding) changes nothing.
    shift_invariant: ClassVar[bool] = True

    def resolved(self, original_max_position_embeddings: int) -> RemapParams:
        """The parameters with length-dependent defaults filled in (the values a checkpoint records)."""
        return self

    def regions(self) -> list[Region]:
        raise NotImplementedError

    def regions_for(self, query_positions: torch.Tensor) -> list[Region]:
        """The regions queries at these positions use (the same for every length, except for GALI's)."""
        return self.regions()

    def plain_up_to(self) -> int:
        """Sequences of at most this many tokens (from position 0) lie in region 0 only: plain RoPE."""
        raise NotImplementedError

    def describe(self) -> str:
        """The settings in a few characters for tables, e.g. 'w512 k16' (defaults left to be resolved omitted)."""
        raise NotImplementedError

    def largest_relative_position(self, length: int) -> float | None:
        """The largest r' that `length` tokens use (the last query on the first key), for the methods whose point
        is to keep r' below L; None for the others (dual_chunk stays below s by construction; STRING and DPE
        move past L on purpose, on well-trained or selected dimensions)."""
        return None

    def setting_within(self, length: int, method_length: int) -> str:
        """The change of setting that keeps r' below L at `length` tokens, in words ('' when none does)."""
        return ""

    def reach(self, method_length: int) -> int | None:
        """The most tokens this setting (resolved at L) keeps every remapped relative position within the trained
        range 0..L-1: the length its checkpoint declares when no --factor says otherwise. None where every length
        stays within it (the positions are capped by construction)."""
        raise NotImplementedError

    def reach_rule(self) -> str:
        """How `reach` is computed, in a few words for `ctxext patch` and the docs."""
        raise NotImplementedError


# ------------------------------------------------------------------------------------ ReRoPE, Leaky
@dataclass
class ReRopeParams(RemapParams):
    """ReRoPE: relative positions beyond the window are all read as the window."""

    window: int = param(
        512,
        "w: pairs closer than w keep their relative position m-n, farther ones see w "
        "(Su's defaults: 512 for L=4096; his results use 1024)",
        search=(1 / 32, 1.0, "log", "int", "*L"),
    )

    def validate(self):
        super().validate()
        self.window = whole_number("window", self.window, 1)

    @property
    def leak(self) -> float:
        """1/k: how fast the relative position still grows past the window (0 for ReRoPE)."""
        return 0.0

    def regions(self) -> list[Region]:
        w, leak = self.window, self.leak
        return [
            local_band(w),
            beyond_band(w, lambda i: far_query_positions(i, w, leak), lambda j: far_key_positions(j, leak)),
        ]

    def plain_up_to(self) -> int:
        return self.window

    def describe(self) -> str:
        return f"w{self.window}"

    def largest_relative_position(self, length: int) -> float | None:
        return float(rerope_relative_position(torch.tensor(length - 1), self.window, self.leak))

    def setting_within(self, length: int, method_length: int) -> str:
        w, last, L = self.window, length - 1, method_length
        if self.leak == 0:  # r' = min(r, w)
            return f"a window below {L}"
        if w >= L - 1:
            return f"a window below {L - 1}"
        return f"k >= {math.ceil((last - w) / (L - 1 - w))}"

    def reach(self, method_length: int) -> int | None:
        w, L = self.window, method_length
        if w >= L:  # the window itself runs past L
            return L
        if self.leak == 0:  # r' = min(r, w) < L at any length
            return None
        return math.floor(w + (L - 1 - w) / self.leak) + 1  # the last query on key 0: w + (N - 1 - w) / k = L - 1

    def reach_rule(self) -> str:
        return "r' never passes w" if self.leak == 0 else "w + k (L - 1 - w) + 1"


@dataclass
class LeakyReRopeParams(ReRopeParams):
    """Leaky ReRoPE: beyond the window the relative position grows k times more slowly."""

    k: float = param(
        16.0,
        "k > 1: past the window the relative position is w + (m-n-w)/k (Su's default 16)",
        search=(2.0, 64.0, "log"),
    )

    def validate(self):
        super().validate()
        check_leak_factor(self.k)

    @property
    def leak(self) -> float:
        return 1.0 / self.k

    def describe(self) -> str:
        return f"w{self.window} k{self.k:g}"


def check_window(window) -> int:
    return whole_number("window", window, 1)


def check_leak_factor(k) -> float:
    number("k", k)
    if k <= 1:
        raise CtxextError(f"'k' must be > 1 for Leaky ReRoPE (k = 1 is plain RoPE), got {k!r}")
    return float(k)


def rerope_relative_position(distance: torch.Tensor, window: int, leak: float = 0.0) -> torch.Tensor:
    """The relative position ReRoPE uses for a pair at distance m-n >= 0 (docs/METHODS.md).

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


# ------------------------------------------------------------------------------------- SelfExtend
@dataclass
class SelfExtendParams(RemapParams):
    """SelfExtend: neighbours keep their positions; farther keys are grouped G at a time (floor division)."""

    shift_invariant: ClassVar[bool] = False

    group_size: int = param(
        4,
        "G >= 1: keys past the window share one position per G tokens (LongLM's example: "
        "4; their advice: the smallest G with G*(L-w)+w >= the input length, then try larger)",
        search=(2, 64, "log", "int"),
    )
    window: int = param(
        1024,
        "w: the neighbour window, whose pairs keep r' = r (LongLM: 512-1536 for Llama-2)",
        search=(1 / 32, 1 / 2, "log", "int", "*L"),
    )

    def validate(self):
        super().validate()
        self.group_size = whole_number("group_size", self.group_size, 1)
        self.window = whole_number("window", self.window, 1)

    def regions(self) -> list[Region]:
        G, w = self.group_size, self.window

        def query_group(i):
            return grouped_query_position(i, G, w)

        def key_group(j):
            return grouped_key_position(j, G)

        return [local_band(w), beyond_band(w, query_group, key_group)]

    def plain_up_to(self) -> int:
        return self.window

    def describe(self) -> str:
        return f"G{self.group_size} w{self.window}"

    def largest_relative_position(self, length: int) -> float | None:
        last, G, w = torch.tensor(length - 1), self.group_size, self.window
        if last < w:
            return float(last)
        return float(grouped_query_position(last, G, w) - grouped_key_position(torch.tensor(0), G))

    def setting_within(self, length: int, method_length: int) -> str:
        """LongLM's rule: the smallest G whose largest r' is below L (found by trying each G in turn)."""
        last, w, L = length - 1, self.window, method_length
        if w >= L:
            return f"a window below {L}"
        return f"group_size >= {smallest_group_within(last, w, L)}"

    def reach(self, method_length: int) -> int | None:
        return self_extend_reach(self.group_size, self.window, method_length)

    def reach_rule(self) -> str:
        return "G (L - w + floor(w / G))"


def self_extend_reach(G: int, window: int, method_length: int) -> int:
    """The most tokens whose largest SelfExtend r' (the last query on key 0: floor((N-1)/G) + w - floor(w/G)) stays
    below L: N = G (L - w + floor(w/G)); L itself where the window reaches L."""
    if window >= method_length:
        return method_length
    return G * (method_length - window + window // G)


def smallest_group_within(last: int, window: int, method_length: int) -> int:
    """LongLM's rule: the smallest G whose largest r' (query `last` on key 0) is below L (window < L), found by
    trying each G in turn through the closed form of r', for speed."""
    return next(G for G in range(1, last + 2) if last // G + window - window // G < method_length)


def grouped_query_position(i: torch.Tensor, G: int, window: int) -> torch.Tensor:
    """SelfExtend's far-region query position floor(i/G) + w - floor(w/G): r' continues from w at the edge."""
    return (_floor_div(i, G) + window - window // G).to(torch.float64)


def grouped_key_position(j: torch.Tensor, G: int) -> torch.Tensor:
    return _floor_div(j, G).to(torch.float64)


# -------------------------------------------------------------------------------------------------- DPE
DPE_GROUPS, DPE_SCALE = 8, 4  # the default: 8 groups, each at self_extend's default G


@dataclass
class DpeParams(RemapParams):
    """DPE: SelfExtend per group of rotary pairs, each group with its own scale; unselected pairs keep r' = r."""

    shift_invariant: ClassVar[bool] = False

    window: int | None = param(
        None,
        "w: pairs closer than w keep r' = r in every dimension (default L/8, DPE's 1024 at 8k)",
        search=(1 / 32, 1 / 2, "log", "int", "*L"),
    )
    group_scales: list | None = param(
        None,
        "one SelfExtend scale G per group of rotary pairs, pair 0 (highest "
        "frequency) first; the list's length is the number of groups and must "
        "divide the pair count (default: 8 groups at G = 4, self_extend's)",
        search=(1, 64, "pow2", "each"),
        elements=DPE_GROUPS,
        element_default=DPE_SCALE,
    )
    selected_pairs: list | None = param(
        None,
        "the pairs that are grouped (the rest keep r' = r): one list for every "
        "layer, or one list per layer (DPE keeps the top pairs by |q||k|)",
    )

    def validate(self):
        super().validate()
        if self.window is not None:
            self.window = whole_number("window", self.window, 1)
        if self.group_scales is not None:
            if not isinstance(self.group_scales, (list, tuple)) or not self.group_scales:
                raise CtxextError("'group_scales' must be a non-empty list of positive integers, e.g. [2, 8, 32]")
            self.group_scales = [whole_number("group_scales", G, 1) for G in self.group_scales]
        if self.selected_pairs is not None:
            layers = self.selected_pairs
            if not isinstance(layers, (list, tuple)) or not layers:
                raise CtxextError("'selected_pairs' must be a list of pair indices, or one such list per layer")
            per_layer = isinstance(layers[0], (list, tuple))
            for pairs in layers if per_layer else [layers]:
                if not isinstance(pairs, (list, tuple)) or isinstance(pairs, str):
                    raise CtxextError("'selected_pairs' mixes pair indices and lists; give one or the other")
                for p in pairs:
                    whole_number("selected_pairs", p, 0)

    @property
    def scales(self) -> list[int]:
        return list(self.group_scales) if self.group_scales is not None else [DPE_SCALE] * DPE_GROUPS

    def resolved(self, original_max_position_embeddings: int) -> DpeParams:
        if self.window is not None and self.group_scales is not None:
            return self
        params = DpeParams(
            **{
                **self.to_dict(),
                "window": self.window or original_max_position_embeddings // 8,
                "group_scales": self.scales,
            }
        )
        params.validate()
        return params

    def check_model(self, rotary_dim: int, num_layers: int) -> None:
        """A one-line CtxextError unless the groups divide this model's pairs and the selected pairs exist."""
        pairs = rotary_dim // 2
        if pairs % len(self.scales):
            raise CtxextError(
                f"dpe: {len(self.scales)} groups (group_scales) do not divide this model's {pairs} "
                f"rotary pairs; use a divisor of {pairs}, e.g. {_divisors(pairs)}"
            )
        layers = self.selected_pairs
        if layers is None:
            return
        per_layer = isinstance(layers[0], (list, tuple))
        if per_layer and len(layers) != num_layers:
            raise CtxextError(f"dpe: 'selected_pairs' has {len(layers)} lists; this model has {num_layers} layers")
        wrong = sorted({p for chosen in (layers if per_layer else [layers]) for p in chosen if p >= pairs})
        if wrong:
            raise CtxextError(f"dpe: selected pairs {wrong} are out of range; this model has pairs 0-{pairs - 1}")

    def pair_scales(self, n_pairs: int, layer_index: int) -> torch.Tensor:
        """G_p for every rotary pair in layer `layer_index` (1, i.e. r' = r, for pairs not selected)."""
        scales = torch.tensor(self.scales, dtype=torch.int64).repeat_interleave(n_pairs // len(self.scales))
        if self.selected_pairs is not None:
            layers = self.selected_pairs
            chosen = layers[layer_index] if isinstance(layers[0], (list, tuple)) else layers
            keep = torch.zeros(n_pairs, dtype=torch.bool)
            keep[torch.as_tensor(list(chosen), dtype=torch.int64)] = True
            scales = torch.where(keep, scales, torch.ones_like(scales))
        return scales

    def _layer_count(self) -> int:
        layers = self.selected_pairs
        return len(layers) if layers and isinstance(layers[0], (list, tuple)) else 1

    def largest_relative_position_on(self, length: int, pairs: list[int], n_pairs: int) -> float:
        """The largest r' that `length` tokens use on `pairs` (of the model's n_pairs), in any layer: the last
        query on the first key at the smallest scale those pairs have (G 1, r' = r, for pairs not selected)."""
        last, w = length - 1, self.window
        if last < w:
            return float(last)
        G = min(int(self.pair_scales(n_pairs, layer)[pairs].min()) for layer in range(self._layer_count()))
        return float(grouped_query_position(torch.tensor(last), G, w) - grouped_key_position(torch.tensor(0), G))

    def setting_within_on(self, length: int, pairs: list[int], n_pairs: int, method_length: int) -> str:
        """The group scales that keep `pairs`' r' below L at `length` tokens: each group holding one of them
        raised to LongLM's smallest G, in words ('' when no scale does, e.g. for pairs left out of selected_pairs)."""
        last, w, L = length - 1, self.window, method_length
        if w >= L:
            return f"a window below {L}"
        G = smallest_group_within(last, w, L)
        per_group = n_pairs // len(self.scales)
        groups = {p // per_group for p in pairs}
        scales = [max(scale, G) if group in groups else scale for group, scale in enumerate(self.scales)]
        raised = DpeParams(**{**self.to_dict(), "group_scales": scales})
        if raised.largest_relative_position_on(length, pairs, n_pairs) > L - 1:
            return ""
        return f"group_scales {scales}"

    def reach(self, method_length: int) -> int | None:
        """SelfExtend's reach at the smallest scale the grouped pairs have (pairs left out of `selected_pairs` keep
        r' = r and run past L by design, as DPE means them to)."""
        resolved = self.resolved(method_length)
        return self_extend_reach(min(resolved.scales), resolved.window, method_length)

    def reach_rule(self) -> str:
        return "G (L - w + floor(w / G)) at the smallest group scale G"

    def regions(self) -> list[Region]:
        w = self.window
        if w is None:
            raise CtxextError("dpe's 'window' is not resolved yet (it defaults from the original length L)")
        return [
            local_band(w),
            beyond_band(
                w,
                lambda i, G: grouped_query_position(i, G, w),
                grouped_key_position,
                PerPairRotation(self.pair_scales),
            ),
        ]

    def plain_up_to(self) -> int:
        return self.window

    def describe(self) -> str:
        parts = [
            f"w{self.window}" if self.window else "",
            "G" + "/".join(str(G) for G in self.group_scales) if self.group_scales is not None else "",
            "selected pairs" if self.selected_pairs is not None else "",
        ]
        return " ".join(part for part in parts if part)


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0 and d <= 16)


# -------------------------------------------------------------------------------------------------- GALI
@dataclass
class GaliParams(RemapParams):
    """GALI: for each query, the keys are spread greedily over the relative positions 0..R-1. The nearest keep
    integer steps; the others share the rest of the range, 1/g apart, and a fractional position's attention
    logit is interpolated between its two integer neighbours."""

    shift_invariant: ClassVar[bool] = False

    local_window: int = param(
        1,
        "w >= 1: at least the w nearest keys keep r' = r (GALI's setting: 1; the greedy rule keeps more "
        "whenever the range allows)",
        search=(1 / 4096, 1 / 8, "log", "int", "*L"),
    )
    position_range: int | None = param(
        None,
        "R <= L: the relative positions used are 0..R-1 (default L; GALI finds that a range below the "
        "training length can do better)",
        search=(1 / 4, 1.0, "int", "*L"),
    )

    def validate(self):
        super().validate()
        self.local_window = whole_number("local_window", self.local_window, 1)
        if self.position_range is not None:
            self.position_range = whole_number("position_range", self.position_range, 2)
            if self.position_range <= self.local_window:
                raise CtxextError(
                    f"gali: 'local_window' ({self.local_window}) must be below 'position_range' "
                    f"({self.position_range}): the window is part of the range"
                )

    def resolved(self, original_max_position_embeddings: int) -> GaliParams:
        L = original_max_position_embeddings
        if self.position_range is not None and self.position_range > L:
            raise CtxextError(
                f"gali: 'position_range' {self.position_range} reaches past the model's original length L = {L}; "
                f"use at most {L} (GALI maps every relative position into the trained range)"
            )
        if self.position_range is not None:
            return self
        params = GaliParams(**{**self.to_dict(), "position_range": L})
        params.validate()
        return params

    @property
    def range(self) -> int:
        if self.position_range is None:
            raise CtxextError("gali's 'position_range' is not resolved yet (it defaults to the original length L)")
        return self.position_range

    def regions(self) -> list[Region]:
        raise CtxextError("gali's regions follow the number of tokens; ask regions_for(query positions)")

    def regions_for(self, query_positions: torch.Tensor) -> list[Region]:
        R, w = self.range, self.local_window
        groups = sorted(set(gali_group(query_positions.flatten() + 1, R, w).tolist()) - {1})
        near = Region("near", lambda i: (i + 1 - gali_exact_keys(i + 1, R, w), i + 1))
        return [near, *(gali_far_region(g, R, w) for g in groups)]

    def plain_up_to(self) -> int:
        return self.range

    def largest_relative_position(self, length: int) -> float | None:
        """min(length, R) - 1, below L by construction; None before R is resolved (it is L then)."""
        return None if self.position_range is None else float(min(length, self.position_range) - 1)

    def reach(self, method_length: int) -> int | None:
        return None

    def reach_rule(self) -> str:
        return "r' stays below R <= L"

    def describe(self) -> str:
        return f"w{self.local_window}" + ("" if self.position_range is None else f" R{self.position_range}")


def _ceil_div(x: torch.Tensor, d) -> torch.Tensor:
    return -torch.div(-x, d, rounding_mode="floor")


def gali_group(lengths: torch.Tensor, position_range: int, window: int) -> torch.Tensor:
    """g(T) = ceil((T - w) / (R - w)) for T > R tokens: the far keys of the query that makes T tokens sit 1/g
    apart. 1 for T <= R (nothing is moved)."""
    g = _ceil_div(lengths - window, position_range - window)
    return torch.where(lengths > position_range, g, torch.ones_like(g))


def gali_exact_keys(lengths: torch.Tensor, position_range: int, window: int) -> torch.Tensor:
    """n(T): how many of the T tokens keep integer steps (the nearest ones, the query included).

    GALI gives the first k integer positions g tokens each until the range holds T tokens: R + (g - 1) k >= T,
    so k = ceil((T - R) / (g - 1)), and the last R - k tokens keep the positions k..R-1. n(T) >= w follows
    from g >= (T - w) / (R - w). All T tokens for T <= R."""
    g = gali_group(lengths, position_range, window)
    compressed = _ceil_div(lengths - position_range, (g - 1).clamp(min=1))
    return torch.where(lengths > position_range, position_range - compressed, lengths)


def gali_far_region(g: int, position_range: int, window: int) -> Region:
    """The keys past n(T) of the queries whose g(T) is g: the query at R - 1, key j at j/g, logits interpolated."""

    def key_range(i):
        T = i + 1
        mine = gali_group(T, position_range, window) == g
        edge = T - gali_exact_keys(T, position_range, window)
        return torch.where(mine, torch.full_like(i, FIRST_KEY), T), torch.where(mine, edge, T)

    return Region(
        f"far g{g}",
        key_range,
        lambda i: torch.full(i.shape, float(position_range - 1), dtype=torch.float64),
        lambda j: j.to(torch.float64) / g,
        BlendedKeyRotation(),
    )


# ---------------------------------------------------------------------------- Dual Chunk Attention
@dataclass
class DualChunkParams(RemapParams):
    """Dual Chunk Attention (ChunkLlama): positions restart every c = s - w tokens; three chunk regions."""

    shift_invariant: ClassVar[bool] = False

    chunk_size: int | None = param(
        None, "s: the largest relative position used (default 3L/4, as ChunkLlama)", search=(1 / 4, 1.0, "int", "*L")
    )
    local_window: int | None = param(
        None,
        "w: the local window; chunks are c = s - w tokens long (default L/16, as ChunkLlama's flash decoding)",
        search=(1 / 64, 1 / 4, "log", "int", "*L"),
    )

    def validate(self):
        super().validate()
        if self.chunk_size is not None:
            self.chunk_size = whole_number("chunk_size", self.chunk_size, 2)
        if self.local_window is not None:
            self.local_window = whole_number("local_window", self.local_window, 0)
        if self.chunk_size is not None and self.local_window is not None and self.chunk_size <= self.local_window:
            raise CtxextError(
                f"'chunk_size' ({self.chunk_size}) must be larger than 'local_window' "
                f"({self.local_window}): chunks are chunk_size - local_window tokens long"
            )

    def resolved(self, original_max_position_embeddings: int) -> DualChunkParams:
        L = original_max_position_embeddings
        values = self.to_dict()
        if values["chunk_size"] is None:
            values["chunk_size"] = 3 * L // 4
        if values["local_window"] is None:
            values["local_window"] = L // 16
        params = DualChunkParams(**values)
        params.validate()
        return params

    @property
    def chunk(self) -> int:
        return self._concrete("chunk_size") - self._concrete("local_window")

    def _concrete(self, name):
        value = getattr(self, name)
        if value is None:
            raise CtxextError(f"dual_chunk's '{name}' is not resolved yet (it defaults from the original length L)")
        return value

    def regions(self) -> list[Region]:
        s, c = self._concrete("chunk_size"), self.chunk

        def chunk_start(i):
            return _floor_div(i, c) * c

        def in_chunk(x):
            return torch.remainder(x, c).to(torch.float64)

        return [
            Region("same chunk", lambda i: (chunk_start(i), i + 1), in_chunk, in_chunk),
            Region(
                "previous chunk",
                lambda i: (chunk_start(i) - c, chunk_start(i)),
                lambda i: (in_chunk(i) + c).clamp(max=s),
                in_chunk,
            ),
            Region(
                "older chunks",
                lambda i: (torch.full_like(i, FIRST_KEY), chunk_start(i) - c),
                lambda i: torch.full_like(i, min(2 * c - 1, s), dtype=torch.float64),
                in_chunk,
            ),
        ]

    def plain_up_to(self) -> int:
        return self.chunk

    def reach(self, method_length: int) -> int | None:
        return None

    def reach_rule(self) -> str:
        return "r' never passes chunk_size"

    def describe(self) -> str:
        return " ".join(
            f"{tag}{value}" for tag, value in (("s", self.chunk_size), ("w", self.local_window)) if value is not None
        )


# ------------------------------------------------------------------------------------------- STRING
@dataclass
class StringParams(RemapParams):
    """STRING: relative positions from S on are shifted back by S - W, onto well-trained ones."""

    # searched as a share of the target length N = s L: the largest shifted distance, N - S + W, stays below L only
    # for S >= N + W - L, so from 2x on no S up to L keeps every distance trained; the best cap is S = (N + W) / 2
    shifted_offset: int | None = param(
        None,
        "S: pairs at r >= S use r - S + W (default floor(0.33 L), as STRING)",
        search=(1 / 16, 3 / 4, "int", "*L", "*factor"),
    )
    local_value: int = param(
        128, "W < S: the relative position the shifted pairs start from (STRING: 128)", search=(16, 512, "log", "int")
    )
    attention_factor: float = param(
        0.1 * math.log(2) + 1,
        "multiplies cos and sin everywhere, as the reference code does (0.1 ln 2 + 1); 1 turns it off",
        search=(1.0, 1.3),
    )

    def validate(self):
        super().validate()
        self.local_value = whole_number("local_value", self.local_value, 0)
        number("attention_factor", self.attention_factor, minimum=0.0, strict=True)
        if self.shifted_offset is not None:
            self.shifted_offset = whole_number("shifted_offset", self.shifted_offset, 1)
            if self.shifted_offset <= self.local_value:
                raise CtxextError(
                    f"'shifted_offset' ({self.shifted_offset}) must be larger than 'local_value' "
                    f"({self.local_value}): STRING moves far pairs to smaller positions"
                )

    def resolved(self, original_max_position_embeddings: int) -> StringParams:
        if self.shifted_offset is not None:
            return self
        params = StringParams(**{**self.to_dict(), "shifted_offset": int(0.33 * original_max_position_embeddings)})
        params.validate()
        return params

    def regions(self) -> list[Region]:
        S, W = self.shifted_offset, self.local_value
        return [local_band(S), beyond_band(S, lambda i: (i - S + W).to(torch.float64), None)]

    def plain_up_to(self) -> int:
        return self.shifted_offset

    def reach(self, method_length: int) -> int | None:
        resolved = self.resolved(method_length)
        return method_length + resolved.shifted_offset - resolved.local_value

    def reach_rule(self) -> str:
        return "L + S - W"

    def describe(self) -> str:
        shifted = "" if self.shifted_offset is None else f"S{self.shifted_offset} "
        factor = "" if self.attention_factor == StringParams.attention_factor else f" a{self.attention_factor:g}"
        return f"{shifted}W{self.local_value}{factor}"


def string_inv_freq(rotary_dim, base, original_max_position_embeddings, params, seq_len=None):
    inv_freq, _ = none_inv_freq(rotary_dim, base, original_max_position_embeddings, params, seq_len)
    return inv_freq, float(params.attention_factor)


# ------------------------------------------------------------------------------------------ registry
register(
    Method(
        name="rerope",
        summary="ReRoPE: relative positions past a window w are read as w (attention-level; plain RoPE frequencies)",
        source="Su 2023, kexue.fm/archives/9708",
        params_cls=ReRopeParams,
        inv_freq_fn=none_inv_freq,
    )
)
register(
    Method(
        name="leaky_rerope",
        summary="Leaky ReRoPE: past the window w the relative position grows k times more slowly (attention-level)",
        source="Su 2023, kexue.fm/archives/9728",
        params_cls=LeakyReRopeParams,
        inv_freq_fn=none_inv_freq,
    )
)
register(
    Method(
        name="self_extend",
        summary="SelfExtend: neighbours keep positions, farther keys are grouped by floor(j/G) (attention-level)",
        source="Jin et al. 2024, 'LLM Maybe LongLM' (arXiv 2401.01325)",
        params_cls=SelfExtendParams,
        inv_freq_fn=none_inv_freq,
    )
)
register(
    Method(
        name="dpe",
        summary="DPE: SelfExtend per group of rotary pairs, each with its own scale; unselected pairs plain (attention-level)",
        source="Lu et al. 2025, 'Effective Length Extrapolation via Dimension-Wise Positional Embeddings Manipulation' "
        "(arXiv 2504.18857)",
        params_cls=DpeParams,
        inv_freq_fn=none_inv_freq,
    )
)
register(
    Method(
        name="gali",
        summary="GALI: keys spread greedily over the trained positions, fractional ones by logit interpolation "
        "(attention-level)",
        source="Li et al. 2025, 'A Training-Free Length Extrapolation Approach for LLMs: Greedy Attention Logit "
        "Interpolation' (arXiv 2502.02659, EMNLP 2025)",
        params_cls=GaliParams,
        inv_freq_fn=none_inv_freq,
    )
)
register(
    Method(
        name="dual_chunk",
        summary="Dual Chunk Attention: positions restart every chunk; same/previous/older chunk rules (attention-level)",
        source="An et al. 2024, 'Training-Free Long-Context Scaling of LLMs' (ChunkLlama, arXiv 2402.17463)",
        params_cls=DualChunkParams,
        inv_freq_fn=none_inv_freq,
    )
)
register(
    Method(
        name="string",
        summary="STRING: relative positions r >= S shifted to r - S + W (attention-level)",
        source="An et al. 2024, 'Why Does the Effective Context Length of LLMs Fall Short?' (arXiv 2410.18745)",
        params_cls=StringParams,
        inv_freq_fn=string_inv_freq,
    )
)
