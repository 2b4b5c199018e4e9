"""A search request (typed options, no argparse) and its plan: every check that needs no model, so bad input fails
before anything is written or loaded.

`plan_search(request)` reads the model's config, the tokenizer and the documents, and returns the `SearchPlan`:
the `SearchSettings` (search.json: what a resume or another worker must match), the calibration and held-out
documents, the passkey prompts of a passkey objective, BOS and the runtime.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

from ..config import MethodConfig
from ..dispatch import check_placement
from ..errors import CtxextError
from ..eval.data import tokens_fingerprint
from ..eval.passkey import plan_trials
from ..eval.perplexity import text_tokens_per_window
from ..eval.session import bos_choice
from ..extras import require
from ..loading import load_config, load_tokenizer
from ..methods import get_method
from ..patching.pair_selection import check_pair_selection, check_top_pairs, selection_record
from ..patching.record import rope_record
from ..run_options import DataOptions, RuntimeOptions
from ..runtime import Processes, inference_runtime
from .longrope import DEFAULT_KNOTS, DEFAULT_SIGMA, LONGROPE_SPACES, critical_space, knot_positions, start_factors
from .objective import check_objective, method_config
from .output import SearchSettings
from .space import build_space
from .store import DEFAULT_STUDY


@dataclass
class LongropeOptions:
    """--method longrope: the starting curve's method, CMA-ES's knots, initial step, factor cap, population, and
    the space searched (`ctxext.search.longrope.LONGROPE_SPACES`)."""

    start_method: str | None = None  # None: yarn (--space cma); --space critical starts from its own curve
    knots: int = DEFAULT_KNOTS
    sigma: float = DEFAULT_SIGMA
    upper: float | None = None  # None: 2 x factor
    popsize: int | None = None  # None: pycma's 4 + 3 ln K
    space: str = "cma"  # "cma": the knot curve from --longrope-start; "critical": LongRoPE2's critical dimension


@dataclass
class SearchRequest:
    """What `ctxext search` is asked: the model, the method (a mapping as a method YAML holds it; without
    `factor`, s = length / L), the target length and the output directory, and how to search."""

    model: str
    method: dict
    length: int
    output: str | Path
    trials: int = 30  # trial 0 (the defaults) included
    objective: str | None = None  # None: ppl, or needle-ppl for longrope's --space critical (`default_objective`)
    params: list[str] | None = None  # search these declared ranges (None: every declared one)
    space: dict | None = None  # or these ranges (a --space YAML's mapping)
    space_source: str = "--space"
    seed: int = 0
    startup_trials: int = 5
    stride: int | None = None  # None: one window per document
    calibration_docs: int = 1
    held_out: int | None = None  # None: up to 3
    checkpoint: bool = True
    baseline: bool = True
    passkey_trials: int = 2
    passkey_depths: list[float] = field(default_factory=lambda: [0.0, 0.5, 1.0])
    longrope: LongropeOptions = field(default_factory=LongropeOptions)
    select_pairs: str | None = None  # dpe: a calibration text; with top_pairs, DPE's selection, fixed for all trials
    top_pairs: int | None = None
    data: DataOptions = field(default_factory=DataOptions)
    runtime: RuntimeOptions = field(default_factory=RuntimeOptions)
    resume: bool = False
    overwrite: bool = False
    storage: str | None = None  # an Optuna storage (RDB URL or journal file); None: OUT/study.journal
    study_name: str = DEFAULT_STUDY
    workers: int = 1  # processes on this machine running trials of the study


@dataclass
class SearchPlan:
    request: SearchRequest
    settings: object  # output.SearchSettings
    calibration: list
    held_out: list
    passkey_trials: list
    tokenizer: object
    bos_id: int | None
    runtime: dict  # device, dtype, attn_implementation (ctxext.runtime.inference_runtime)
    protected: list  # inputs the output directory must not overlap


def check_packages() -> None:
    require("search", "ctxext search")


def default_objective(objective: str | None, longrope_space: str = "cma") -> str:
    """The objective asked for, else the space's default: needle-ppl for LongRoPE2's space (the paper's
    needle-driven perplexity), ppl otherwise."""
    if objective is not None:
        return objective
    return "needle-ppl" if longrope_space == "critical" else "ppl"


def split_space_argument(value: str | None, method: str) -> tuple[str | None, str | None]:
    """`--space`'s value as (a named LongRoPE space, a YAML path): --method longrope takes a name
    (`LONGROPE_SPACES`), every other method a YAML of ranges. A one-line CtxextError for a name with the wrong
    method or an unknown name with longrope."""
    if value is None:
        return None, None
    names = " or ".join(LONGROPE_SPACES)
    if method == "longrope":
        if value not in LONGROPE_SPACES:
            raise CtxextError(
                f"--space '{value}': --method longrope searches the space {names} (default cma), not a YAML of ranges"
            )
        return value, None
    if value in LONGROPE_SPACES:
        raise CtxextError(f"--space {value} is a LongRoPE search space: it needs --method longrope (got '{method}')")
    return None, value


def check_request(request: SearchRequest) -> None:
    """The checks on the request's own values."""
    check_objective(default_objective(request.objective, request.longrope.space))
    if request.longrope.space not in LONGROPE_SPACES:
        raise CtxextError(
            f"unknown LongRoPE search space '{request.longrope.space}'; choose {' or '.join(LONGROPE_SPACES)}"
        )
    if request.stride is not None and request.stride > request.length:
        raise CtxextError(f"--stride {request.stride} is larger than --length {request.length}")
    for name in ("trials", "calibration_docs", "passkey_trials", "startup_trials", "workers"):
        if getattr(request, name) < 1:
            raise CtxextError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(request, name)}")
    if request.held_out is not None and request.held_out < 0:
        raise CtxextError(f"--held-out must be >= 0, got {request.held_out}")
    if request.params is not None and request.space is not None:
        raise CtxextError("give the searched parameters with --params (declared ranges) or --space (a YAML), not both")
    if request.resume and request.overwrite:
        raise CtxextError("--resume continues the search in --output and --overwrite starts it over: give one")


