"""`ctxext tasks`: lm-evaluation-harness tasks (RULER, LongBench v2, babilong, any lm-eval task) under every
method, side by side."""

from __future__ import annotations

import argparse
from pathlib import Path

from .common import add_method_arguments, add_runtime_arguments, method_selection, parse_lengths
from .evaluation import invocation, runtime_options

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
        parser,
        bos=False,
        progress_help="no progress bars (lm-eval's included); one line per finished cell",
        decoding=True,
    )
    add_method_arguments(parser, multiple=True)
    parser.set_defaults(text_file=None, dataset=None)


def request(args: argparse.Namespace):
    """The TasksRequest the arguments ask for."""
    from ..tasks.workflow import TasksRequest, parse_batch_size, parse_task_names

    return TasksRequest(
        model=args.model,
        tasks=parse_task_names(args.tasks),
        lengths=parse_lengths(args.lengths),
        limit=args.limit,
        batch_size=parse_batch_size(args.batch_size),
        apply_chat_template=args.apply_chat_template,
        methods=method_selection(args),
        runtime=runtime_options(args),
        output=args.output,
        overwrite=args.overwrite,
        cache_dir=args.cache_dir,
        use_cache=not args.no_cache,
        cached_only=args.cached_only,
        invocation=invocation(args),
    )


def run(args: argparse.Namespace) -> int:
    from ..tasks.report import EFFECTIVE_RULE
    from ..tasks.workflow import run_tasks

    result = run_tasks(request(args), log=lambda line: print(line, flush=True))
    if not result.main_process:
        return 0
    print()
    print(result.table)
    if result.effective:
        print(f"\n{EFFECTIVE_RULE}")
    missing = result.missing
    if missing:
        print(f"\n{len(missing)} cells not run yet: {'; '.join(missing[:6])}{'; ...' if len(missing) > 6 else ''}")
    print(
        f"\nresults: {Path(args.output).resolve()} (results.json, results.csv, table.txt"
        f"{', tasks.png' if result.rows else ''})"
    )
    return 0
