"""The search loops: TPE (Optuna) over scalar ranges, CMA-ES over LongRoPE's knots or LongRoPE2's critical-dimension
space (their parametrisations: `ctxext.search.longrope`), on a study in an Optuna storage.

Both loops share one contract:

- **Trial 0 is the method's defaults** (with any parameter the user gave as a flag), so the best trial is never
  worse than the defaults on the calibration data.
- **Every trial is an Optuna trial** in the search's study (`store.TrialStore`), recorded as soon as it is scored;
  any number of processes on any number of machines can run trials of one study at once, and a search killed
  mid-trial resumes by opening its study again (the lost trial's slot is run again).
- **A proposal depends only on the seed, the slot and the trials in earlier slots.** TPE gets a fresh sampler
  seeded from (seed, slot) and an in-memory study of the finished trials before the slot; CMA-ES is replayed
  generation by generation from them (a slot of a later generation waits for the earlier generations). So one
  process, resumed or not, proposes exactly what an uninterrupted search does, and no finished trial is ever
  scored twice. Several processes propose from what is finished when they ask, as in any parallel TPE. A
  proposal equal to an earlier trial reuses that trial's score.

`evaluate(params) -> {"value": float, ...metrics}` scores one proposal (lower is better) and raises
`InvalidParams` for parameters the method rejects (e.g. beta_fast <= beta_slow): such a trial is recorded as
`invalid` and the search goes on. Any other error stops the search (its slot is queued again for a resume).

**Why pycma for LongRoPE and not Optuna's CmaEsSampler:** the knots are searched by pycma, as before the studies,
with every candidate an Optuna trial (its knot corrections `z` and factors as user attributes) in the same study.
Optuna's CmaEsSampler (the `cmaes` package) would propose other candidates for the same seed, so the committed
LongRoPE searches and their numbers could not be resumed or reproduced; and it reads its state back from the
trials' system attributes, where pycma is replayed from the recorded trials, which the slots keep exact.
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Callable

import numpy as np

from ..errors import CtxextError
from .longrope import DEFAULT_SIGMA, CmaProposer, CriticalSpace, factors_from, knot_positions
from .space import Range, optuna_module

POLL_SECONDS = 1.0  # how often a worker with nothing to run looks at the study again


class InvalidParams(CtxextError):
    """The method rejects these parameter values: the trial is recorded as invalid, the search goes on."""


class NotReady(Exception):
    """A proposal needs trials in earlier slots that are not finished yet."""

    def __init__(self, slots: list[int]):
        super().__init__(f"waiting for slots {slots}")
        self.slots = slots


def derived_seed(seed: int, number: int) -> int:
    """An independent 32-bit seed for trial `number` of a search seeded with `seed`."""
    return int(np.random.SeedSequence([int(seed), int(number)]).generate_state(1)[0])


def best_trial(history: list[dict]) -> dict | None:
    """The complete trial with the lowest value; ties go to the earlier trial (so to the defaults)."""
    complete = [t for t in history if t["state"] == "complete"]
    return min(complete, key=lambda t: (t["value"], t["number"])) if complete else None


# -------------------------------------------------------------------------------------------- the loop
def run_search_loop(
    store, propose, evaluate: Callable[[dict], dict], trials: int, progress=None, space: list[Range] = ()
) -> list[dict]:
    """Claim, propose, score and record trials until `trials` slots are finished (by this process or others);
    returns every finished trial. `propose(slot, history) -> (role, params, extra)` may raise NotReady. The
    parameters in `space` are recorded as the Optuna trials' parameters too."""
    while True:
        store.release_lost()
        history = store.history()
        _show(progress, history, trials)
        if sum(t["number"] < trials for t in history) >= trials:
            return history
        claim = store.claim(trials)
        if claim is None:
            time.sleep(POLL_SECONDS)  # the other slots are running elsewhere
            continue
        with store.heartbeat(claim):
            record = _run_claim(store, claim, propose, evaluate, space)
        if record is not None:
            store.finish(claim, record)  # False if given up meanwhile: the slot is run again


