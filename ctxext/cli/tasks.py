"""`ctxext tasks`: lm-evaluation-harness tasks (RULER, LongBench v2, babilong, any lm-eval task) under every
method, side by side."""

from __future__ import annotations

import argparse

from .common import add_method_arguments, add_runtime_arguments

HELP = "lm-evaluation-harness tasks (RULER, LongBench v2, babilong, ...) under several methods, side by side"
DESCRIPTION = (
    "Run lm-evaluation-harness tasks on MODEL patched in memory with each method ('none', plain RoPE, is always "
    "added): for every method, task and length, the model is wrapped in lm-eval's HFLM and "
    "lm_eval.simple_evaluate runs the task, with the length in the task's metadata (RULER: max_seq_lengths; "
    "babilong: its '4k' configs) and MODEL's tokenizer, so every method sees the same prompts. Tasks that take "
    "no length run once per method. Each (method, task, length) result is cached as soon as it is done "
    "(--cache-dir): an interrupted run resumes, and a table can grow over several runs. Writes table.txt, "
    "results.csv, results.json (lm-eval's own results per cell, verbatim, with the method parameters, versions, "
    'seeds and the limit) and a heat map tasks.png to --output. Needs lm-eval: pip install "ctxext[tasks]".'
)
EPILOG = (
    "example: ctxext tasks my-model --method yarn --method ntk --factor 2 --tasks niah_single_1,"
    "niah_multikey_2,ruler_vt --lengths 4k,8k,16k --limit 20 -o tasks-out"
)
DEFAULT_TASK_LENGTHS = "4096"


def add_arguments(parser) -> None:
    parser.add_argument("model", help="a local checkpoint directory or a hub id")
    parser.add_argument(
        "--tasks",
        required=True,
        metavar="NAME,NAME,...",
        help="lm-eval task, group or tag names, e.g. niah_single_1,niah_multikey_2,ruler_vt "
        "(RULER tasks that need no network: niah_single_1, niah_multikey_2, niah_multikey_3, "
        "ruler_vt, ruler_fwe, ruler_cwe)",
    )
    parser.add_argument(
        "--lengths",
        default=DEFAULT_TASK_LENGTHS,
        metavar="N,N,...",
        help=f"context lengths in tokens for the tasks that take one (RULER, babilong), e.g. "
        f"4k,8k,16k (default {DEFAULT_TASK_LENGTHS}); other tasks' prompts are cut by lm-eval "
        f"to the longest",
    )
    parser.add_argument(
        "--limit",
        type=int,
        default=None,
        metavar="N",
        help="samples per task and length (lm-eval's --limit: the first N; default all, 500 per length for RULER)",
    )
    parser.add_argument(
        "--batch-size", default="1", metavar="B", help="lm-eval's batch size: a number or 'auto' (default 1)"
    )
    parser.add_argument(
        "--apply-chat-template",
        action="store_true",
        help="wrap prompts in the tokenizer's chat template (lm-eval's --apply_chat_template)",
    )
    parser.add_argument("--no-baseline", action="store_true", help="do not add the 'none' (plain RoPE) baseline")
    parser.add_argument(
        "-o", "--output", required=True, help="directory for table.txt, results.json, results.csv, tasks.png"
    )
    parser.add_argument("--overwrite", action="store_true", help="replace --output if it already holds something")
    cache = parser.add_argument_group("cache of finished cells")
    cache.add_argument(
        "--cache-dir",
        metavar="DIR",
        help="where each (method, task, length) result is kept (default $CTXEXT_CACHE_DIR/tasks, "
        "i.e. ~/.cache/ctxext/tasks)",
    )
    cache.add_argument("--no-cache", action="store_true", help="neither read nor write cached cells")
    cache.add_argument(
        "--cached-only",
        action="store_true",
        help="run nothing: write the outputs from the cells already cached ('-' for the others)",
    )
    add_runtime_arguments(
        parser, bos=False, progress_help="no progress bars (lm-eval's included); one line per finished cell"
    )
    add_method_arguments(parser, multiple=True)
    parser.set_defaults(text_file=None, dataset=None)


