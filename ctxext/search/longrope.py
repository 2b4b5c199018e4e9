"""LongRoPE's per-pair factors, searched with CMA-ES over a low-dimensional monotone parametrisation.

LongRoPE (Ding et al. 2024) rescales pair i by its own divisor f_i (`long_factor`, used past L): θ'_i = θ_i / f_i.
Its search (microsoft/LongRoPE `evolution/`) is an evolutionary one over all d/2 factors on a grid of step 0.01:
a population of 64, 40 iterations of 16 mutations and 16 crossovers each, about 1,300 perplexity evaluations,
each a forward pass at the target length, with mutations retried until the factors are non-decreasing.

ctxext uses CMA-ES (pycma) over K knots instead (default 8), because each evaluation is a forward pass at the
target length: a budget of tens of evaluations is what a CPU, or a GPU hour at 128k, affords, and CMA-ES adapts
its step size and the correlations between knots from a handful of generations, where a genetic search over
d/2 grid values needs hundreds. The factors are kept monotone by construction, not by rejection:

    log f = clip(cummax(log f_start + interp(z)), 0, log upper)

- `f_start` is the starting curve: by default YaRN's (= NTK-by-parts') per-pair divisors θ_i/θ'_i at the same s
  and L, which already rise from 1 (fast pairs kept) to s (slow pairs interpolated).
- `z` (K numbers, CMA-ES's search variables) is a log-scale correction at K knots spread evenly over the pairs,
  linearly interpolated in between: z = 0 is the starting curve exactly.
- the running maximum makes the curve non-decreasing across pairs; the clip keeps every factor between 1 (never
  extrapolate faster than the original) and `upper` (default 2s). Both are monotone maps, so the result stays
  monotone.

The result is saved with transformers' own rope_type `longrope` (`long_factor`, `short_factor` all 1), which
plain transformers and vLLM load.

`--space critical` searches LongRoPE2's smaller space instead (below: `CriticalSpace`): a critical dimension d
from the theoretical one down, factors from d on at least s and non-decreasing, NTK below d with the base
re-derived from d (docs/METHODS.md, "LongRoPE2's search space").

This module holds the spaces and their maps to factors; the CMA-ES loops over them are `ctxext.search.loop`'s.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..errors import CtxextError
from ..methods import compute_inv_freq, get_method, rope_inv_freq

DEFAULT_KNOTS = 8
DEFAULT_SIGMA = 0.5  # CMA-ES's initial step, in log-factor units (about x1.65)


def start_factors(method_name: str, factor: float, rotary_dim: int, base: float, L: int) -> np.ndarray:
    """θ_i/θ'_i of a frequency method with its default parameters at scale `factor`: LongRoPE's starting curve."""
    spec = get_method(method_name)
    params = spec.make_params(factor=factor)
    if spec.is_dynamic(params):
        raise CtxextError(f"the LongRoPE search cannot start from '{method_name}': its factors depend on the length")
    scaled, _ = compute_inv_freq(spec, params, rotary_dim, base, L)
    plain = rope_inv_freq(rotary_dim, base)
    return (plain.double() / scaled.double()).numpy()


def knot_positions(pairs: int, knots: int) -> np.ndarray:
    if not 1 <= knots <= pairs:
        raise CtxextError(f"--longrope-knots must be between 1 and the number of pairs ({pairs}), got {knots}")
    return np.linspace(0.0, pairs - 1, knots)


def factors_from(z, start: np.ndarray, knots: np.ndarray, upper: float) -> np.ndarray:
    """The per-pair factors for knot corrections `z` (see the module docstring): non-decreasing, in [1, upper]."""
    correction = (
        np.interp(np.arange(len(start)), knots, np.asarray(z, dtype=np.float64))
        if len(knots) > 1
        else np.full(len(start), float(np.asarray(z)[0]))
    )
    log_factors = np.maximum.accumulate(np.log(start) + correction)
    return np.exp(np.clip(log_factors, 0.0, math.log(upper)))


def is_monotone(factors) -> bool:
    values = np.asarray(factors, dtype=np.float64)
    return bool(np.all(np.diff(values) >= 0))


class CmaProposer:
    """CMA-ES's ask/tell over the knot corrections, reproducible from (seed, history).

    pycma draws from NumPy's global generator; its state is kept here and swapped in around every call, so that
    a resumed search replays the logged generations exactly and nothing else disturbs them.
    """

    def __init__(self, dimension: int, sigma: float, seed: int, popsize: int | None = None):
        import cma  # noqa: PLC0415 -- optional: search

        saved = np.random.get_state()
        options = {
            "seed": seed + 1,
            "verbose": -9,
            "verb_log": 0,
            "verb_disp": 0,
            "verb_filenameprefix": "",
            "CMA_diagonal": False,
        }
        if popsize:
            options["popsize"] = popsize
        self.strategy = cma.CMAEvolutionStrategy(np.zeros(dimension), sigma, options)
        self._state = np.random.get_state()
        np.random.set_state(saved)

    @property
    def popsize(self) -> int:
        return int(self.strategy.popsize)

    def ask(self) -> list[np.ndarray]:
        saved = np.random.get_state()
        np.random.set_state(self._state)
        try:
            return [np.asarray(x, dtype=np.float64) for x in self.strategy.ask()]
        finally:
            self._state = np.random.get_state()
            np.random.set_state(saved)

    def tell(self, candidates: list[np.ndarray], values: list[float]) -> None:
        saved = np.random.get_state()
        np.random.set_state(self._state)
        try:
            self.strategy.tell(candidates, values)
        finally:
            self._state = np.random.get_state()
            np.random.set_state(saved)


# ------------------------------------------------------------------------------ LongRoPE2's space (--space critical)
#
# LongRoPE2 (Shang et al. 2025, arXiv 2502.20082, §2.1-3.2, Alg. 1-2) splits the pairs at a critical dimension d:
# the pairs from d on (those whose wavelength 2π/θ_i the training length L does not cover) get searched factors,
# each at least s = L'/L and non-decreasing in the pair index; the pairs below d get NTK scaling with the base
# re-derived from d, so that NTK's factor at pair d equals the searched factor there:
#
#     b' = b · f_d^(D / 2d)      λ_i = (b'/b)^(2i/D) = f_d^(i/d)   (i < d)
#
# (D the rotary dimension, f_d the factor of pair d). The search starts from the theoretical critical dimension
# d_tcd = ⌈(D/2) log_b(L / 2π)⌉, the first pair whose wavelength reaches L, and tries d from d_10 (the first pair
# with fewer than 10 periods inside L: ⌈(D/2) log_b(L / 20π)⌉) up to d_tcd, LongRoPE2's candidates.

LONGROPE_SPACES = ("cma", "critical")  # today's knot curve from YaRN's factors; LongRoPE2's critical dimension
CRITICAL_LOW_PERIODS = 10  # the lowest candidate critical dimension: the first pair with fewer periods inside L


def critical_pair(rotary_dim: int, base: float, L: int, periods: float = 1.0) -> int:
    """The first pair whose wavelength 2π b^(2i/D) is at least L / `periods`: ⌈(D/2) log_b(L / (2π periods))⌉,
    within [0, D/2] (D/2: no pair's wavelength reaches it). periods = 1: LongRoPE2's theoretical critical dimension."""
    exponent = (rotary_dim / 2) * math.log(L / (2 * math.pi * periods)) / math.log(base)
    return min(max(math.ceil(exponent), 0), rotary_dim // 2)


def ntk_base_at(critical: int, factor_at_critical: float, rotary_dim: int, base: float) -> float:
    """The NTK base b' whose factor at pair `critical` is `factor_at_critical`: (b'/b)^(2d/D) = f_d."""
    if critical < 1:
        raise CtxextError("the critical dimension must be at least 1 (pair 0 is never rescaled by NTK)")
    return base * factor_at_critical ** (rotary_dim / (2 * critical))


def ntk_factors_below(critical: int, factor_at_critical: float, rotary_dim: int, base: float) -> np.ndarray:
    """The factors θ_i/θ'_i of pairs 0..d-1 under NTK with the base re-derived from pair d: (b'/b)^(2i/D)."""
    ratio = ntk_base_at(critical, factor_at_critical, rotary_dim, base) / base
    return ratio ** (2.0 * np.arange(critical) / rotary_dim)


def critical_factors(critical: int, above, rotary_dim: int, base: float, factor: float) -> np.ndarray:
    """The per-pair factors of LongRoPE2's space: NTK below `critical` (base from above[0]), then `above`. A
    CtxextError where `above` breaks the constraints (its length, below s, decreasing)."""
    above = np.asarray(above, dtype=np.float64)
    pairs = rotary_dim // 2
    if not 1 <= critical < pairs or len(above) != pairs - critical:
        raise CtxextError(
            f"the critical dimension {critical} and {len(above)} factors above it do not make the {pairs} pairs"
        )
    if above.min() < factor or not is_monotone(above):
        raise CtxextError(
            f"the factors above the critical dimension must be at least s = {factor:g} and non-decreasing"
        )
    return np.concatenate([ntk_factors_below(critical, above[0], rotary_dim, base), above])


def critical_of(z0: float, low: int, high: int, start: int) -> int:
    """The critical dimension of CMA-ES's first variable: `start` moved by z0 x (high - low), rounded, in
    [low, high]."""
    step = max(high - low, 1)
    return int(min(max(round(start + float(z0) * step), low), high))


def recorded_critical_dim(longrope: dict | None, trial: dict) -> int | None:
    """The critical dimension of a logged trial of a --space critical search (from its z and search.json's
    longrope record), None for the defaults and for other searches."""
    if not longrope or longrope.get("space") != "critical" or not trial.get("z"):
        return None
    low, high = longrope["critical_dims"]
    return critical_of(trial["z"][0], low, high, longrope["theoretical_critical_dim"])


@dataclass(frozen=True)
class CriticalSpace:
    """The CMA-ES variables z (1 + knots numbers) of LongRoPE2's space, mapped onto valid factor vectors only.

    - z[0] moves the critical dimension from the theoretical one (`start`), `low..high` per unit, rounded and
      kept in [low, high];
    - z[1:] are rises at `knots` knots spread over the pairs from d to the last: the factors above d are
      s · exp(u · running sum of max(z_k, 0)) interpolated between knots, i.e. s times a cumulative product of
      (1 + a non-negative increment), capped at `upper`: at least s and non-decreasing by construction. The unit
      u = ln(upper / s) / knots makes z_k = 1 at every knot reach the cap at the last pair;
    - below d, NTK with the base re-derived from the factor at d.

    z = 0 is the start: d = d_tcd, every factor above it s.
    """

    rotary_dim: int
    base: float
    factor: float
    upper: float
    low: int
    high: int
    start: int
    knots: int

    @property
    def pairs(self) -> int:
        return self.rotary_dim // 2

    @property
    def dimension(self) -> int:
        return 1 + self.knots

    def critical_of(self, z0: float) -> int:
        return critical_of(z0, self.low, self.high, self.start)

    def above_of(self, rises, critical: int) -> np.ndarray:
        unit = math.log(self.upper / self.factor) / self.knots  # z_k = 1 at every knot: the cap at the last pair
        levels = np.cumsum(np.maximum(np.asarray(rises, dtype=np.float64), 0.0)) * unit
        count = self.pairs - critical
        where = np.linspace(0.0, 1.0, count) if count > 1 else np.zeros(1)
        knots = np.linspace(0.0, 1.0, self.knots)
        rise = np.interp(where, knots, levels) if self.knots > 1 else np.full(count, levels[0])
        return np.exp(np.minimum(math.log(self.factor) + rise, math.log(self.upper)))

    def factors_of(self, z) -> tuple[int, np.ndarray]:
        """(the critical dimension, the per-pair factors) of the variables z."""
        z = np.asarray(z, dtype=np.float64)
        critical = self.critical_of(z[0])
        above = self.above_of(z[1:], critical)
        return critical, critical_factors(critical, above, self.rotary_dim, self.base, self.factor)


def critical_space(
    rotary_dim: int, base: float, factor: float, L: int, knots: int, upper: float | None = None
) -> CriticalSpace:
    """LongRoPE2's space for a model (D, b) extended s-fold from L; a CtxextError where it has no room."""
    pairs = rotary_dim // 2
    theoretical = critical_pair(rotary_dim, base, L)
    if theoretical >= pairs:
        raise CtxextError(
            f"--space critical: no pair's wavelength reaches L = {L} (rotary dim {rotary_dim}, base {base:g}), so "
            "there is no critical dimension to search; use --space cma"
        )
    if not 1 <= knots <= pairs:
        raise CtxextError(f"--longrope-knots must be between 1 and the number of pairs ({pairs}), got {knots}")
    high = max(theoretical, 1)
    low = min(max(critical_pair(rotary_dim, base, L, CRITICAL_LOW_PERIODS), 1), high)
    upper = float(upper if upper is not None else 2.0 * factor)
    return CriticalSpace(rotary_dim, float(base), float(factor), upper, low, high, high, knots)
