"""The search loops: TPE (Optuna) over scalar ranges, CMA-ES over LongRoPE's knots; every trial in trials.jsonl.

Both loops share one contract:

- **Trial 0 is the method's defaults** (with any parameter the user gave as a flag), so the best trial is never
  worse than the defaults on the calibration data.
- **Every trial is appended to trials.jsonl** as soon as it is scored (one JSON object a line, flushed and
  fsynced), before the next one is proposed. A line cut off by a crash is dropped when the log is read again.
- **A proposal depends only on the seed, the trial number and the trials before it.** TPE gets a fresh sampler
  seeded from (seed, trial number) and a study rebuilt from the log; CMA-ES is replayed generation by
  generation from the log. So a resumed search proposes exactly what an uninterrupted one would have, and no
  logged trial is ever scored twice. A proposal equal to an earlier trial reuses that trial's score.

`evaluate(params) -> {"value": float, ...metrics}` scores one proposal (lower is better) and raises
`InvalidParams` for parameters the method rejects (e.g. beta_fast <= beta_slow): such a trial is logged as
`invalid` and the optimizer learns to avoid it.
"""

from __future__ import annotations

import json
import math
import os
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np

from ..errors import CtxextError
from .space import Range

TRIALS_FILE = "trials.jsonl"


class InvalidParams(CtxextError):
    """The method rejects these parameter values: the trial is recorded as invalid, the search goes on."""


class TrialLog:
    """trials.jsonl: one trial a line, appended and fsynced as each trial finishes."""

    def __init__(self, path: str | Path):
        self.path = Path(path)

    def read(self) -> list[dict]:
        """The logged trials in order; a cut-off last line (a crash mid-write) is dropped from the file too."""
        if not self.path.exists():
            return []
        raw = self.path.read_bytes()
        records, good_bytes = [], 0
        for line in raw.splitlines(keepends=True):
            if not line.endswith(b"\n"):
                break
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                break
            records.append(record)
            good_bytes += len(line)
        if good_bytes != len(raw):
            with open(self.path, "r+b") as handle:
                handle.truncate(good_bytes)
        for index, record in enumerate(records):
            if record.get("number") != index:
                raise CtxextError(
                    f"{self.path} is not a trial log of ctxext search (trial {index} is numbered "
                    f"{record.get('number')!r})"
                )
        return records

    def append(self, record: dict) -> None:
        line = json.dumps(record, allow_nan=False) + "\n"
        with open(self.path, "a", encoding="utf-8") as handle:
            handle.write(line)
            handle.flush()
            os.fsync(handle.fileno())


def derived_seed(seed: int, number: int) -> int:
    """An independent 32-bit seed for trial `number` of a search seeded with `seed`."""
    return int(np.random.SeedSequence([int(seed), int(number)]).generate_state(1)[0])


def best_trial(history: list[dict]) -> dict | None:
    """The complete trial with the lowest value; ties go to the earlier trial (so to the defaults)."""
    complete = [t for t in history if t["state"] == "complete"]
    return min(complete, key=lambda t: (t["value"], t["number"])) if complete else None


