"""`ctxext search`: a method's best parameters on your own model, by its perplexity at the target length."""

from __future__ import annotations

import textwrap

from ..config import read_yaml_mapping
from ..errors import CtxextError
from ..eval.options import parse_depths, parse_lengths, parse_stride
from ..search.space import parse_param_names
from .aliases import add_alias
from .common import (
    HelpFormatter,
    add_data_arguments,
    add_method_arguments,
    add_pair_selection_arguments,
    add_runtime_arguments,
    method_config_from_args,
)
from .evaluation import data_options, runtime_options

HELP = "search a method's parameters (LongRoPE's per-pair factors too) on your model and data; resumable"
DESCRIPTION = (
    "Search the parameters of --method for MODEL at --lengths tokens: TPE (Optuna, seeded) over each parameter's "
    "declared range (or --params / a --space YAML), or, for --method longrope, CMA-ES over the per-pair long_factor "
    "kept non-decreasing, starting from YaRN's factors (--space cma, the default) or LongRoPE2's critical-dimension "
    "space (--space critical: the critical dimension and the factors above it, at least s and non-decreasing, NTK "
    "below it, starting from the theoretical critical dimension). The objective is ctxext's perplexity on the first "
    "--calibration-docs documents (one window each by default), optionally with passkey accuracy, or the needle "
    "perplexity (the default of --space critical). Trial 0 is the "
    "method's defaults (with any parameter you give as a flag), so the result is never worse than the defaults on "
    "the calibration data. Every trial is an Optuna trial in a study (--storage, default OUT/study.journal; "
    "OUT/trials.jsonl is written from it); --resume continues a search, and processes started on one --storage "
    "(--workers N, or by hand on other machines) run the trials of one study together. "
    "At the end the defaults and the best are re-scored on held-out documents the search did not use "
    "(results.json), the objective is plotted per trial (and LongRoPE's factors per pair), and the best parameters "
    "are written as a checkpoint to OUT/checkpoint (the same code as `ctxext patch`; longrope as transformers' own "
    "'longrope' type)."
)
DESCRIPTION = textwrap.fill(DESCRIPTION, 100)
FORMATTER_CLASS = HelpFormatter  # wraps prose, keeps the examples one a line
EPILOG = (
    "examples:\n"
    "  ctxext search ./model --method yarn --factor 4 --lengths 16k --objective ppl+needle-ppl --dataset pg19 -o ys\n"
    "  ctxext search ./model --method longrope --factor 4 --lengths 16k --text-file books/ --trials 40 -o lr\n"
    "  ctxext search ./model --method longrope --space critical --lengths 32k --text-file books/ --trials 40 -o lr2\n"
    "  ctxext search ./model --method rerope --lengths 32k --params window --trials 12 --dataset ... -o rr\n"
    "  ctxext search ./model --method yarn --factor 4 --lengths 16k --dataset ... -o yarn-search --resume "
    "--trials 60\n"
    "  ctxext search ./model --method yarn --factor 4 --lengths 16k --dataset ... -o a --storage sqlite:///s.db"
    "   (and -o b on another machine)"
)


def add_arguments(parser) -> None:
    parser.add_argument("model", help="a local checkpoint directory or a hub id")
    parser.add_argument(
        "--lengths",
        required=True,
        metavar="N",
        help="the target context in tokens, one length (e.g. 16384 or 16k); must be above the original length L",
    )
    parser.add_argument("-o", "--output", required=True, help="directory for the trials, results, plots, checkpoint")
    parser.add_argument("--resume", action="store_true", help="continue the search in --output (same settings)")
    parser.add_argument("--overwrite", action="store_true", help="start over in an --output holding an earlier search")
    _add_study_arguments(parser)
    _add_search_arguments(parser)
    _add_scoring_arguments(parser)
    _add_longrope_arguments(parser)
    add_pair_selection_arguments(parser)
    add_data_arguments(parser)
    add_runtime_arguments(parser)
    add_method_arguments(parser)
    add_alias(parser, "--length", "--lengths")
    add_alias(parser, "--held-out", "--held-out-docs")


def _add_study_arguments(parser) -> None:
    group = parser.add_argument_group("the study (where the trials are kept; several processes share one)")
    group.add_argument(
        "--storage",
        metavar="URL",
        help="the Optuna storage of the trials: an RDB URL (sqlite:///search.db, postgresql://...) or a journal "
        "file (default: OUT/study.journal). Processes on one storage and study run its trials together",
    )
    group.add_argument(
        "--study-name",
        default="ctxext-search",
        metavar="NAME",
        help="the study in --storage (default ctxext-search); it records the search's settings and refuses others",
    )
    group.add_argument(
        "--workers",
        type=int,
        default=1,
        metavar="N",
        help="processes on this machine running trials at once, each with its own copy of the model (default 1)",
    )


