"""`ctxext eval` as a library call: `evaluate_perplexity(PerplexityRequest(...))` -> `PerplexityResult`.

The request says what to compute (model, data, lengths, stride, methods, runtime) and where to write it; the
result carries its rows, its table and its protocol (the way lm-eval's results carry their config). Every
(method, length) cell is cached as soon as it is done (ctxext.outputs.CellCache): after a failure the finished
cells are written to the output directory with the error, and the same request resumes from the cache,
computing only what is missing.
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import CtxextError, first_line
from ..outputs import (
    CellCache,
    atomic_output_dir,
    atomic_write_text,
    check_output_dir,
    provenance,
    write_json,
    written_by_ctxext,
)
from ..run_options import DataOptions, Invocation, RuntimeOptions
from .options import DEFAULT_LENGTHS, parse_lengths
from .report import perplexity_table, plot_perplexity, trained_context_in, write_csv
from .rows import MethodSelection
from .runner import iter_scores, plan_lengths
from .session import EvalSession

SHORT_DOCS = ("skip", "truncate")
CSV_COLUMNS = [
    "method",
    "length",
    "stride",
    "perplexity",
    "mean_nll",
    "nll_sum",
    "tokens_scored",
    "windows",
    "documents",
    "documents_skipped",
    "seconds",
    "tokens_sha256",
]


@dataclass
class PerplexityRequest:
    """What `ctxext eval` computes. `stride` None: one pass per document. `cache_dir` None: the cells are kept
    beside the output (`.<output>.cells`, removed once the output is complete); `use_cache` False: none kept."""

    model: str
    data: DataOptions
    lengths: list[int] = field(default_factory=lambda: parse_lengths(DEFAULT_LENGTHS))
    stride: int | None = 256
    short_docs: str = "skip"
    methods: MethodSelection = field(default_factory=MethodSelection)
    runtime: RuntimeOptions = field(default_factory=RuntimeOptions)
    output: str | None = None
    overwrite: bool = False
    cache_dir: str | None = None
    use_cache: bool = True
    invocation: Invocation = field(default_factory=Invocation)

    def check(self) -> list[str]:
        """Validate what can be validated before any model loads; the inputs the output must not overlap."""
        if self.short_docs not in SHORT_DOCS:
            raise CtxextError(f"--short-docs must be one of {', '.join(SHORT_DOCS)}, got {self.short_docs!r}")
        if not self.lengths:
            raise CtxextError("give at least one length")
        self.methods.mappings()  # bad method flags fail before anything is loaded
        protected = ([self.model] if Path(self.model).exists() else []) + self.data.local_paths()
        if self.output is not None:
            check_output_dir(self.output, protected, self.overwrite or incomplete_output(self.output))
        return protected

    def cell_folder(self) -> Path | None:
        if not self.use_cache:
            return None
        if self.cache_dir is not None:
            return Path(self.cache_dir).expanduser()
        if self.output is None:
            return None
        output = Path(self.output).expanduser().resolve()
        return output.parent / f".{output.name}.cells"


@dataclass
class PerplexityResult:
    """The rows (one per method and length), the labels in order, the table, and results.json's payload (with
    its protocol). `error` is set when a cell failed: the rows are then the cells finished before it."""

    payload: dict
    rows: list[dict]
    labels: list[str]
    table: str
    skipped: dict
    error: str | None = None
    cells_computed: int = 0
    cells_cached: int = 0
    main_process: bool = True  # False on the other processes of an `accelerate launch` (they write nothing)

    @property
    def protocol(self) -> dict:
        return self.payload["protocol"]

    @property
    def complete(self) -> bool:
        return self.error is None


def incomplete_output(output: str | Path) -> bool:
    """Whether `output` holds the results of an eval that failed part-way (which the same command resumes)."""
    results = Path(output).expanduser() / "results.json"
    if not results.is_file() or not written_by_ctxext(results.parent):
        return False
    try:
        return json.loads(results.read_text()).get("complete") is False
    except (OSError, ValueError):
        return False


def perplexity_protocol(stride: int | None, plans: list, short_docs: str, bos: dict) -> dict:
    return {
        "name": "sliding-window perplexity (Press et al.; HF docs 'Perplexity of fixed-length models'); "
        "ctxext docs/METHODS.md 'Perplexity protocol'",
        "mode": "truncate: one pass per document over its first window" if stride is None else "sliding window",
        "stride": "window" if stride is None else stride,
        "stride_per_length": {str(p.length): p.stride for p in plans},
        "stride_rule": "a window not longer than the stride slides by half its length (ctxext.eval.perplexity."
        "stride_at)",
        "scoring": "each token is scored once; tokens scored by an earlier window get label -100",
        "averaging": "token-weighted: exp(sum of NLL / tokens scored) over all documents",
        "documents": "evaluated separately",
        "short_documents": short_docs,
        "bos": bos,
    }


def mode_line(stride: int | None, plans: list) -> str:
    """'sliding window, stride 256 (128 at 256: ...)' or one pass per document, for the first printed line."""
    mode = "one pass per document (stride = window)" if stride is None else f"sliding window, stride {stride}"
    halved = [f"{p.stride} at {p.length}" for p in plans if stride is not None and p.stride != stride]
    if halved:
        mode += f" ({', '.join(halved)}: half of a window not longer than the stride)"
    return mode


def evaluate_perplexity(request: PerplexityRequest, log=None) -> PerplexityResult:
    """Sliding-window perplexity of every method at every length, on the same tokens; `log(line)` is told
    what runs. Writes request.output (when given) on the main process, also after a failure that leaves
    finished cells (then with the error, and the error is raised again)."""
    started = time.perf_counter()
    protected = request.check()
    session = EvalSession.open(request.model, request.methods, request.runtime)
    docs = request.data.load(session.tokenizer)
    plans = plan_lengths(docs.documents, request.lengths, request.stride, session.bos_id, request.short_docs)
    if session.processes.is_main and log is not None:
        log(
            f"ctxext eval: {len(docs.documents)} documents ({sum(len(d) for d in docs.documents)} tokens), "
            f"{mode_line(request.stride, plans)}, {len(session.methods)} methods x {len(request.lengths)} lengths; "
            f"{session.runtime_line()}"
        )
        for line in session.beyond_training_notes(request.lengths):
            log(line)
    scores, error = _score_all(request, session, docs.documents, plans)
    result = _result(request, session, docs, plans, scores, error, started)
    if session.processes.is_main and request.output is not None and (scores or error is None):
        write_perplexity_outputs(result, request, protected, Path(request.model).name, docs.source)
    if error is not None:
        raise error
    return result


def _score_all(request: PerplexityRequest, session, documents, plans) -> tuple[list, BaseException | None]:
    """Every cell's Score, in order, and the error that stopped them (None when all finished)."""
    folder = request.cell_folder()
    cells = None if folder is None else CellCache(folder, session.cell_context(request.short_docs))
    total = sum(w.length for p in plans for w in p.windows[session.processes.rank :: session.processes.world_size])
    progress = session.progress(total * len(session.methods), "tok")
    scores = []
    try:
        for score in iter_scores(
            session.model, documents, plans, session.methods, session.bos_id, session.processes, progress, cells
        ):
            scores.append(score)
    except (Exception, KeyboardInterrupt) as error:  # noqa: BLE001  (re-raised by the caller once saved)
        return scores, error
    finally:
        if progress is not None:
            progress.close()
    return scores, None