def _run_claim(store, claim, propose, evaluate, space) -> dict | None:
    """The record of the claimed slot, or None when the claim was given back (waiting on a queued slot)."""
    proposal = _proposal(store, claim, propose)
    if proposal is None:
        return None
    role, params, extra = proposal
    inside = [r for r in space if r.contains(params.get(r.name))]  # a default may lie outside (or be None)
    store.begin(claim, role, params, extra, {r.name: r.distribution() for r in inside})
    try:
        return score(params, store.history(), evaluate)
    except BaseException as error:
        store.give_back(claim, f"{type(error).__name__}: {error}".splitlines()[0])
        raise


def _proposal(store, claim, propose) -> tuple | None:
    """(role, params, extra) of the claimed slot: a retried trial's own, else proposed once the earlier slots it
    needs are finished; None when the claim was given back, its wait being on slots that are queued."""
    if "params" in claim.carried:
        carried = dict(claim.carried)
        return carried.pop("role"), carried.pop("params"), carried
    while True:
        earlier = [t for t in store.history() if t["number"] < claim.slot]
        try:
            return propose(claim.slot, earlier)
        except NotReady as waiting:
            store.release_lost()
            if not _someone_runs(store, waiting.slots):
                store.give_back(claim, f"slot {claim.slot} waits for slots {waiting.slots}, which are queued")
                return None
            time.sleep(POLL_SECONDS)


def _someone_runs(store, slots: list[int]) -> bool:
    running = {t.user_attrs.get("slot") for t in store.frozen() if t.state.name == "RUNNING"}
    return all(slot in running for slot in slots)


def score(params: dict, history: list[dict], evaluate) -> dict:
    """A trial's outcome: its state, value and metrics (an earlier trial's, when it had the same parameters)."""
    repeat = next((t for t in history if t["params"] == params), None)
    if repeat is not None:
        record = {k: repeat[k] for k in ("state", "value", "metrics", "error") if k in repeat}
        return {**record, "repeat_of": repeat["number"]}
    try:
        metrics = dict(evaluate(params))
    except InvalidParams as error:
        return {"state": "invalid", "value": None, "metrics": {}, "error": str(error)}
    value = metrics.pop("value")
    if value is None or not math.isfinite(value):
        return {"state": "diverged", "value": None, "metrics": _finite(metrics)}
    return {"state": "complete", "value": float(value), "metrics": _finite(metrics)}


def _finite(metrics: dict) -> dict:
    """Metrics with non-finite floats as None (JSON has no NaN)."""
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in metrics.items()}


def _show(progress, history: list[dict], trials: int) -> None:
    if progress is None:
        return
    progress.n = min(len(history), trials)
    best = best_trial(history)
    if best is not None:
        progress.set_postfix(best=f"{best['value']:.4g}", trial=best["number"], refresh=False)
    progress.refresh()


# ------------------------------------------------------------------------------------------- scalar (TPE)
def scalar_search(
    space: list[Range],
    start: dict,
    evaluate: Callable[[dict], dict],
    store,
    trials: int,
    seed: int = 0,
    startup_trials: int = 5,
    progress=None,
) -> list[dict]:
    """Trial 0 = `start` (the defaults), then TPE proposals until `trials` trials are finished. Returns them all."""
    store.require("ctxext_loop", {"kind": "tpe", "seed": seed, "startup_trials": startup_trials}, "another search")

    def propose(slot: int, earlier: list[dict]):
        if slot == 0:
            return "defaults", start, {}
        return "search", propose_tpe(space, earlier, seed, slot, startup_trials), {}

    return run_search_loop(store, propose, evaluate, trials, progress, space)


def propose_tpe(space: list[Range], history: list[dict], seed: int, number: int, startup_trials: int) -> dict:
    """TPE's proposal for trial `number`, from a sampler seeded by (seed, number) and the trials so far."""
    optuna = optuna_module()

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    distributions = {r.name: r.distribution() for r in space}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        sampler = optuna.samplers.TPESampler(
            seed=derived_seed(seed, number), n_startup_trials=startup_trials, multivariate=True
        )
        study = optuna.create_study(direction="minimize", sampler=sampler)
        for record in history:
            params = record["params"]
            # Trial 0 may hold a default outside the range (or None: "the method decides"): TPE cannot place it.
            if not all(r.name in params and r.contains(params[r.name]) for r in space):
                continue
            complete = record["state"] == "complete"
            study.add_trial(
                optuna.trial.create_trial(
                    params={r.name: params[r.name] for r in space},
                    distributions=distributions,
                    value=record["value"] if complete else None,
                    state=optuna.trial.TrialState.COMPLETE if complete else optuna.trial.TrialState.FAIL,
                )
            )
        trial = study.ask(distributions)
    return {r.name: trial.params[r.name] for r in space}


