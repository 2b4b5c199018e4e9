"""`ctxext tasks` as a library call: `run_tasks(TasksRequest(...))` -> `TasksResult`, whose payload (results.json)
carries its protocol. Each (method, task, length) cell is cached as soon as it is done (ctxext.tasks.harness)."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..assets import cache_dir
from ..errors import CtxextError
from ..eval.report import write_csv
from ..eval.rows import MethodSelection
from ..eval.session import EvalSession, model_identity, tokenizer_identity
from ..loading import check_model_source
from ..outputs import atomic_output_dir, atomic_write_text, check_output_dir, provenance, write_json
from ..run_options import Invocation, RuntimeOptions
from ..runtime import Processes, cpu_processes, on_main_first
from .harness import (
    TaskCellCache,
    TaskManagers,
    cell_scores,
    check_lengths,
    check_task_data,
    import_lm_eval,
    jsonable,
    plan_cells,
    resolve_tasks,
    run_cells,
    task_lengths,
    task_metadata,
)
from .report import CSV_COLUMNS, EFFECTIVE_RULE, effective_lengths, plot_task_heatmap, score_tables


def parse_task_names(text: str) -> list[str]:
    names = [n.strip() for n in str(text).split(",") if n.strip()]
    if not names:
        raise CtxextError("--tasks needs at least one lm-eval task name, e.g. niah_single_1")
    return list(dict.fromkeys(names))


def parse_batch_size(text: str | int) -> int | str:
    """A positive integer, or lm-eval's 'auto' (also 'auto:N')."""
    if str(text).startswith("auto"):
        return str(text)
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise CtxextError(f"--batch-size must be a positive integer or 'auto', got '{text}'")
    return value


@dataclass
class TasksRequest:
    """What `ctxext tasks` runs. `cache_dir` None: $CTXEXT_CACHE_DIR/tasks; `use_cache` False: no cache;
    `cached_only`: run nothing, report the cells already cached."""

    model: str
    tasks: list[str]
    lengths: list[int] = field(default_factory=lambda: [4096])
    limit: int | None = None
    batch_size: int | str = 1
    apply_chat_template: bool = False
    methods: MethodSelection = field(default_factory=MethodSelection)
    runtime: RuntimeOptions = field(default_factory=RuntimeOptions)
    output: str | None = None
    overwrite: bool = False
    cache_dir: str | None = None
    use_cache: bool = True
    cached_only: bool = False
    invocation: Invocation = field(default_factory=Invocation)

    def check(self) -> list[str]:
        """Validate what can be validated before lm-eval's index or any model loads; the protected inputs."""
        if self.limit is not None and self.limit < 1:
            raise CtxextError(f"--limit must be at least 1, got {self.limit}")
        if not self.use_cache and self.cached_only:
            raise CtxextError("--cached-only reads the cache; it cannot go with --no-cache")
        parse_batch_size(self.batch_size)
        self.methods.mappings()  # bad method flags fail before anything is loaded
        protected = [self.model] if Path(self.model).exists() else []
        if self.output is not None:
            check_output_dir(self.output, protected, self.overwrite)
        return protected

    def cell_folder(self) -> Path | None:
        if not self.use_cache:
            return None
        return Path(self.cache_dir).expanduser() if self.cache_dir else cache_dir() / "tasks"

    @property
    def tokenizer_name(self) -> str:
        return str(Path(self.model).resolve()) if Path(self.model).exists() else self.model


@dataclass
class TasksResult:
    payload: dict
    rows: list[dict]
    labels: list[str]
    table: str
    effective: list[dict]
    missing: list[str]
    main_process: bool = True

    @property
    def protocol(self) -> dict:
        return self.payload["protocol"]


def tasks_protocol(request: TasksRequest, specs: list) -> dict:
    return {
        "name": "lm-evaluation-harness tasks through lm_eval.simple_evaluate on HFLM, one call per "
        "(method, task, length)",
        "tasks": [{"name": s.name, "length_convention": s.convention} for s in specs],
        "lengths": request.lengths,
        "limit": request.limit,
        "batch_size": parse_batch_size(request.batch_size),
        "apply_chat_template": request.apply_chat_template,
        "max_length": "the cell's length (tasks without lengths: the longest) + 256, HFLM's max_length",
        "seeds": "simple_evaluate's defaults (python 0, numpy 1234, torch 1234, fewshot 1234), set before "
        "each task is built, so every method sees the same prompts; each cell's config has them",
        "tokenizer": request.tokenizer_name,
    }


def _prepare_tasks(request: TasksRequest, processes):
    """(lm_eval, TaskManagers, task specs): the names resolved and, unless cached_only, each task's data built
    once, so that what cannot be fetched fails before the model loads."""
    lm_eval = import_lm_eval()
    check_model_source(request.model)  # before the task data: RULER sizes its prompts with the model's tokenizer
    managers = TaskManagers(request.tasks)
    specs = resolve_tasks(request.tasks, managers.any())
    check_lengths(specs, request.lengths)

    def check_data():
        for spec in specs:
            length = task_lengths(spec, request.lengths)[0]
            check_task_data(spec, managers.get(task_metadata(spec, length, request.tokenizer_name)), length)

    if not request.cached_only:
        on_main_first(processes, check_data)
    return lm_eval, managers, specs


