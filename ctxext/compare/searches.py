"""The searches of a compare: a screen, then successive halving, each search an ordinary `ctxext search` study
(`ctxext.search.workflow.run_search`): resumable, and shareable through one --storage across processes and machines.

- **Screen**: every searchable method at its defaults (trial 0 of a search) on the first calibration document,
  with the compare's objective.
- **Rungs**: the better half (rounded up) of the screened methods is searched to the first rung's trials on all the
  calibration documents; after each rung the better half of those still in the race, by the best objective value
  of their search so far, goes on to the next rung's trials (`rung_trials`: ..., N/4, N/2, N). Under --budget a
  rung's trials are cut to what the time left allows (the trials' recorded seconds per method), and no rung starts
  that cannot add one trial per method.

Every decision reads only what the studies hold (their values and recorded seconds), so the same command resumes
into the same decisions.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import CtxextError
from ..outputs import write_json
from ..run_options import DataOptions, RuntimeOptions
from ..search.loop import best_trial
from ..search.plan import SearchRequest
from ..search.space import collapse_elements
from ..search.store import read_trials
from ..search.workflow import run_search

HOLD_ENV = "CTXEXT_COMPARE_HOLD_IN_SEARCH"  # tests only: "N:FILE", held (to be killed) in a search's N-th forward
SEARCH_SEEDS = {"ppl": 0}  # the needle objectives use seed 1: other keys than the table's passkey (seed 0)
NEEDLE_SEED = 1


def rung_trials(final: int) -> list[int]:
    """Trials per rung, doubling up to `final`: 8 -> [2, 4, 8], 12 -> [3, 6, 12], 1 -> [1]."""
    rungs = [final]
    while rungs[0] // 2 >= 2:
        rungs.insert(0, rungs[0] // 2)
    return rungs


def better_half(values: dict[str, float]) -> list[str]:
    """The better half (rounded up) of the methods by value (lower is better; ties by name)."""
    ranked = sorted(values, key=lambda m: (values[m], m))
    return ranked[: math.ceil(len(ranked) / 2)]


def fit_trials(target: int, done: dict[str, int], cost: dict[str, float], seconds_left: float) -> int:
    """The most trials (up to `target`) every method in `done` can reach within `seconds_left`, at `cost` seconds per
    trial each; 0 when not even one more trial each fits."""
    best = 0
    for trials in range(1, target + 1):
        needed = sum(max(0, trials - done[m]) * cost[m] for m in done)
        if needed <= seconds_left and trials > min(done.values(), default=0):
            best = trials
    return best


def search_start(method: str, length: int, L: int, rotary_dim: int, base: float) -> dict:
    """The method mapping a search starts from: its defaults, or for theta the NTK-aware base b * s^(d/(d-2))."""
    mapping = {"method": method, "factor": length / L}
    if method == "theta":
        mapping["new_base"] = base * (length / L) ** (rotary_dim / (rotary_dim - 2))
    return mapping


def search_folder(root: Path, method: str, length: int, objective: str, screen: bool) -> Path:
    """searches/METHOD-LENGTH[-OBJECTIVE][-screen] (the names of scripts/compare_methods.py's searches)."""
    name = f"{method}-{length}" + ("" if objective == "ppl" else f"-{objective}") + ("-screen" if screen else "")
    return root / "searches" / name


def model_file(folder: Path) -> Path:
    """Beside a search's folder: the fingerprint of the model it searched."""
    return folder.with_name(f"{folder.name}.model.json")


def adopt_search(folder: Path, model: str, fingerprint: str) -> None:
    """Let a kept search resume where the model sits at another path (another checkout, cache or machine): its
    recorded model path is rewritten, but only when the model is the same one (the fingerprint recorded beside it)."""
    settings = json.loads((folder / "search.json").read_text())
    if settings["model"] == str(model):
        return
    recorded = json.loads(model_file(folder).read_text())["model_fingerprint"] if model_file(folder).exists() else None
    if recorded != fingerprint:
        raise CtxextError(
            f"{folder}: searched another model ({settings['model']}, fingerprint {recorded}); move the folder away "
            f"to search {model} again"
        )
    write_json(folder / "search.json", {**settings, "model": str(model)})


def read_history(folder: Path) -> list[dict]:
    trials = folder / "trials.jsonl"
    return read_trials(trials) if trials.is_file() else []


def best_of(history: list[dict]) -> dict | None:
    return best_trial(history)


def search_pending(folder: Path, wanted: int) -> str | None:
    """Why a search of a fixed protocol has no row yet ('not started', 'k of N trials done', 'no valid trial'), or
    None when its `wanted` trials are done: a partial search's best would be scored, then superseded."""
    history = read_history(folder)
    if not history:
        return "not started"
    if len(history) < wanted:
        return f"{len(history)} of {wanted} trials done"
    return "no valid trial" if best_of(history) is None else None


def searched_config(folder: Path) -> tuple[dict | None, dict | None]:
    """(the best trial's method mapping, what the report says of the search) of a kept search; (None, None) if none."""
    history = read_history(folder)
    best = best_of(history)
    if best is None:
        return None, None
    settings = json.loads((folder / "search.json").read_text())
    config = {
        "method": settings["method"],
        "factor": settings["factor"],
        "original_max_position_embeddings": settings["original_max_position_embeddings"],
        **settings["fixed"],
        **({"selected_pairs": settings["selected_pairs"]} if settings.get("selected_pairs") is not None else {}),
        **collapse_elements(best["params"]),  # per-element parameters back into the lists the method takes
    }
    info = {
        "trials": len(history),
        "best": best["number"],
        "calibration_defaults": history[0]["value"],
        "calibration_best": best["value"],
        "objective": settings["objective"],
        "folder": folder.name,
    }
    return config, info


@contextlib.contextmanager
def held_in_forward(model, forwards: list[int]):
    """Tests only ($CTXEXT_COMPARE_HOLD_IN_SEARCH=N:FILE): at the N-th forward pass of this process's searches
    (`forwards` counts them across searches), write FILE and wait there, inside a running trial, to be killed."""
    spec = os.environ.get(HOLD_ENV)
    if not spec:
        yield
        return
    at, _, marker = spec.partition(":")

    def count(module, args):
        forwards[0] += 1
        if forwards[0] == int(at):
            Path(marker).write_text(str(os.getpid()))
            threading.Event().wait()  # until killed

    handle = model.register_forward_pre_hook(count)
    try:
        yield
    finally:
        handle.remove()


@dataclass
class StudyRunner:
    """Runs (or, report-only, reads) the searches of one compare on its loaded model."""

    plan: object  # ComparePlan
    root: Path  # the cache folder: searches/ under it
    model_loader: Callable
    compute: bool = True
    log: Callable[[str], None] = lambda line: None
    ran: list = field(default_factory=list)
    forwards: list = field(default_factory=lambda: [0])  # the searches' forward passes so far (HOLD_ENV)

    def folder(self, method: str, length: int, screen: bool, objective: str | None = None) -> Path:
        return search_folder(self.root, method, length, objective or self.plan.request.objective, screen)

    def screen_is_separate(self) -> bool:
        return len(self.plan.calibration) > 1

    def data_for(self, documents: list) -> DataOptions:
        """Data options under which `ctxext search` reads exactly `documents` as its calibration (first)."""
        data = self.plan.request.data
        names = [d.name for d in documents]
        if data.text_files:
            return DataOptions(text_files=names)
        if data.dataset and data.dataset.split(":", 1)[0] == "shakespeare":
            return DataOptions(dataset="shakespeare:" + ",".join(names))
        return data  # a dataset: the calibration documents are its first long-enough ones (checked after planning)

    def request(self, method: str, length: int, trials: int, screen: bool, objective: str | None = None):
        plan = self.plan
        documents = plan.calibration[:1] if screen else plan.calibration
        objective = objective or plan.request.objective
        storage = plan.request.storage
        folder = self.folder(method, length, screen, objective)
        return SearchRequest(
            model=plan.request.model,
            method=search_start(method, length, plan.L, plan.rotary_dim, plan.base),
            length=length,
            output=folder,
            trials=trials,
            objective=objective,
            seed=SEARCH_SEEDS.get(objective, NEEDLE_SEED),
            calibration_docs=len(documents),
            held_out=0,
            checkpoint=False,
            baseline=False,
            passkey_trials=1,
            passkey_depths=list(plan.request.passkey_depths),
            data=self.data_for(documents),
            runtime=RuntimeOptions(
                str(plan.runtime["device"]),
                plan.dtype_label,
                plan.runtime["attn_implementation"],
                plan.request.runtime.bos,
                progress=False,
            ),
            resume=(folder / "search.json").is_file(),
            storage=storage,
            study_name=f"ctxext-compare-{folder.name}" if storage else "ctxext-search",
        )

    def run(self, method: str, length: int, trials: int, screen: bool = False, objective: str | None = None) -> list:
        """The study's trials after running it to `trials` (or as kept, report-only)."""
        folder = self.folder(method, length, screen, objective)
        history = read_history(folder)
        if len(history) >= trials or not self.compute:
            return history
        if (folder / "search.json").is_file():
            adopt_search(folder, self.plan.request.model, self.plan.fingerprint)
        elif not model_file(folder).exists():
            folder.parent.mkdir(parents=True, exist_ok=True)
            write_json(model_file(folder), {"model_fingerprint": self.plan.fingerprint})
        request = self.request(method, length, trials, screen, objective)
        self.log(f"search: {method} at {length}, {trials} trials ({request.objective})")
        model = self.model_loader()
        with held_in_forward(model, self.forwards):
            result = run_search(request, model=model)
        self.ran.append(folder.name)
        return result.history

    def screen(self, method: str, length: int) -> list[dict]:
        return self.run(method, length, 1, screen=self.screen_is_separate())


def trial_seconds(history: list[dict]) -> float:
    done = [t.get("seconds", 0.0) for t in history if t.get("seconds") is not None]
    return sum(done) / len(done) if done else 0.0


def successive_halving(
    runner: StudyRunner,
    methods: list[str],
    length: int,
    final_trials: int,
    seconds_left: Callable[[], float] | None = None,
    reserve: Callable[[str], float] = lambda method: 0.0,
) -> dict:
    """Screen `methods` at `length`, then halve them over the rungs; returns the record the report shows:
    {"screen": {method: value}, "rungs": [{"trials", "methods", "values"}], "stopped": why or None}."""
    screen = {}
    for method in methods:
        best = best_of(runner.screen(method, length))
        if best is not None:
            screen[method] = best["value"]
    record = {"screen": screen, "rungs": [], "stopped": None}
    values, costs = dict(screen), {}
    survivors = list(screen)
    for target in rung_trials(final_trials) if final_trials > 1 else []:
        survivors = better_half({m: values[m] for m in survivors})
        done = {m: len(read_history(runner.folder(m, length, False))) for m in survivors}
        trials = target
        if seconds_left is not None and any(done[m] < target for m in survivors):
            for m in survivors:
                histories = read_history(runner.folder(m, length, False)) or runner.screen(m, length)
                costs[m] = max(trial_seconds(histories), 1e-3)
            left = seconds_left() - sum(reserve(m) for m in survivors)
            trials = fit_trials(target, done, costs, left)
            if trials == 0:
                record["stopped"] = f"the budget left ({max(0, left):.0f} s) fits no more trials"
                break
        for method in survivors:
            best = best_of(runner.run(method, length, trials))
            if best is not None:
                values[method] = best["value"]
        record["rungs"].append({"trials": trials, "methods": survivors, "values": {m: values[m] for m in survivors}})
        if trials < target:
            record["stopped"] = f"the budget allowed {trials} of the rung's {target} trials"
            break
        if len(survivors) == 1 and target == final_trials:
            break
    return record
