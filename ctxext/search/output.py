"""The output directory of a search, which a later run resumes from: its files, what search.json holds
(`SearchSettings`, which a resume must match), the checks before anything is written, results.json's content
(`summarize`) and the plots. `ctxext.search.workflow` runs the search that fills it.

    OUT/search.json     what the search is (model, method, s, N, L, space, objective, data, dtype); a resume must match
    OUT/study.journal   the trials, as an Optuna study (the default storage; see `store`; --storage puts it elsewhere)
    OUT/study.json      where the trials are: --storage (null: OUT/study.journal) and the study's name
    OUT/trials.jsonl    every finished trial, one a line in trial order: written from the study after each trial
    OUT/results.json    the best trial, and the defaults and the best re-scored on held-out documents
    OUT/objective.png   the objective per trial, with the running best
    OUT/factors.png     (longrope) the per-pair factors found, against the defaults and the starting curve
    OUT/checkpoint/     the best parameters as a checkpoint, written by the same code as `ctxext patch`

Every file is written whole to a temporary name and renamed into place (`ctxext.outputs`).
"""

from __future__ import annotations

import json
import math
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path

from matplotlib.ticker import LogLocator, NullFormatter, ScalarFormatter

from ..errors import CtxextError
from ..outputs import check_overlap, new_figure, save_figure, write_json
from .loop import best_trial
from .space import Range
from .store import DERIVED, JOURNAL_FILE, differing

SEARCH_FILE = "search.json"
RESULTS_FILE = "results.json"
CHECKPOINT_DIR = "checkpoint"
OBJECTIVE_PLOT = "objective.png"
FACTORS_PLOT = "factors.png"
TRIALS_FILE = "trials.jsonl"
STUDY_FILE = "study.json"  # where the trials are: the storage and the study's name
OUTPUT_NAMES = (
    SEARCH_FILE,
    STUDY_FILE,
    JOURNAL_FILE,
    TRIALS_FILE,
    RESULTS_FILE,
    OBJECTIVE_PLOT,
    FACTORS_PLOT,
    CHECKPOINT_DIR,
)


@dataclass
class SearchSettings:
    """What defines a search; a resumed search must have the same (search.json)."""

    model: str
    method: str
    factor: float
    length: int
    original_max_position_embeddings: int
    logn: bool = False
    fixed: dict = field(default_factory=dict)  # parameters given as flags and not searched
    start: dict = field(default_factory=dict)  # searched parameters given as flags: trial 0's values
    space: list[Range] = field(default_factory=list)  # empty for longrope
    objective: str = "ppl"
    stride: int | None = None  # None: one window per document
    seed: int = 0
    startup_trials: int = 5  # TPE's random trials before it models the objective
    longrope: dict | None = None  # start_method, knots, sigma, upper, popsize (+ space and its range: critical)
    passkey: dict | None = None  # trials, depths (keys seeded by `seed`)
    data: dict = field(default_factory=dict)  # calibration / held-out document names and token fingerprints
    dtype: str = ""
    pair_selection: dict | None = None  # dpe: how its pairs are chosen (text, k), compared like the rest
    selected_pairs: list | None = None  # dpe: the pairs so chosen, measured once (DERIVED: recorded, not compared)

    @property
    def base(self) -> dict:
        """The method config every trial shares; a trial adds its parameters."""
        return {
            "method": self.method,
            "factor": self.factor,
            "original_max_position_embeddings": self.original_max_position_embeddings,
            "logn": self.logn,
            **self.fixed,
            **({"selected_pairs": self.selected_pairs} if self.selected_pairs is not None else {}),
        }

    def to_dict(self) -> dict:
        values = asdict(self)
        values["space"] = [{"name": r.name, **r.to_dict()} for r in self.space]
        return values


# --------------------------------------------------------------------------------------------- files
def check_output(out: str | Path, settings: dict, resume: bool, overwrite: bool, protected=()) -> str:
    """'new' or 'resume' for the output directory, or a one-line CtxextError. Writes nothing."""
    out = Path(out).expanduser()
    check_overlap(out, protected)  # non-empty is judged here
    search_file = out / SEARCH_FILE
    if resume:
        if not search_file.is_file():
            raise CtxextError(f"--resume: '{out}' holds no search to resume ({SEARCH_FILE} is missing)")
        try:
            logged = json.loads(search_file.read_text())
        except json.JSONDecodeError:
            raise CtxextError(f"--resume: '{search_file}' is not valid JSON") from None
        wrong = [k for k in differing(logged, settings) if k not in DERIVED]
        if wrong:
            raise CtxextError(
                f"--resume: the search in '{out}' was started with other settings (they differ in: "
                f"{', '.join(wrong)}); resume with the same ones, or choose another -o"
            )
        return "resume"
    if out.is_dir() and any(out.iterdir()):
        if not overwrite:
            hint = "--resume to continue it or --overwrite" if search_file.is_file() else "another -o or --overwrite"
            raise CtxextError(f"output directory '{out}' already exists and is not empty; use {hint}")
        strangers = [p.name for p in out.iterdir() if p.name not in OUTPUT_NAMES and not p.name.startswith(".")]
        if strangers:
            raise CtxextError(
                f"--overwrite: '{out}' holds files that are not a search's ({', '.join(strangers[:3])})"
                "; choose another -o"
            )
    return "new"