def _add_search_arguments(parser) -> None:
    group = parser.add_argument_group("search")
    group.add_argument(
        "--params",
        metavar="A,B",
        help="search only these parameters, over their declared ranges "
        "(default: every parameter that declares one; 'ctxext methods -v' lists them)",
    )
    group.add_argument(
        "--space",
        metavar="YAML|cma|critical",
        help="ranges to search instead of the declared ones, e.g. 'beta_fast: {low: 8, high: 64, log: true}'; "
        "--method longrope: cma (default: CMA-ES over a monotone knot curve from --longrope-start) or critical "
        "(LongRoPE2: the critical dimension d from the theoretical one, ceil((D/2) log_b(L/2pi)), down to the pair "
        "with 10 periods in L; the factors from d on at least s and non-decreasing; NTK below d with the base "
        "b f_d^(D/2d); objective needle-ppl unless --objective is given)",
    )
    group.add_argument(
        "--trials",
        type=int,
        default=30,
        metavar="K",
        help="trials in all, trial 0 (the defaults) included (default 30); with --resume, a larger K "
        "continues a finished search",
    )
    group.add_argument(
        "--objective",
        default=None,
        choices=("ppl", "passkey", "ppl+passkey", "needle-ppl", "ppl+needle-ppl"),
        help="ppl: calibration perplexity (default; needle-ppl with --space critical; it can cost retrieval, so "
        "name ppl+needle-ppl where retrieval matters, as ctxext compare does); passkey: 1 - passkey accuracy at "
        "--lengths; "
        "ppl+passkey: perplexity x 2^(1 - accuracy); needle-ppl: mean NLL of the passkey "
        "answers' tokens at --lengths (one forward each, no generation; keeps retrieval); "
        "ppl+needle-ppl: ln(perplexity) + that NLL (the two per-token NLLs weighted equally)",
    )
    group.add_argument("--seed", type=int, default=0, help="seed of the optimizer and of the passkeys (default 0)")
    group.add_argument(
        "--startup-trials",
        type=int,
        default=5,
        metavar="K",
        help="TPE's random trials before it models the objective (default 5)",
    )


def _add_scoring_arguments(parser) -> None:
    group = parser.add_argument_group("scoring")
    group.add_argument(
        "--stride",
        default="window",
        metavar="S",
        help="'window' (default): one window of --length over each document's first tokens; or a "
        "stride for sliding windows over whole documents",
    )
    group.add_argument(
        "--calibration-docs",
        type=int,
        default=1,
        metavar="K",
        help="the first K documents long enough for a window are the calibration data (default 1)",
    )
    group.add_argument(
        "--held-out-docs",
        type=int,
        default=None,
        metavar="N",
        help="re-score on the next N long-enough documents (default: up to 3 of them; 0: none)",
    )
    group.add_argument(
        "--no-checkpoint", action="store_true", help="do not write the best parameters as a checkpoint (OUT/checkpoint)"
    )
    group.add_argument(
        "--no-baseline",
        action="store_true",
        help="do not score the model as loaded (no method) on the held-out documents",
    )
    group.add_argument(
        "--passkey-trials", type=int, default=2, metavar="N", help="passkey objectives: keys per depth (default 2)"
    )
    group.add_argument(
        "--passkey-depths",
        default="0,0.5,1",
        metavar="D,D,...",
        help="passkey objectives: where the key sits (default 0,0.5,1)",
    )


def _add_longrope_arguments(parser) -> None:
    lr = parser.add_argument_group("longrope (--method longrope)")
    lr.add_argument(
        "--longrope-start",
        default=None,
        metavar="METHOD",
        help="the frequency method whose per-pair factors the search starts from (default yarn; --space cma only)",
    )
    lr.add_argument(
        "--longrope-knots",
        type=int,
        default=8,
        metavar="K",
        help="knots of the monotone factor curve, CMA-ES's dimensions (default 8; --space critical: knots over "
        "the pairs from the critical dimension on, plus one dimension for it)",
    )
    lr.add_argument(
        "--longrope-sigma",
        type=float,
        default=0.5,
        metavar="X",
        help="CMA-ES's initial step in log-factor units (default 0.5)",
    )
    lr.add_argument(
        "--longrope-upper",
        type=float,
        default=None,
        metavar="F",
        help="the largest factor allowed (default 2 x factor)",
    )
    lr.add_argument(
        "--longrope-popsize",
        type=int,
        default=None,
        metavar="N",
        help="CMA-ES population per generation (default pycma's, 4 + 3 ln K)",
    )