def _task_names(text: str) -> list[str]:
    from ..errors import CtxextError

    names = [n.strip() for n in str(text).split(",") if n.strip()]
    if not names:
        raise CtxextError("--tasks needs at least one lm-eval task name, e.g. niah_single_1")
    return list(dict.fromkeys(names))


def _batch_size(text: str):
    from ..errors import CtxextError

    if str(text).startswith("auto"):
        return str(text)
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise CtxextError(f"--batch-size must be a positive integer or 'auto', got '{text}'")
    return value


def run(args: argparse.Namespace) -> int:
    import sys
    import time
    from pathlib import Path

    from ..errors import CtxextError
    from ..tasks.harness import import_lm_eval

    started = time.perf_counter()
    names = _task_names(args.tasks)
    from .common import method_mappings, parse_lengths

    lengths = parse_lengths(args.lengths)
    if args.limit is not None and args.limit < 1:
        raise CtxextError(f"--limit must be at least 1, got {args.limit}")
    batch_size = _batch_size(args.batch_size)
    if args.no_cache and args.cached_only:
        raise CtxextError("--cached-only reads the cache; it cannot go with --no-cache")
    method_mappings(args)  # bad method flags fail before anything is loaded
    lm_eval = import_lm_eval()

    from ..outputs import check_output_dir

    protected = [args.model] if Path(args.model).exists() else []
    check_output_dir(args.output, protected, args.overwrite)

    from ..assets import cache_dir
    from ..eval.report import environment, write_csv, write_json
    from ..eval.rows import method_rows
    from ..eval.setup import Invocation, load_model_and_tokenizer, model_description
    from ..loading import check_model_source
    from ..outputs import atomic_output_dir
    from ..runtime import Processes, cpu_processes, on_main_first
    from ..tasks.harness import (
        CellCache,
        TaskManagers,
        cell_scores,
        check_lengths,
        check_task_data,
        model_fingerprint,
        plan_cells,
        resolve_tasks,
        run_cells,
        task_lengths,
        task_metadata,
    )
    from ..tasks.report import CSV_COLUMNS, EFFECTIVE_RULE, effective_lengths, plot_task_heatmap, score_tables
    from .evaluation import method_selection, runtime_options

    check_model_source(args.model)  # before the task data: RULER sizes its prompts with the model's tokenizer
    processes = Processes(cpu=cpu_processes(args.device))
    managers = TaskManagers()
    specs = resolve_tasks(names, managers.any())
    check_lengths(specs, lengths)
    tokenizer_name = str(Path(args.model).resolve()) if Path(args.model).exists() else args.model

    def check_data():
        for spec in specs:
            length = task_lengths(spec, lengths)[0]
            check_task_data(spec, managers.get(task_metadata(spec, length, tokenizer_name)), length)

    if not args.cached_only:
        on_main_first(processes, check_data)  # what cannot be fetched fails here, before the model loads

    model, tokenizer, runtime = load_model_and_tokenizer(args.model, runtime_options(args), processes)
    methods = method_rows(method_selection(args), model.config)
    cells = plan_cells(methods, specs, lengths)
    if args.no_cache:
        cache = CellCache(None)
    else:
        cache = CellCache(Path(args.cache_dir) if args.cache_dir else cache_dir() / "tasks")
    common_key = {
        "model": model_fingerprint(args.model, model),
        "tokenizer": tokenizer_name,
        "dtype": str(runtime["dtype"]).removeprefix("torch."),
        "device": runtime["device"].type,
        "attn_implementation": runtime["attn_implementation"],
        "limit": args.limit,
        "batch_size": batch_size,
        "apply_chat_template": args.apply_chat_template,
        "lm_eval": lm_eval.__version__,
    }
    if processes.is_main:
        print(
            f"ctxext tasks: {', '.join(s.name for s in specs)} x {len(methods)} methods x lengths "
            f"{', '.join(str(n) for n in lengths)} = {len(cells)} cells, "
            f"{'all' if args.limit is None else args.limit} samples each; lm-eval {lm_eval.__version__}; "
            f"{runtime['dtype']} ({runtime['dtype_reason']}) on {runtime['device']}, "
            f"{runtime['attn_implementation']}"
            f"{f', {processes.world_size} processes' if processes.world_size > 1 else ''}",
            flush=True,
        )

    def report(line: str) -> None:
        print(line, flush=True)

    try:
        run_cells(
            cells,
            model,
            tokenizer,
            managers,
            cache,
            lengths=lengths,
            tokenizer_name=tokenizer_name,
            common_key=common_key,
            limit=args.limit,
            batch_size=batch_size,
            apply_chat_template=args.apply_chat_template,
            processes=processes,
            cached_only=args.cached_only,
            quiet=args.no_progress,
            report=report,
        )
    except KeyboardInterrupt:
        if processes.is_main and cache.directory is not None:
            done = sum(c.result is not None for c in cells)
            print(
                f"ctxext tasks: {done} of {len(cells)} cells are cached in {cache.directory}; the same command "
                f"resumes from there",
                file=sys.stderr,
            )
        raise
    if not processes.is_main:
        return 0

    rows = [row for cell in cells for row in cell_scores(cell)]
    labels = [m.label for m in methods]
    missing = [c.name for c in cells if c.result is None]
    table = score_tables(rows, labels, lengths) if rows else "(no cell has a result yet)"
    effective = effective_lengths(rows, labels)
    payload = {
        "command": Invocation().command,
        "arguments": dict(vars(args)),
        "model": model_description(args.model, model, runtime),
        "protocol": {
            "name": "lm-evaluation-harness tasks through lm_eval.simple_evaluate on HFLM, one call per "
            "(method, task, length)",
            "tasks": [{"name": s.name, "length_convention": s.convention} for s in specs],
            "lengths": lengths,
            "limit": args.limit,
            "batch_size": batch_size,
            "apply_chat_template": args.apply_chat_template,
            "max_length": "the cell's length (tasks without lengths: the longest) + 256, HFLM's max_length",
            "seeds": "simple_evaluate's defaults (python 0, numpy 1234, torch 1234, fewshot 1234), set before "
            "each task is built, so every method sees the same prompts; each cell's config has them",
            "tokenizer": tokenizer_name,
        },
        "methods": [{"label": m.label, **m.description} for m in methods],
        "scores": rows,
        "effective_length": {"rule": EFFECTIVE_RULE, "panels": effective},
        "missing_cells": missing,
        "cells": [
            {
                "method": c.method.label,
                "task": c.task.name,
                "length": c.length,
                "cached": c.cached,
                "cache_file": str(cache.path(c.key)) if cache.directory is not None else None,
                "lm_eval": c.result,
            }
            for c in cells
        ],
        "runtime": {
            "processes": processes.world_size,
            "seconds": time.perf_counter() - started,
            "cells_run": sum(c.result is not None and not c.cached for c in cells),
            "cells_cached": sum(c.cached for c in cells),
        },
        "environment": {**environment(), "lm_eval": lm_eval.__version__},
    }
    with atomic_output_dir(args.output, protected, args.overwrite) as staging:
        write_json(staging / "results.json", payload)
        write_csv(staging / "results.csv", rows, CSV_COLUMNS)
        (staging / "table.txt").write_text(table + "\n")
        if rows:
            plot_task_heatmap(
                rows,
                labels,
                staging / "tasks.png",
                f"{Path(args.model).name}: lm-eval tasks, "
                f"{'all' if args.limit is None else args.limit} samples per cell",
            )
    print()
    print(table)
    if effective:
        print(f"\n{EFFECTIVE_RULE}")
    if missing:
        print(f"\n{len(missing)} cells not run yet: {'; '.join(missing[:6])}{'; ...' if len(missing) > 6 else ''}")
    print(
        f"\nresults: {Path(args.output).resolve()} (results.json, results.csv, table.txt"
        f"{', tasks.png' if rows else ''})"
    )
    return 0