# -------------------------------------------------------------------------------------- LongRoPE (CMA-ES)
def longrope_search(
    start: np.ndarray,
    defaults: list[float],
    evaluate: Callable[[dict], dict],
    store,
    trials: int,
    seed: int = 0,
    knots: int = 8,
    sigma: float = 0.5,
    upper: float | None = None,
    popsize: int | None = None,
    progress=None,
) -> list[dict]:
    """Trial 0 = the defaults (every long factor = s), trial 1 = the starting curve (z = 0), then CMA-ES over the
    knot corrections z (see `ctxext.search.longrope`). Each trial's params are {"long_factor": [...]}."""
    positions = knot_positions(len(start), knots)
    upper = float(upper if upper is not None else max(start.max(), 1.0))
    plan = {"kind": "cma-es", "seed": seed, "knots": knots, "sigma": sigma, "upper": upper, "popsize": popsize}
    store.require("ctxext_loop", plan, "another search")

    def propose(slot: int, earlier: list[dict]):
        if slot == 0:
            return "defaults", {"long_factor": list(defaults)}, {}
        z = np.zeros(knots) if slot == 1 else cma_candidate(slot, earlier, knots, sigma, seed, popsize)
        factors = [float(f) for f in factors_from(z, start, positions, upper)]
        return ("start" if slot == 1 else "search"), {"long_factor": factors}, {"z": [float(v) for v in z]}

    return run_search_loop(store, propose, evaluate, trials, progress)


def critical_search(
    space: CriticalSpace,
    evaluate,
    store,
    trials: int,
    seed: int = 0,
    sigma: float = DEFAULT_SIGMA,
    popsize: int | None = None,
    progress=None,
) -> list[dict]:
    """Trial 0 = the defaults (every factor s), trial 1 = the start (d_tcd, s above it, NTK below), then CMA-ES
    over z (`CriticalSpace`); every trial's params are {"long_factor": [...]}, with its z recorded."""
    plan = {
        "kind": "critical-cma-es",
        "seed": seed,
        "knots": space.knots,
        "sigma": sigma,
        "upper": space.upper,
        "popsize": popsize,
        "critical": [space.low, space.high],
    }
    store.require("ctxext_loop", plan, "another search")

    def propose(slot: int, earlier: list[dict]):
        if slot == 0:
            return "defaults", {"long_factor": [space.factor] * space.pairs}, {}
        if slot == 1:
            z = np.zeros(space.dimension)
        else:
            z = cma_candidate(slot, earlier, space.dimension, sigma, seed, popsize)
        _, factors = space.factors_of(z)  # its critical dimension: `recorded_critical_dim`
        extra = {"z": [float(v) for v in z]}
        return ("start" if slot == 1 else "search"), {"long_factor": [float(f) for f in factors]}, extra

    return run_search_loop(store, propose, evaluate, trials, progress)


def cma_candidate(slot: int, earlier: list[dict], knots: int, sigma: float, seed: int, popsize: int | None):
    """The knot corrections CMA-ES proposes for `slot` (>= 2): the earlier generations replayed from their trials
    (NotReady while one of them is unfinished), then this generation's candidate."""
    proposer = CmaProposer(knots, sigma, seed, popsize)
    generation, index = divmod(slot - 2, proposer.popsize)
    first = 2 + generation * proposer.popsize  # the first slot of this generation
    by_slot = {t["number"]: t for t in earlier}
    missing = [s for s in range(first) if s not in by_slot]
    if missing:
        raise NotReady(missing)
    ordered = [by_slot[s] for s in range(first)]
    for g in range(generation):
        candidates = proposer.ask()
        slots = range(2 + g * proposer.popsize, 2 + (g + 1) * proposer.popsize)
        proposer.tell(candidates, [_cma_value(ordered[s], ordered[:s]) for s in slots])
    return proposer.ask()[index]


def _cma_value(record: dict, earlier: list[dict]) -> float:
    """CMA-ES needs a number for every candidate: a failed trial counts as twice the worst value seen so far."""
    if record["state"] == "complete":
        return record["value"]
    finite = [t["value"] for t in earlier if t["state"] == "complete"]
    return 2 * max(finite) if finite else 1e12