def request_from_args(args):
    """The SearchRequest the flags ask for (parsed here; checked by the library)."""
    from ..search.plan import LongropeOptions, SearchRequest, default_objective, split_space_argument

    lengths = parse_lengths(args.lengths)
    if len(lengths) != 1:
        raise CtxextError(f"ctxext search takes one length in --lengths, got '{args.lengths}'")
    method = method_config_from_args(args).to_dict()
    if not hasattr(args, "factor") and not (args.config and "factor" in read_yaml_mapping(args.config)):
        method.pop("factor")  # s = N / L
    space_name, space_yaml = split_space_argument(args.space, method["method"])
    longrope = LongropeOptions(
        args.longrope_start,
        args.longrope_knots,
        args.longrope_sigma,
        args.longrope_upper,
        args.longrope_popsize,
        space=space_name or "cma",
    )
    objective = default_objective(args.objective, longrope.space)
    return SearchRequest(
        model=args.model,
        method=method,
        length=lengths[0],
        output=args.output,
        trials=args.trials,
        objective=objective,
        params=parse_param_names(args.params) if args.params is not None else None,
        space=read_yaml_mapping(space_yaml) if space_yaml is not None else None,
        space_source=f"--space '{args.space}'",
        seed=args.seed,
        startup_trials=args.startup_trials,
        stride=parse_stride(args.stride),
        calibration_docs=args.calibration_docs,
        held_out=args.held_out_docs,
        checkpoint=not args.no_checkpoint,
        baseline=not args.no_baseline,
        passkey_trials=args.passkey_trials,
        passkey_depths=parse_depths(args.passkey_depths) if objective != "ppl" else [0.0, 0.5, 1.0],
        longrope=longrope,
        select_pairs=args.select_pairs,
        top_pairs=args.top_pairs,
        data=data_options(args),
        runtime=runtime_options(args),
        resume=args.resume,
        overwrite=args.overwrite,
        storage=args.storage,
        study_name=args.study_name,
        workers=args.workers,
    )


def run(args) -> int:
    from ..search.workflow import run_search

    result = run_search(request_from_args(args), log=lambda line: print(line, flush=True))
    if result is None:  # under --tp, a process other than the first: it scored the trials with it, and writes nothing
        return 0
    _print_summary(result.results, result.output)
    return 0


def _print_summary(results: dict, out) -> None:
    from ..eval.report import format_perplexity
    from ..search.longrope import recorded_critical_dim

    settings, best = results["settings"], results["best"]
    calibration, held = results["calibration"], results["held_out"]

    def number(value):
        if value is None:
            return "-"
        return format_perplexity(value) if settings["objective"] in ("ppl", "ppl+passkey") else f"{value:.3f}"

    def change(value):
        return "" if value is None else f" ({value:+.1%})"

    width = 22
    ppl = held["perplexity"]
    lines = [
        f"{'':{width}}{'calibration':>14}{'held out':>14}",
        f"{'defaults (trial 0)':{width}}{number(calibration['defaults']):>14}"
        f"{format_perplexity(ppl['defaults']) if ppl.get('defaults') else '-':>14}",
        f"{'best (trial ' + str(best['number']) + ')':{width}}{number(calibration['best']):>14}"
        f"{format_perplexity(ppl['best']) if ppl.get('best') else '-':>14}"
        f"{change(held['change'])}",
    ]
    if ppl.get("start"):
        lines.insert(
            2, f"{'start (trial 1)':{width}}{number(results['start_value']):>14}{format_perplexity(ppl['start']):>14}"
        )
    if ppl.get("none"):
        lines.append(f"{'as loaded (no method)':{width}}{'':>14}{format_perplexity(ppl['none']):>14}")
    print()
    print("\n".join(lines))
    shown = {k: v for k, v in best["params"].items() if k != "long_factor"}
    if "long_factor" in best["params"]:
        shown["long_factor"] = "[" + ", ".join(f"{f:.3g}" for f in best["params"]["long_factor"]) + "]"
    critical = recorded_critical_dim(settings.get("longrope"), best)
    if critical is not None:
        shown["critical_dim"] = f"{critical} (theoretical {settings['longrope']['theoretical_critical_dim']})"
    print("best parameters: " + (", ".join(f"{k}={v}" for k, v in shown.items()) or "the defaults"))
    written = results["checkpoint"]
    print(
        f"trials: {results['trials']['logged']} ({results['trials']['invalid']} invalid); checkpoint: "
        + (
            f"{written['path']} (rope_type {written['rope_type']}; loads in plain transformers: "
            f"{written['loads_in_plain_transformers']})"
            if written
            else "not written (--no-checkpoint)"
        )
    )
    study = results["study"]
    print(
        f"results: {out.resolve()} (results.json, trials.jsonl, objective.png); study '{study['name']}' in "
        f"{study['storage']}"
    )