def _result(request, session, docs, plans, scores, error, started) -> PerplexityResult:
    rows = [s.to_dict() for s in scores]
    labels = [m.label for m in session.methods]
    done = {(r["method"], r["length"]) for r in rows}
    missing = [f"{label} @ {n}" for label in labels for n in request.lengths if (label, n) not in done]
    payload = {
        "command": request.invocation.command,
        "arguments": request.invocation.arguments,
        "model": session.description(),
        "protocol": perplexity_protocol(request.stride, plans, request.short_docs, session.bos_info),
        "dataset": docs.describe(),
        "methods": [m.record(session.model) for m in session.methods],
        "notes": session.beyond_training_notes(request.lengths),
        "lengths": request.lengths,
        "results": rows,
        "complete": error is None,
        "error": None if error is None else f"{type(error).__name__}: {first_line(error)}",
        "missing_cells": missing,
        "runtime": {
            "processes": session.processes.launched,  # under --tp N: the N processes that hold the model together
            "tensor_parallel": session.processes.tp,
            "seconds": time.perf_counter() - started,
            "cells_computed": sum(not s.cached for s in scores),
            "cells_cached": sum(s.cached for s in scores),
            "cell_cache": str(request.cell_folder()) if request.cell_folder() else None,
        },
        "environment": provenance(),
    }
    return PerplexityResult(
        payload=payload,
        rows=rows,
        labels=labels,
        table=perplexity_table(rows, labels, request.lengths) if rows else "(no cell finished)",
        skipped={n: p.skipped for n, p in zip(request.lengths, plans) if p.skipped},
        error=payload["error"],
        cells_computed=payload["runtime"]["cells_computed"],
        cells_cached=payload["runtime"]["cells_cached"],
        main_process=session.processes.is_main,
    )


def write_perplexity_outputs(result: PerplexityResult, request, protected, model_name: str, source: dict) -> None:
    """results.json, results.csv, table.txt and perplexity.png, in one directory written whole; the cells
    kept beside the output are removed once it is complete (a --cache-dir is kept)."""
    overwrite = request.overwrite or incomplete_output(request.output)
    stride = request.stride
    with atomic_output_dir(request.output, protected, overwrite) as staging:
        write_json(staging / "results.json", result.payload, allow_nan=True)
        write_csv(staging / "results.csv", result.rows, CSV_COLUMNS)
        atomic_write_text(staging / "table.txt", result.table + "\n")
        if result.rows:
            plot_perplexity(
                result.rows,
                result.labels,
                staging / "perplexity.png",
                f"{model_name}, {source.get('name') or source.get('kind')}\n"
                f"{'one pass per document (stride = window)' if stride is None else f'stride {stride}'}, "
                f"{result.payload['model']['dtype']}",
                trained_context_in(result.payload["model"]),
            )
    if result.complete and request.use_cache and request.cache_dir is None and request.cell_folder() is not None:
        shutil.rmtree(request.cell_folder(), ignore_errors=True)
