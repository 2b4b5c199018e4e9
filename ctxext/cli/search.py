"""`ctxext search`: a method's best parameters on your own model, by its perplexity at the target length."""

from __future__ import annotations

import textwrap

from .common import HelpFormatter, add_data_arguments, add_method_arguments, add_runtime_arguments

HELP = "search a method's parameters (LongRoPE's per-pair factors too) on your model and data; resumable"
DESCRIPTION = (
    "Search the parameters of --method for MODEL at --length tokens: TPE (Optuna, seeded) over each parameter's "
    "declared range (or --params / a --space YAML), or, for --method longrope, CMA-ES over the per-pair long_factor "
    "kept non-decreasing, starting from YaRN's factors. The objective is ctxext's perplexity on the first "
    "--calibration-docs documents (one window each by default), optionally with passkey accuracy. Trial 0 is the "
    "method's defaults (with any parameter you give as a flag), so the result is never worse than the defaults on "
    "the calibration data. Every trial goes to OUT/trials.jsonl as it finishes; --resume continues a search. "
    "At the end the defaults and the best are re-scored on held-out documents the search did not use "
    "(results.json), the objective is plotted per trial (and LongRoPE's factors per pair), and the best parameters "
    "are written as a checkpoint to OUT/checkpoint (the same code as `ctxext patch`; longrope as transformers' own "
    "'longrope' type)."
)
DESCRIPTION = textwrap.fill(DESCRIPTION, 100)
FORMATTER_CLASS = HelpFormatter  # wraps prose, keeps the examples one a line
EPILOG = (
    "examples:\n"
    "  ctxext search ./model --method yarn --factor 4 --length 16k --dataset pg19 --max-docs 4 -o yarn-search\n"
    "  ctxext search ./model --method longrope --factor 4 --length 16k --text-file books/ --trials 40 -o lr\n"
    "  ctxext search ./model --method rerope --length 32k --params window --trials 12 --dataset ... -o rr\n"
    "  ctxext search ./model --method yarn --factor 4 --length 16k --dataset ... -o yarn-search --resume "
    "--trials 60"
)