def resolve_method(request: SearchRequest, model_config):
    """(the MethodConfig every trial starts from, L): s = N / L unless the request gives the factor. L is the
    model's trained context C (ctxext.patching.record), unless the request names another."""
    mapping = dict(request.method)
    L = mapping.get("original_max_position_embeddings") or rope_record(model_config).trained_context
    if request.length <= L:
        raise CtxextError(
            f"--length {request.length} is not above the model's context L = {L}: a search extends the context "
            "(to treat the model as shorter, give --original-max-position-embeddings)"
        )
    mapping.setdefault("factor", request.length / L)
    config = MethodConfig.from_mapping({**mapping, "original_max_position_embeddings": int(L)})
    return config, int(L)


def longrope_space(request: SearchRequest, config, dim: int, base: float, L: int):
    """(the longrope settings, no ranges, no start, the fixed parameters) of a LongRoPE search. The settings of
    --space cma are those of the searches before the spaces (no "space" key: a stored study resumes as it was);
    --space critical records "space": "critical" and its critical-dimension range."""
    lr = request.longrope
    if request.params is not None or request.space is not None:
        raise CtxextError("--method longrope searches the per-pair long_factor; --params/--space YAML do not apply")
    if "long_factor" in config.params:
        raise CtxextError(
            "--method longrope searches long_factor; do not give it (--longrope-start picks the starting curve)"
        )
    knot_positions(dim // 2, lr.knots)
    if lr.sigma <= 0:
        raise CtxextError(f"--longrope-sigma must be > 0, got {lr.sigma}")
    if lr.upper is not None and lr.upper < config.factor:
        raise CtxextError(f"--longrope-upper must be at least the factor ({config.factor:g})")
    if lr.popsize is not None and lr.popsize < 2:
        raise CtxextError(f"--longrope-popsize must be at least 2, got {lr.popsize}")
    if lr.space == "critical":
        return critical_settings(lr, config, dim, base, L), [], {}, dict(config.params)
    start_method = lr.start_method or "yarn"
    start_factors(start_method, config.factor, dim, base, L)  # an unknown or dynamic method fails here
    cma = {k: v for k, v in dataclasses.asdict(lr).items() if k != "space"}
    return {**cma, "start_method": start_method}, [], {}, dict(config.params)


def critical_settings(lr: LongropeOptions, config, dim: int, base: float, L: int) -> dict:
    """search.json's longrope record of LongRoPE2's space: the options and the critical dimensions tried."""
    if lr.start_method is not None:
        raise CtxextError(
            "--longrope-start does not apply to --space critical: it starts from the theoretical critical dimension"
        )
    space = critical_space(dim, base, config.factor, L, lr.knots, lr.upper)  # no room for a critical dimension
    return {
        "space": "critical",
        "start_method": "critical",  # the start: d_tcd, every factor above it s, NTK below
        "knots": lr.knots,
        "sigma": lr.sigma,
        "upper": lr.upper,
        "popsize": lr.popsize,
        "theoretical_critical_dim": space.start,
        "critical_dims": [space.low, space.high],
    }


def scalar_space(request: SearchRequest, spec, config, base: float, L: int):
    """(no longrope settings, the ranges, trial 0's given values, the fixed parameters) of a TPE search."""
    counts = {k: len(v) for k, v in config.params.items() if isinstance(v, list)}
    space = build_space(
        spec,
        {"factor": config.factor, "L": L, "base": base},
        request.params,
        request.space,
        source=request.space_source,
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
    return None, space, start, fixed


def split_documents(request: SearchRequest, documents: list, bos_id: int | None) -> tuple[list, list]:
    """(calibration, held-out): the first long-enough documents, then the next ones (up to 3 by default)."""
    span = text_tokens_per_window(request.length, bos_id)
    usable = [d for d in documents if len(d) >= span]
    if len(usable) < request.calibration_docs:
        longest = max((len(d) for d in documents), default=0)
        raise CtxextError(
            f"{len(usable)} of {len(documents)} documents hold the {span} tokens a {request.length}-token window "
            f"needs (the longest has {longest}); --calibration-docs wants {request.calibration_docs}"
        )
    calibration, rest = usable[: request.calibration_docs], usable[request.calibration_docs :]
    if request.held_out is not None and len(rest) < request.held_out:
        raise CtxextError(
            f"--held-out {request.held_out}: only {len(rest)} long-enough documents are left after the "
            f"{len(calibration)} calibration documents"
        )
    return calibration, rest[: 3 if request.held_out is None else request.held_out]


def plan_search(request: SearchRequest) -> SearchPlan:
    """The plan of a search, or a one-line CtxextError; loads the config, tokenizer and documents, no weights."""
    check_packages()
    check_request(request)
    request = dataclasses.replace(request, objective=default_objective(request.objective, request.longrope.space))
    model_config = load_config(request.model)
    config, L = resolve_method(request, model_config)
    spec = get_method(config.method)
    record = rope_record(model_config)
    dim, base = record.rotary_dim, record.base  # the full-attention layers' (Gemma 3: 1e6, not its sliding 1e4)
    if spec.name == "longrope":
        longrope, space, start, fixed = longrope_space(request, config, dim, base, L)
    elif request.longrope.space != "cma":
        raise CtxextError(
            f"--space {request.longrope.space} is a LongRoPE search space: it needs --method longrope "
            f"(got '{spec.name}')"
        )
    else:
        longrope, space, start, fixed = scalar_space(request, spec, config, base, L)
    selection = pair_selection(request, config, dim, L)
    base_mapping = {"method": config.method, "factor": config.factor, "original_max_position_embeddings": L}
    method_config({**base_mapping, "logn": config.logn, **fixed}, start)  # trial 0 must be a valid configuration
    tokenizer = load_tokenizer(request.model)
    bos_id, _ = bos_choice(request.runtime.bos, tokenizer)
    calibration, held_out = split_documents(request, request.data.load(tokenizer).documents, bos_id)
    passkey = None
    if request.objective != "ppl":
        passkey = {"trials": request.passkey_trials, "depths": sorted(set(request.passkey_depths))}
    runtime = request.runtime
    resolved = inference_runtime(
        runtime.device,
        runtime.dtype,
        runtime.attn_implementation,
        Processes(cpu=runtime.device == "cpu" or None, tp=runtime.tp),
        runtime.placement,
    )
    if runtime.placement is not None:  # a bad map fails here, before the study is written
        check_placement(runtime.placement, model_config)
    settings = _settings(request, config, L, fixed, start, space, longrope, passkey, resolved, calibration, held_out)
    settings = dataclasses.replace(settings, pair_selection=selection)
    return SearchPlan(
        request=request,
        settings=settings,
        calibration=calibration,
        held_out=held_out,
        passkey_trials=plan_trials([request.length], passkey["depths"], passkey["trials"], request.seed)
        if passkey
        else [],
        tokenizer=tokenizer,
        bos_id=bos_id,
        runtime=resolved,
        protected=[p for p in [request.model] if Path(p).exists()] + request.data.local_paths(),
    )


def pair_selection(request: SearchRequest, config, dim: int, L: int) -> dict | None:
    """search.json's record of DPE's --select-pairs/--top-pairs (the pairs themselves are measured on the loaded
    model: ctxext.search.workflow.with_selected_pairs), or None; a one-line error for a bad selection."""
    chosen = check_pair_selection(request.select_pairs, request.top_pairs, config.method, config.params)
    if chosen is None:
        return None
    check_top_pairs(chosen[1], dim // 2)
    return selection_record(*chosen, L)


def _settings(request, config, L, fixed, start, space, longrope, passkey, runtime, calibration, held_out):
    return SearchSettings(
        model=str(request.model),
        method=config.method,
        factor=float(config.factor),
        length=request.length,
        original_max_position_embeddings=L,
        logn=config.logn,
        fixed=fixed,
        start=start,
        space=space,
        objective=request.objective,
        stride=request.stride,
        seed=request.seed,
        startup_trials=request.startup_trials,
        longrope=longrope,
        passkey=passkey,
        dtype=str(runtime["dtype"]).removeprefix("torch."),
        data={
            name: {"documents": [d.name for d in docs], "tokens_sha256": tokens_fingerprint(d.ids for d in docs)}
            for name, docs in (("calibration", calibration), ("held_out", held_out))
        },
    )