def run_tasks(request: TasksRequest, log=None) -> TasksResult:
    """Every (method, task, length) cell through lm-eval, each cached when done; writes request.output (when
    given) on the main process. `log(line)` is told what runs and each finished cell."""
    started = time.perf_counter()
    protected = request.check()
    processes = Processes(cpu=cpu_processes(request.runtime.device), tp=request.runtime.tp)
    lm_eval, managers, specs = _prepare_tasks(request, processes)
    session = EvalSession.open(request.model, request.methods, request.runtime, processes)
    cells = plan_cells(session.methods, specs, request.lengths)
    cache = TaskCellCache(request.cell_folder())
    if session.processes.is_main and log is not None:
        log(
            f"ctxext tasks: {', '.join(s.name for s in specs)} x {len(session.methods)} methods x lengths "
            f"{', '.join(str(n) for n in request.lengths)} = {len(cells)} cells, "
            f"{'all' if request.limit is None else request.limit} samples each; lm-eval {lm_eval.__version__}; "
            f"{session.runtime_line()}"
        )
        for line in session.beyond_training_notes(request.lengths):
            log(line)
    try:
        run_cells(
            cells,
            session.model,
            session.tokenizer,
            managers,
            cache,
            lengths=request.lengths,
            tokenizer_name=request.tokenizer_name,
            common_key=_common_key(request, session, lm_eval.__version__),
            limit=request.limit,
            batch_size=parse_batch_size(request.batch_size),
            apply_chat_template=request.apply_chat_template,
            processes=session.processes,
            cached_only=request.cached_only,
            quiet=not request.runtime.progress,
            log=log or (lambda line: None),
        )
    except KeyboardInterrupt:
        if session.processes.is_main and cache.folder is not None:
            done = sum(c.result is not None for c in cells)
            print(
                f"ctxext tasks: {done} of {len(cells)} cells are cached in {cache.folder}; the same command "
                f"resumes from there",
                file=sys.stderr,
            )
        raise
    result = _result(request, session, specs, cells, cache, lm_eval.__version__, started)
    if session.processes.is_main and request.output is not None:
        write_tasks_outputs(result, request, protected)
    return result


def _common_key(request: TasksRequest, session, lm_eval_version: str) -> dict:
    """What every cell depends on besides its method, task and length (the names of the cached cells)."""
    return {  # by content, not path or file times: a cache copied to another checkout or machine resumes there
        "model": model_identity(request.model, session.model),
        "tokenizer": tokenizer_identity(request.model),
        "dtype": str(session.runtime["dtype"]).removeprefix("torch."),
        "device": session.runtime["device"].type,
        "attn_implementation": session.runtime["attn_implementation"],
        "limit": request.limit,
        "batch_size": parse_batch_size(request.batch_size),
        "apply_chat_template": request.apply_chat_template,
        "lm_eval": lm_eval_version,
    }


def _result(request, session, specs, cells, cache, lm_eval_version, started) -> TasksResult:
    rows = [row for cell in cells for row in cell_scores(cell)]
    labels = [m.label for m in session.methods]
    effective = effective_lengths(rows, labels)
    payload = {
        "command": request.invocation.command,
        "arguments": request.invocation.arguments,
        "model": session.description(),
        "protocol": tasks_protocol(request, specs),
        "methods": [m.record(session.model) for m in session.methods],
        "notes": session.beyond_training_notes(request.lengths),
        "scores": rows,
        "effective_length": {"rule": EFFECTIVE_RULE, "panels": effective},
        "missing_cells": [c.name for c in cells if c.result is None],
        "cells": [_cell_record(c, cache) for c in cells],
        "runtime": {
            "processes": session.processes.launched,  # under --tp N: the N processes that hold the model together
            "tensor_parallel": session.processes.tp,
            "seconds": time.perf_counter() - started,
            "cells_run": sum(c.result is not None and not c.cached for c in cells),
            "cells_cached": sum(c.cached for c in cells),
        },
        "environment": {**provenance(), "lm_eval": lm_eval_version},
    }
    table = score_tables(rows, labels, request.lengths) if rows else "(no cell has a result yet)"
    missing = payload["missing_cells"]
    return TasksResult(payload, rows, labels, table, effective, missing, session.processes.is_main)


def _cell_record(cell, cache) -> dict:
    return {
        "method": cell.method.label,
        "task": cell.task.name,
        "length": cell.length,
        "cached": cell.cached,
        "cache_file": str(cache.path(cell.key)) if cache.folder is not None else None,
        "lm_eval": cell.result,
    }


def write_tasks_outputs(result: TasksResult, request: TasksRequest, protected: list[str]) -> None:
    with atomic_output_dir(request.output, protected, request.overwrite) as staging:
        write_json(staging / "results.json", result.payload, default=jsonable, allow_nan=True)
        write_csv(staging / "results.csv", result.rows, CSV_COLUMNS)
        atomic_write_text(staging / "table.txt", result.table + "\n")
        if result.rows:
            limit = "all" if request.limit is None else request.limit
            title = f"{Path(request.model).name}: lm-eval tasks, {limit} samples per cell"
            plot_task_heatmap(result.rows, result.labels, staging / "tasks.png", title)