def add_arguments(parser) -> None:
    parser.add_argument("model", help="a local checkpoint directory or a hub id")
    parser.add_argument(
        "--length",
        required=True,
        metavar="N",
        help="the target context in tokens (e.g. 16384 or 16k); must be above the original length L",
    )
    parser.add_argument("-o", "--output", required=True, help="directory for the trials, results, plots, checkpoint")
    parser.add_argument("--resume", action="store_true", help="continue the search in --output (same settings)")
    parser.add_argument("--overwrite", action="store_true", help="start over in an --output holding an earlier search")
    group = parser.add_argument_group("search")
    group.add_argument(
        "--params",
        metavar="A,B",
        help="search only these parameters, over their declared ranges "
        "(default: every parameter that declares one; 'ctxext methods -v' lists them)",
    )
    group.add_argument(
        "--space",
        metavar="YAML",
        help="ranges to search instead of the declared ones, e.g. 'beta_fast: {low: 8, high: 64, log: true}'",
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
        default="ppl",
        choices=("ppl", "passkey", "ppl+passkey", "needle-ppl", "ppl+needle-ppl"),
        help="ppl: calibration perplexity (default); passkey: 1 - passkey accuracy at --length; "
        "ppl+passkey: perplexity x 2^(1 - accuracy); needle-ppl: mean NLL of the passkey "
        "answers' tokens at --length (one forward each, no generation; keeps retrieval); "
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
        "--held-out",
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
    lr = parser.add_argument_group("longrope (--method longrope)")
    lr.add_argument(
        "--longrope-start",
        default="yarn",
        metavar="METHOD",
        help="the frequency method whose per-pair factors the search starts from (default yarn)",
    )
    lr.add_argument(
        "--longrope-knots",
        type=int,
        default=8,
        metavar="K",
        help="knots of the monotone factor curve, CMA-ES's dimensions (default 8)",
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
    add_data_arguments(parser)
    add_runtime_arguments(parser)
    add_method_arguments(parser)


def require_search_packages() -> None:
    from ..errors import CtxextError

    try:
        import cma  # noqa: F401
        import optuna  # noqa: F401
    except ImportError:
        raise CtxextError(
            "ctxext search needs Optuna and cma: pip install 'ctxext[search]' (or pip install optuna cma)"
        ) from None


def run(args) -> int:
    import time
    from pathlib import Path

    from ..errors import CtxextError
    from ..search import session

    started = time.perf_counter()
    require_search_packages()
    plan = _plan(args)  # every check that needs no model: bad input fails here, before anything is written
    settings, docs, tokenizer, bos_id, runtime, protected = plan
    settings_dict = settings.to_dict()
    out = Path(args.output)
    mode = session.check_output(out, settings_dict, args.resume, args.overwrite, protected)

    from ..loading import load_model
    from ..patching import rotary_dim

    model = load_model(
        args.model, dtype=runtime["dtype"], device=runtime["device"], attn_implementation=runtime["attn_implementation"]
    )
    session.start_output(out, settings_dict, mode)
    print(
        f"ctxext search: {settings.method} x{settings.factor:g} at {settings.length} tokens (L = "
        f"{settings.original_max_position_embeddings}), objective {settings.objective}, {args.trials} trials"
        f"{' (resumed)' if mode == 'resume' else ''}; calibration: {', '.join(d.name for d in docs['calibration'])}"
        f"; held out: {', '.join(d.name for d in docs['held_out']) or 'none'}; {settings.dtype} on "
        f"{runtime['device']}",
        flush=True,
    )
    if settings.space:
        print("  space: " + ", ".join(f"{r.name} {r.describe()}" for r in settings.space), flush=True)

    from ..search.objective import Objective

    objective = Objective(
        settings.objective,
        settings.base,
        model,
        tokenizer,
        docs["calibration"],
        settings.length,
        settings.stride,
        bos_id,
        docs["passkey_trials"],
    )
    logged = len(session.TrialLog(out / session.TRIALS_FILE).read())
    progress = _progress(args, args.trials, min(logged, args.trials), f"{settings.method} search")
    base = float(model.config.rope_parameters["rope_theta"])
    try:
        history = session.run_trials(settings, objective, out, args.trials, rotary_dim(model.config), base, progress)
    finally:
        if progress is not None:
            progress.close()
    best = session.best_trial(history)
    if best is None:
        raise CtxextError(f"no trial of the search in '{out}' gave a score (see {session.TRIALS_FILE})")

    held_out = {}
    if docs["held_out"]:
        print(f"re-scoring on {len(docs['held_out'])} held-out documents ...", flush=True)
        held_out = session.held_out_scores(
            settings, history, model, docs["held_out"], bos_id, baseline=not args.no_baseline
        )

    from ..checkpoint import write_patched_checkpoint
    from ..eval.report import environment
    from ..search.objective import method_config

    checkpoint = None
    if not args.no_checkpoint:
        best_config = method_config(settings.base, best["params"])
        objective.model = model = None  # free the search's copy: the checkpoint is written from the source's weights
        written = write_patched_checkpoint(
            args.model,
            best_config,
            out / session.CHECKPOINT_DIR,
            overwrite=True,
            written_by="ctxext search",
            extra_record={
                "search": {
                    "output": str(out.resolve()),
                    "trial": best["number"],
                    "objective": settings.objective,
                    "value": best["value"],
                    "length": settings.length,
                }
            },
        )
        checkpoint = {
            "path": str(written.output),
            "rope_type": written.form.rope_parameters["rope_type"],
            "written_as": written.form.how,
            "loads_in_plain_transformers": written.loads_in_plain_transformers,
        }
    results = session.summarize(settings, history, held_out, time.perf_counter() - started, environment(), checkpoint)
    session.write_json(out / session.RESULTS_FILE, results)
    title = (
        f"{Path(args.model).name}: {settings.method} x{settings.factor:g} at {settings.length} "
        f"(L={settings.original_max_position_embeddings})"
    )
    session.save_plot(session.plot_objective, history, out / session.OBJECTIVE_PLOT, title, settings.objective)
    if settings.method == "longrope":
        start, defaults, _ = session.longrope_curves(settings, len(best["params"]["long_factor"]) * 2, base)
        curves = {
            "defaults (every pair / s)": defaults,
            f"start ({settings.longrope['start_method']})": [float(f) for f in start],
            f"best (trial {best['number']})": best["params"]["long_factor"],
        }
        session.save_plot(session.plot_factors, curves, out / session.FACTORS_PLOT, title)
    _print_summary(results, out)
    return 0


def _plan(args):
    """(settings, documents, tokenizer, BOS id, runtime, protected inputs), or a one-line CtxextError."""
    import dataclasses
    from pathlib import Path

    from ..config import read_yaml_mapping
    from ..errors import CtxextError
    from ..eval.data import load_documents
    from ..eval.passkey import plan_trials
    from ..eval.perplexity import text_tokens_per_window
    from ..eval.runner import Processes
    from ..loading import load_config, load_tokenizer
    from ..methods import get_method
    from ..patching import rotary_dim
    from ..search import session
    from ..search.objective import method_config
    from ..search.space import build_space, parse_param_names
    from .common import method_config_from_args, parse_depths, parse_lengths, parse_stride
    from .evaluation import bos_choice, resolve_runtime

    lengths = parse_lengths(args.length)
    if len(lengths) != 1:
        raise CtxextError(f"--length takes one length, got '{args.length}'")
    length = lengths[0]
    stride = parse_stride(args.stride)
    if stride is not None and stride > length:
        raise CtxextError(f"--stride {stride} is larger than --length {length}")
    for name in ("trials", "calibration_docs", "passkey_trials", "startup_trials"):
        if getattr(args, name) < 1:
            raise CtxextError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.held_out is not None and args.held_out < 0:
        raise CtxextError(f"--held-out must be >= 0, got {args.held_out}")
    if args.params is not None and args.space is not None:
        raise CtxextError("give the searched parameters with --params (declared ranges) or --space (a YAML), not both")
    if args.resume and args.overwrite:
        raise CtxextError("--resume continues the search in --output and --overwrite starts it over: give one")
    config = method_config_from_args(args)
    spec = get_method(config.method)
    model_config = load_config(args.model)
    rope = dict(getattr(model_config, "rope_parameters", None) or {})
    L = (
        config.original_max_position_embeddings
        or rope.get("original_max_position_embeddings")
        or model_config.max_position_embeddings
    )
    if length <= L:
        raise CtxextError(
            f"--length {length} is not above the original length L = {L}: a search extends the context "
            "(to treat the model as shorter, give --original-max-position-embeddings)"
        )
    if not hasattr(args, "factor") and not (args.config and "factor" in read_yaml_mapping(args.config)):
        config = dataclasses.replace(config, factor=length / L)  # s = N / L unless given
    config = dataclasses.replace(config, original_max_position_embeddings=int(L)).validate()
    dim = rotary_dim(model_config)
    base = float(rope.get("rope_theta", getattr(model_config, "rope_theta", 10000.0)))

    longrope = None
    if spec.name == "longrope":
        if args.params is not None or args.space is not None:
            raise CtxextError("--method longrope searches the per-pair long_factor; --params/--space do not apply")
        if "long_factor" in config.params:
            raise CtxextError(
                "--method longrope searches long_factor; do not give it (--longrope-start picks the starting curve)"
            )
        from ..search.longrope import knot_positions, start_factors

        knot_positions(dim // 2, args.longrope_knots)
        start_factors(args.longrope_start, config.factor, dim, base, L)  # an unknown or dynamic method fails here
        if args.longrope_sigma <= 0:
            raise CtxextError(f"--longrope-sigma must be > 0, got {args.longrope_sigma}")
        if args.longrope_upper is not None and args.longrope_upper < config.factor:
            raise CtxextError(f"--longrope-upper must be at least the factor ({config.factor:g})")
        if args.longrope_popsize is not None and args.longrope_popsize < 2:
            raise CtxextError(f"--longrope-popsize must be at least 2, got {args.longrope_popsize}")
        longrope = {
            "start_method": args.longrope_start,
            "knots": args.longrope_knots,
            "sigma": args.longrope_sigma,
            "upper": args.longrope_upper,
            "popsize": args.longrope_popsize,
        }
        space, start, fixed = [], {}, dict(config.params)
    else:
        space_yaml = read_yaml_mapping(args.space) if args.space is not None else None
        names = parse_param_names(args.params) if args.params is not None else None
        counts = {k: len(v) for k, v in config.params.items() if isinstance(v, list)}
        space = build_space(
            spec,
            {"factor": config.factor, "L": L, "base": base},
            names,
            space_yaml,
            source=f"--space '{args.space}'",
            counts=counts,
        )
        searched = {r.name for r in space}
        given = {**config.params, **{f"{k}[{i}]": x for k, v in counts.items() for i, x in enumerate(config.params[k])}}
        start = {k: v for k, v in given.items() if k in searched}
        fixed = {
            k: v
            for k, v in config.params.items()
            if k not in searched and not any(name.startswith(f"{k}[") for name in searched)
        }
    base_mapping = {
        "method": config.method,
        "factor": config.factor,
        "original_max_position_embeddings": int(L),
        "logn": config.logn,
        **fixed,
    }
    method_config(base_mapping, start)  # the defaults (trial 0) must be a valid configuration
    protected = [p for p in [args.model, *(args.text_file or []), args.dataset] if p and Path(p).exists()]

    tokenizer = load_tokenizer(args.model)
    bos_id, _ = bos_choice(args, tokenizer)
    documents = load_documents(
        tokenizer,
        text_files=args.text_file,
        dataset=args.dataset,
        split=args.split,
        dataset_config=args.dataset_config,
        text_field=args.text_field,
        max_docs=args.max_docs,
        min_doc_tokens=args.min_doc_tokens,
    ).documents
    span = text_tokens_per_window(length, bos_id)
    usable = [d for d in documents if len(d) >= span]
    if len(usable) < args.calibration_docs:
        longest = max((len(d) for d in documents), default=0)
        raise CtxextError(
            f"{len(usable)} of {len(documents)} documents hold the {span} tokens a {length}-token window "
            f"needs (the longest has {longest}); --calibration-docs wants {args.calibration_docs}"
        )
    calibration = usable[: args.calibration_docs]
    rest = usable[args.calibration_docs :]
    if args.held_out is not None and len(rest) < args.held_out:
        raise CtxextError(
            f"--held-out {args.held_out}: only {len(rest)} long-enough documents are left after the "
            f"{len(calibration)} calibration documents"
        )
    held_out = rest[: 3 if args.held_out is None else args.held_out]

    passkey = None
    passkey_trials = []
    if args.objective != "ppl":
        depths = parse_depths(args.passkey_depths)
        passkey = {"trials": args.passkey_trials, "depths": depths}
        passkey_trials = plan_trials([length], depths, args.passkey_trials, args.seed)

    runtime = resolve_runtime(args, Processes(cpu=True if args.device == "cpu" else None))
    from ..eval.data import tokens_fingerprint

    settings = session.SearchSettings(
        model=str(args.model),
        method=config.method,
        factor=float(config.factor),
        length=length,
        original_max_position_embeddings=int(L),
        logn=config.logn,
        fixed=fixed,
        start=start,
        space=space,
        objective=args.objective,
        stride=stride,
        seed=args.seed,
        startup_trials=args.startup_trials,
        longrope=longrope,
        passkey=passkey,
        dtype=str(runtime["dtype"]).removeprefix("torch."),
        data={
            "calibration": {
                "documents": [d.name for d in calibration],
                "tokens_sha256": tokens_fingerprint(d.ids for d in calibration),
            },
            "held_out": {
                "documents": [d.name for d in held_out],
                "tokens_sha256": tokens_fingerprint(d.ids for d in held_out),
            },
        },
    )
    docs = {"calibration": calibration, "held_out": held_out, "passkey_trials": passkey_trials}
    return settings, docs, tokenizer, bos_id, runtime, protected


def _progress(args, total: int, initial: int, description: str):
    if args.no_progress:
        return None
    import sys

    from tqdm.auto import tqdm

    return tqdm(total=total, initial=initial, unit="trial", desc=description, dynamic_ncols=True, file=sys.stderr)


def _print_summary(results: dict, out) -> None:
    from ..eval.report import format_perplexity

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
    print(f"results: {out.resolve()} (results.json, trials.jsonl, objective.png)")
