"""Evaluation: sliding-window perplexity (docs/METHODS.md protocol), passkey retrieval, data loading, reports.

The workflows: `evaluate_perplexity(PerplexityRequest(...))` (what `ctxext eval` runs) and
`evaluate_passkey(PasskeyRequest(...))` (`ctxext passkey`); their method rows come from `ctxext.eval.rows`.
Importing this package is cheap (no torch); the names below are imported on first use.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "Window": "perplexity",
    "perplexity": "perplexity",
    "plan_windows": "perplexity",
    "sliding_window_nll": "perplexity",
    "window_nll": "perplexity",
    "EvalMethod": "rows",
    "MethodSelection": "rows",
    "method_rows": "rows",
    # the options every workflow shares live in ctxext.run_options (a leading dot: relative to ctxext)
    "DataOptions": ".run_options",
    "RuntimeOptions": ".run_options",
    "Invocation": ".run_options",
    "PerplexityRequest": "workflow",
    "PerplexityResult": "workflow",
    "evaluate_perplexity": "workflow",
    "PasskeyRequest": "passkey_workflow",
    "PasskeyResult": "passkey_workflow",
    "evaluate_passkey": "passkey_workflow",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'ctxext.eval' has no attribute '{name}'")
    return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
