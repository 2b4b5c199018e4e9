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
"""

from __future__ import annotations

import math

import numpy as np

from ..errors import CtxextError

DEFAULT_KNOTS = 8
DEFAULT_SIGMA = 0.5  # CMA-ES's initial step, in log-factor units (about x1.65)


def start_factors(method_name: str, factor: float, rotary_dim: int, base: float, L: int) -> np.ndarray:
    """θ_i/θ'_i of a frequency method with its default parameters at scale `factor`: LongRoPE's starting curve."""
    from ..methods import compute_inv_freq, get_method, rope_inv_freq

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
        import cma

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
