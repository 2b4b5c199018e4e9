"""What `ctxext compare` is asked (typed options, no argparse), and the option parsers it needs: budgets and the
method selection (names and presets)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import CtxextError, did_you_mean
from ..methods import METHODS
from ..run_options import DataOptions, RuntimeOptions

DEFAULT_OBJECTIVE = "ppl+needle-ppl"  # keeps retrieval: a perplexity search alone can cost the needle
DEFAULT_TRIALS = 8  # trials of the last rung of successive halving, without --budget
BUDGET_TRIALS_CAP = 32  # under --budget without --trials: the most trials one search is given
PASSKEY_DEPTHS = (0.1, 0.5, 0.9)
MAX_PASSKEY_TRIALS = 12  # the decide stage: passkey trials a length for the rows tied with a recommendation
PRESETS = {
    "all": "every method that applies to this model (the default)",
    "training-free": "every method that needs no fine-tuning (all but linear: Position Interpolation fine-tunes)",
    "servable:vllm": "methods whose checkpoint vLLM serves exactly at these lengths",
    "servable:sglang": "methods whose checkpoint SGLang serves exactly at these lengths",
    "servable:llama.cpp": "methods whose GGUF llama.cpp serves exactly at these lengths",
}
NEEDS_FINE_TUNING = {"linear": "Position Interpolation is meant to be fine-tuned (Chen et al. 2023)"}
WRITE_TARGETS = ("ctxext", "vllm", "sglang")  # --write-best TARGET:DIR (llama.cpp reads a GGUF: see the report)
OBJECTIVES = ("ppl", "passkey", "ppl+passkey", "needle-ppl", "ppl+needle-ppl")


@dataclass(frozen=True)
class FullSearch:
    """One kind of searched row under a fixed protocol (no screen, no halving): each method of `methods` (None:
    every searchable one) except those of `skip`, searched in full to `trials` trials with `objective`."""

    objective: str
    trials: int
    methods: tuple[str, ...] | None = None
    skip: tuple[str, ...] = ()

    def covers(self, method: str) -> bool:
        return method not in self.skip and (self.methods is None or method in self.methods)


@dataclass
class CompareRequest:
    """What `ctxext compare` is asked: the model, the lengths past its L, the data and its split, the methods, how
    much searching (--trials / --budget, the objective), where the cells are kept, and what to write."""

    model: str
    lengths: list[int]
    output: str | Path | None  # None: only --page is written (then --cache is required)
    data: DataOptions = field(default_factory=DataOptions)
    methods: list[str] | None = None  # names and presets; None: every method that applies to the model
    calibration: list[str] | None = None  # document names (searches only); None: the first calibration_docs
    held_out: list[str] | None = None  # document names (the table only); None: the next held_out_docs
    calibration_docs: int = 1
    held_out_docs: int = 3
    objective: str = DEFAULT_OBJECTIVE
    trials: int | None = None  # trials of the last rung (None: DEFAULT_TRIALS, or what --budget allows)
    budget: float | None = None  # seconds of computation for the whole compare (None: no limit)
    search: bool = True  # False: the defaults only (no screen, no searches)
    passkey_depths: list[float] = field(default_factory=lambda: list(PASSKEY_DEPTHS))
    passkey_trials: int = 1  # keys per depth and length
    max_passkey_trials: int = MAX_PASSKEY_TRIALS  # the decide stage's cap a length (at most the table's: none added)
    cache: str | Path | None = None  # where cells/ and searches/ are kept (None: OUTPUT)
    storage: str | None = None  # one Optuna storage for every search (None: each search's own journal)
    write_best: str | None = None  # [TARGET:]DIR, TARGET one of WRITE_TARGETS (default ctxext)
    report_only: bool = False  # compute nothing: the report from the cells and searches already kept
    runtime: RuntimeOptions = field(default_factory=RuntimeOptions)
    full_searches: list[FullSearch] | None = None  # a fixed protocol instead of the screen and successive halving
    passkey_lengths: list[int] | None = None  # None: L (the unpatched model only) and every length
    page: str | Path | None = None  # also write the one-page layout (PAGE, its .json and .png) of docs/comparison.md
    page_notes: str | Path | None = None  # markdown shown under the page's table as 'Notes on rows'
    model_name: str | None = None  # how the report names the model (None: the checkpoint's folder name)
    tasks: list[str] | None = None  # lm-eval tasks run per row and length (RULER: niah_single_1, ...); needs lm-eval
    task_limit: int | None = None  # samples per task cell (lm-eval's --limit: the first N; None: all of them)

    @property
    def cache_dir(self) -> Path:
        return Path(self.cache if self.cache is not None else self.output).expanduser()

    @property
    def display_name(self) -> str:
        return self.model_name or Path(str(self.model).rstrip("/")).name


# ------------------------------------------------------------------------------------------- parsing
_BUDGET = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|sec|m|min|h|hr|d)?\s*$", re.IGNORECASE)
_UNIT_SECONDS = {"ms": 0.001, "s": 1, "sec": 1, "m": 60, "min": 60, "h": 3600, "hr": 3600, "d": 86400}


def parse_budget(text: str) -> float:
    """'2h', '90m', '45s', '1.5h' (or a number of seconds) -> seconds (> 0)."""
    match = _BUDGET.match(str(text))
    if match is None:
        raise CtxextError(f"--budget must be a time such as 2h, 90m or 600s, got '{text}'")
    seconds = float(match[1]) * _UNIT_SECONDS[(match[2] or "s").lower()]
    if seconds <= 0:
        raise CtxextError(f"--budget must be more than no time, got '{text}'")
    return seconds


def format_seconds(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.0f} s" if seconds >= 1 else f"{seconds:.2g} s"
    if seconds < 3600:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def parse_methods(text: str | list[str] | None) -> list[str] | None:
    """'yarn,ntk' or ['training-free'] -> the names and presets, each checked (one-line error for an unknown one)."""
    if text is None:
        return None
    parts = [p.strip() for item in ([text] if isinstance(text, str) else text) for p in str(item).split(",")]
    parts = [p for p in parts if p]
    if not parts:
        raise CtxextError("--methods is empty; give method names or a preset (" + ", ".join(PRESETS) + ")")
    for part in parts:
        check_method_or_preset(part)
    return list(dict.fromkeys(parts))


def check_method_or_preset(name: str) -> str:
    if name in METHODS or name in PRESETS:
        return name
    known = [*METHODS, *PRESETS]
    raise CtxextError(
        f"unknown method or preset '{name}'{did_you_mean(name, known)}; methods: {', '.join(METHODS)}; "
        f"presets: {', '.join(PRESETS)}"
    )


def needed_extras(request: CompareRequest) -> list[tuple[str, str]]:
    """(extra, what needs it) for every optional package `request` will use, checked before anything loads."""
    needed = []
    if request.search and not request.report_only:
        needed.append(("search", "ctxext compare's searched rows (--no-search: the defaults only)"))
    if request.tasks and not request.report_only:
        needed.append(("tasks", "ctxext compare --tasks"))
    return needed


def parse_full_search(text: str) -> FullSearch:
    """'ppl:12' (every searchable method), 'ppl:12:-dpe' (all but dpe), 'needle-ppl:8:rerope,dpe' (those)."""
    objective, _, rest = str(text).partition(":")
    trials, _, names = rest.partition(":")
    if objective not in OBJECTIVES or not trials.isdigit() or int(trials) < 1:
        raise CtxextError(
            f"--full-search must be OBJECTIVE:TRIALS[:METHODS] (objective one of {', '.join(OBJECTIVES)}, trials at "
            f"least 1; METHODS comma-separated, '-name' to leave one out), got '{text}'"
        )
    parts = [p.strip() for p in names.split(",") if p.strip()]
    skip = tuple(check_method_or_preset(p[1:]) for p in parts if p.startswith("-"))
    chosen = tuple(check_method_or_preset(p) for p in parts if not p.startswith("-"))
    for name in (*skip, *chosen):
        if name in PRESETS:
            raise CtxextError(f"--full-search {text}: name methods, not presets ('{name}')")
    return FullSearch(objective, int(trials), chosen or None, skip)


def parse_write_best(text: str | None) -> tuple[str, Path] | None:
    """'DIR' or 'vllm:DIR' -> (target, DIR)."""
    if text is None:
        return None
    target, sep, folder = str(text).partition(":")
    if not sep or target not in (*WRITE_TARGETS, "llama.cpp"):
        return "ctxext", Path(text)
    if target == "llama.cpp":
        raise CtxextError(
            "--write-best llama.cpp: llama.cpp reads a GGUF, written from a GGUF: the report's llama.cpp row says "
            "how (convert_hf_to_gguf.py, then ctxext patch MODEL.gguf)"
        )
    if not folder:
        raise CtxextError(f"--write-best {text}: give a folder after '{target}:'")
    return target, Path(folder)
