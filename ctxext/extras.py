"""The optional extras (pyproject's [project.optional-dependencies]) and the one-line error when one is missing.

A command checks the extras it will need before it loads a model or computes anything, so a missing package is
reported at once, with the install line, never after an hour of cells.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from .errors import CtxextError


@dataclass(frozen=True)
class Extra:
    modules: tuple[str, ...]  # what is imported
    install: str  # the line that installs them


EXTRAS = {
    "search": Extra(("optuna", "cma"), "pip install 'ctxext[search]' (or pip install optuna cma)"),
    "tasks": Extra(("lm_eval",), "pip install 'ctxext[tasks]' (lm-evaluation-harness)"),
    "serve": Extra(("fastapi", "uvicorn", "pydantic", "openai"), "pip install 'ctxext[serve]'"),
    "deepspeed": Extra(
        ("deepspeed",),
        "pip install 'ctxext[deepspeed]' (DeepSpeed builds a C++ op at its first run, so it needs a compiler)",
    ),
    "llamacpp": Extra(
        ("llama_cpp",),
        "pip install 'ctxext[llamacpp]' (llama-cpp-python; it builds llama.cpp from source with cmake and a "
        "C++ compiler, about 10 minutes on 2 cores)",
    ),
}


def missing_modules(extra: str) -> list[str]:
    """The modules of `extra` that cannot be imported here."""
    missing = []
    for module in EXTRAS[extra].modules:
        try:
            importlib.import_module(module)
        except ImportError:
            missing.append(module)
    return missing


def require(extra: str, needed_by: str) -> None:
    """A one-line CtxextError naming what `needed_by` needs and how to install it, unless `extra` is installed."""
    missing = missing_modules(extra)
    if missing:
        raise CtxextError(f"{needed_by} needs {', '.join(missing)}, not installed: {EXTRAS[extra].install}")