class _Runner:
    """Scores proposals in order, logging each one; replays logged trials instead of scoring them again."""

    def __init__(self, evaluate: Callable[[dict], dict], log: TrialLog, trials: int, progress=None):
        self.evaluate, self.log, self.trials, self.progress = evaluate, log, trials, progress
        self.history = log.read()

    def logged(self, number: int) -> dict | None:
        return self.history[number] if number < len(self.history) else None

    def run(self, number: int, role: str, params: dict, extra: dict | None = None) -> dict | None:
        """Trial `number`: the logged one if there is one, else scored now (None once the budget is used)."""
        logged = self.logged(number)
        if logged is not None:
            return logged
        if number >= self.trials:
            return None
        repeat = next((t for t in self.history if t["params"] == params), None)
        started = time.perf_counter()
        if repeat is not None:
            record = {k: repeat[k] for k in ("state", "value", "metrics", "error") if k in repeat}
            record["repeat_of"] = repeat["number"]
        else:
            try:
                metrics = dict(self.evaluate(params))
                value = metrics.pop("value")
                if value is None or not math.isfinite(value):
                    record = {"state": "diverged", "value": None, "metrics": _finite(metrics)}
                else:
                    record = {"state": "complete", "value": float(value), "metrics": _finite(metrics)}
            except InvalidParams as error:
                record = {"state": "invalid", "value": None, "metrics": {}, "error": str(error)}
        record = {
            "number": number,
            "role": role,
            **record,
            "params": params,
            **(extra or {}),
            "seconds": round(time.perf_counter() - started, 3),
        }
        self.log.append(record)
        self.history.append(record)
        if self.progress is not None:
            best = best_trial(self.history)
            self.progress.update(1)
            if best is not None:
                self.progress.set_postfix(best=f"{best['value']:.4g}", trial=best["number"], refresh=False)
        return record


def _finite(metrics: dict) -> dict:
    """Metrics with non-finite floats as None (JSON has no NaN)."""
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in metrics.items()}


# ------------------------------------------------------------------------------------------- scalar (TPE)
def scalar_search(
    space: list[Range],
    start: dict,
    evaluate: Callable[[dict], dict],
    log: TrialLog,
    trials: int,
    seed: int = 0,
    startup_trials: int = 5,
    progress=None,
) -> list[dict]:
    """Trial 0 = `start` (the defaults), then TPE proposals until `trials` trials are logged. Returns them all."""
    runner = _Runner(evaluate, log, trials, progress)
    if runner.run(0, "defaults", start) is None:
        return runner.history
    number = 1
    while number < trials or runner.logged(number) is not None:
        params = (
            runner.logged(number)["params"]
            if runner.logged(number)
            else propose_tpe(space, runner.history[:number], seed, number, startup_trials)
        )
        runner.run(number, "search", params)
        number += 1
    return runner.history


def propose_tpe(space: list[Range], history: list[dict], seed: int, number: int, startup_trials: int) -> dict:
    """TPE's proposal for trial `number`, from a sampler seeded by (seed, number) and the trials so far."""
    import optuna

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
    log: TrialLog,
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
    from .longrope import CmaProposer, factors_from, knot_positions

    pairs = len(start)
    positions = knot_positions(pairs, knots)
    upper = float(upper if upper is not None else max(start.max(), 1.0))
    runner = _Runner(evaluate, log, trials, progress)

    def run(number: int, role: str, z) -> dict | None:
        factors = defaults if z is None else [float(f) for f in factors_from(z, start, positions, upper)]
        extra = {} if z is None else {"z": [float(v) for v in z]}
        logged = runner.logged(number)
        if logged is not None and (logged["role"] != role or not np.allclose(logged.get("z", []), extra.get("z", []))):
            raise CtxextError(
                f"{log.path} does not match this search (trial {number} differs); resume it with the "
                "settings it was started with, or start a new search in another directory"
            )
        return runner.run(number, role, {"long_factor": factors}, extra)

    if run(0, "defaults", None) is None or run(1, "start", np.zeros(knots)) is None:
        return runner.history
    proposer = CmaProposer(knots, sigma, seed, popsize)
    number = 2
    while True:
        candidates = proposer.ask()
        values = []
        for z in candidates:
            record = run(number, "search", z)
            if record is None:
                return runner.history
            values.append(_cma_value(record, runner.history[:number]))
            number += 1
        proposer.tell(candidates, values)


def _cma_value(record: dict, earlier: list[dict]) -> float:
    """CMA-ES needs a number for every candidate: a failed trial counts as twice the worst value seen so far."""
    if record["state"] == "complete":
        return record["value"]
    finite = [t["value"] for t in earlier if t["state"] == "complete"]
    return 2 * max(finite) if finite else 1e12
