"""--tasks: lm-eval tasks (RULER's needle tasks, or any task lm-eval knows) for every row at every length, through
the cells of `ctxext tasks` (`ctxext.tasks.harness`: lm_eval.simple_evaluate on HFLM over the patched model, the
length in the task's metadata, each cell cached as soon as it is done). A row runs with its configuration at that
length, so a searched row runs with what its search found there. The cells are kept in CACHE/tasks: the same
command resumes, and --report-only reads them. lm-eval (the `tasks` extra) is imported only where a cell runs."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from ..errors import CtxextError
from ..eval.rows import mapping_row, shipped_record
from ..eval.session import tokenizer_identity
from ..runtime import Processes
from ..tasks.harness import (
    INSTALL_HINT,
    TaskCellCache,
    TaskManagers,
    cell_scores,
    check_lengths,
    import_lm_eval,
    plan_cells,
    resolve_tasks,
    run_cells,
)
from ..tasks.workflow import parse_task_names

TASKS_DIR = "tasks"  # under the cache folder, beside cells/ and searches/
BATCH_SIZE = 1


def check_tasks(names: list[str], lengths: list[int]) -> list:
    """The TaskSpecs of --tasks, checked before any weights load: lm-eval installed, every name known to it, and
    lengths its data builders take (RULER: 1024 tokens or more)."""
    names = parse_task_names(",".join(names))
    try:
        import_lm_eval()
    except CtxextError:
        raise CtxextError(
            f"--tasks needs lm-evaluation-harness, which is not installed; install it with: {INSTALL_HINT}"
        ) from None
    specs = resolve_tasks(names, TaskManagers(names).any())
    check_lengths(specs, sorted(lengths))
    return specs


def tokenizer_name(model: str) -> str:
    """What RULER's data builder loads the tokenizer from: a local checkpoint by its absolute path."""
    return str(Path(model).resolve()) if Path(model).exists() else model


def row_method(label: str, config: dict, model_config):
    """The row's configuration at one length as the EvalMethod the task cells patch in, under the row's label."""
    return dataclasses.replace(mapping_row(config, shipped_record(model_config)), label=label)


def common_key(plan, lm_eval_version: str) -> dict:
    """What every task cell of this compare depends on besides its row's configuration, task and length."""
    device = plan.runtime["device"]
    return {
        "model": plan.fingerprint,
        "tokenizer": tokenizer_identity(plan.request.model),
        "dtype": plan.dtype_label,
        "device": getattr(device, "type", str(device)),
        "attn_implementation": plan.runtime["attn_implementation"],
        "limit": plan.request.task_limit,
        "batch_size": BATCH_SIZE,
        "apply_chat_template": False,
        "lm_eval": lm_eval_version,
    }


def row_cells(plan, rows, skip: dict) -> list[tuple[str, int, list]]:
    """(label, length, the harness cells) for every row with a configuration at a length, rows in `skip` left out."""
    planned = []
    for row in rows:
        for length in plan.lengths:
            config = row.configs.get(length)
            if config is None or row.label in skip:
                continue
            method = row_method(row.label, config, plan.model_config)
            planned.append((row.label, length, plan_cells([method], plan.task_specs, [length])))
    return planned


def run_task_cells(plan, rows, model_loader, compute: bool, measured, log) -> None:
    """Find (and, when `compute`, run) every row's task cells at every length into `measured.tasks[(label,
    length)]` (score rows: task, metric, value, samples); a cell not found is listed in `measured.missing`. The model
    is loaded only when a cell has to run."""
    import lm_eval  # noqa: PLC0415 -- optional: tasks

    cache = TaskCellCache(plan.request.cache_dir / TASKS_DIR)
    managers, processes = TaskManagers([spec.name for spec in plan.task_specs]), Processes()
    key = common_key(plan, lm_eval.__version__)

    def run(cells, length, model, cached_only):
        run_cells(cells, model, plan.tokenizer, managers, cache, lengths=[length],
                  tokenizer_name=tokenizer_name(plan.request.model), common_key=key, limit=plan.request.task_limit,
                  batch_size=BATCH_SIZE, apply_chat_template=False, processes=processes, cached_only=cached_only,
                  quiet=True, log=lambda line: None)  # fmt: skip

    for label, length, cells in row_cells(plan, rows, measured.failed):
        run(cells, length, None, cached_only=True)
        if compute and any(cell.result is None for cell in cells):
            run(cells, length, model_loader(), cached_only=False)
        for cell in cells:
            if cell.result is None:
                measured.missing.append(f"task: {label} {cell.task.name} at {length}")
                continue
            if not cell.cached:
                log(f"  task {cell.task.name}: {label} @ {length} ({cell.result['seconds']:.1f} s)")
            scores = [{**s, "length": length} for s in cell_scores(cell)]
            measured.tasks.setdefault((label, length), []).extend(scores)
