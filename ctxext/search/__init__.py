"""`ctxext search`: a method's best parameters on the user's own model, by its perplexity at the target length.

The workflow: `run_search(SearchRequest(...)) -> SearchResult` (what `ctxext search` runs).

- `plan`      the request (typed options) and its plan: every check before a model loads; search.json's settings
- `workflow`  one search end to end: the study, the trials (with `workers` processes), held-out, checkpoint, results
- `store`     the trials as an Optuna study in an Optuna storage (journal file, SQLite, a server database): resume,
              several processes or machines on one study, trials.jsonl exported from it
- `loop`      TPE (Optuna) over scalar ranges and CMA-ES (pycma) over LongRoPE's per-pair factors, slot by slot
- `space`     the ranges searched: declared next to each parameter (`param(..., search=(low, high, ...))`) or a YAML
- `longrope`  the starting curve and the monotone knot parametrisation of LongRoPE's factors
- `objective` calibration perplexity, passkey accuracy, or both; the held-out re-scoring
- `output`    the output directory a search resumes from: search.json's settings, results.json, the plots

Importing this package is cheap; Optuna and cma (the `search` extra) are imported only when a search runs.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "SearchRequest": "plan",
    "LongropeOptions": "plan",
    "plan_search": "plan",
    "SearchResult": "workflow",
    "run_search": "workflow",
    "TrialStore": "store",
    "read_trials": "store",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