def check_study(out: str | Path, study: dict, mode: str) -> None:
    """On --resume: the same study (storage and name) as the search was started on (study.json), else an error."""
    path = Path(out) / STUDY_FILE
    if mode != "resume" or not path.is_file():
        return
    recorded = json.loads(path.read_text())
    if recorded != study:
        storage = f"--storage {recorded['storage']}" if recorded["storage"] else "no --storage"
        where = recorded["storage"] or Path(out) / JOURNAL_FILE
        raise CtxextError(
            f"--resume: the trials of the search in '{out}' are in study '{recorded['name']}' in '{where}'; "
            f"give {storage} --study-name {recorded['name']}"
        )


def start_output(out: Path, settings: dict, mode: str) -> None:
    """Create the output directory (emptied of an earlier search's files under --overwrite) with search.json."""
    out = Path(out)
    if mode == "resume":
        return
    out.mkdir(parents=True, exist_ok=True)
    for name in OUTPUT_NAMES:
        path = out / name
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()
    write_json(out / SEARCH_FILE, settings)


# ------------------------------------------------------------------------------------------ the results
def summarize(
    settings: SearchSettings,
    history: list[dict],
    held_out: dict,
    seconds: float,
    environment: dict | None = None,
    checkpoint: dict | None = None,
) -> dict:
    """results.json: settings, best and default trials, calibration and held-out numbers side by side."""
    best = best_trial(history)
    defaults = history[0]
    value = lambda t: t["value"] if t and t["state"] == "complete" else None

    def improvement(new, old):
        return None if new is None or old is None or old == 0 else (new - old) / old

    held = {
        name: (
            None
            if row is None
            else {"perplexity": row["perplexity"], "tokens": row["tokens"], "documents": row["documents"]}
        )
        for name, row in held_out.items()
    }
    held_ppl = {name: (row or {}).get("perplexity") for name, row in held.items()}
    return {
        "settings": settings.to_dict(),
        "trials": {
            "logged": len(history),
            "complete": sum(t["state"] == "complete" for t in history),
            "invalid": sum(t["state"] == "invalid" for t in history),
            "diverged": sum(t["state"] == "diverged" for t in history),
            "repeats": sum("repeat_of" in t for t in history),
        },
        "best": best,
        "defaults": defaults,
        "start_value": value(history[1]) if len(history) > 1 and history[1]["role"] == "start" else None,
        "calibration": {
            "objective": settings.objective,
            "defaults": value(defaults),
            "best": value(best),
            "change": improvement(value(best), value(defaults)),
        },
        "held_out": {
            "documents": settings.data.get("held_out", {}).get("documents", []),
            "perplexity": held_ppl,
            "change": improvement(held_ppl.get("best"), held_ppl.get("defaults")),
            "scores": held,
        },
        "checkpoint": checkpoint,
        "seconds": {
            "this_run": round(seconds, 1),
            "trials_total": round(sum(t.get("seconds", 0.0) for t in history), 1),
        },
        "environment": environment,
    }


def plot_objective(history: list[dict], path: Path, title: str, objective: str) -> None:
    fig = new_figure(figsize=(7.5, 4.2))
    ax = fig.subplots()
    done = [t for t in history if t["state"] == "complete"]
    failed = [t["number"] for t in history if t["state"] != "complete"]
    ax.scatter([t["number"] for t in done], [t["value"] for t in done], s=18, label="trial", zorder=3)
    running, best = [], math.inf
    for t in history:
        if t["state"] == "complete":
            best = min(best, t["value"])
        running.append(best)
    ax.step(range(len(history)), running, where="post", color="C1", label="best so far")
    if done and done[0]["number"] == 0:
        ax.scatter([0], [done[0]["value"]], s=60, marker="*", color="C3", zorder=4, label="trial 0 (defaults)")
    if failed:
        low = min((t["value"] for t in done), default=1.0)
        ax.scatter(failed, [low] * len(failed), marker="x", color="grey", label="invalid / diverged")
    values = [t["value"] for t in done]
    if values and objective != "passkey" and min(values) > 0 and max(values) / min(values) > 1.5:
        ax.set_yscale("log")  # a few bad trials would flatten the good ones on a linear axis
        ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 1.5, 2.0, 3.0, 4.0, 5.0, 6.0, 8.0)))
        ax.yaxis.set_major_formatter(ScalarFormatter())
        ax.yaxis.set_minor_formatter(NullFormatter())
    else:
        ax.ticklabel_format(axis="y", useOffset=False)
    ax.set_xlabel("trial")
    ax.set_ylabel(
        {
            "ppl": "calibration perplexity",
            "passkey": "passkey error rate",
            "ppl+passkey": "perplexity x 2^(1 - passkey accuracy)",
            "needle-ppl": "mean NLL of the passkey answers",
            "ppl+needle-ppl": "ln(perplexity) + answer NLL",
        }[objective]
        + " (lower is better)"
    )
    ax.set_title(title, fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, path)


def plot_factors(curves: dict[str, list[float]], path: Path, title: str) -> None:
    """Per-pair factors θ_i/θ'_i (1 = kept, s = interpolated like PI), one line per curve."""
    fig = new_figure(figsize=(7.5, 4.2))
    ax = fig.subplots()
    for (label, factors), style in zip(curves.items(), ("--", ":", "-", "-.")):
        ax.plot(range(len(factors)), factors, style, marker="." if style == "-" else None, label=label)
    ax.set_yscale("log")
    ax.set_xlabel("pair i (fast -> slow)")
    ax.set_ylabel("factor θ_i / θ'_i")
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, path)
