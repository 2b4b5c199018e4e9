"""A compare request's plan: every check that needs no weights, so bad input fails before anything is written.

`plan_compare(request)` reads the model's config, the tokenizer and the documents, and returns the `ComparePlan`:
L, the lengths past it, the methods that apply (and why the others do not), the calibration and held-out documents
(never mixed), BOS, the runtime, the cells' context, and an estimate of what the screen costs (for --budget).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers.utils import cached_file

from ..config import MethodConfig
from ..cost import prefill_flops
from ..dispatch import check_placement
from ..errors import CtxextError
from ..eval.perplexity import text_tokens_per_window
from ..eval.session import bos_choice
from ..loading import check_model_source, load_config, load_tokenizer
from ..methods import METHODS, get_method
from ..outputs import check_output_dir, check_overlap, content_fingerprint
from ..patching.applicable import skeleton, why_not
from ..patching.families import check_supported
from ..patching.record import rope_record
from ..runtime import Processes, inference_runtime
from ..search.objective import check_objective
from ..search.space import searchable_fields
from .report import RESULTS_FILE
from .request import NEEDS_FINE_TUNING, PRESETS, CompareRequest, format_seconds, parse_write_best
from .searches import search_start
from .serving import engine_support
from .tasks import check_tasks

NONE = "none"  # the unpatched model at each length: a row of every table (and the cost reference)
EFFICIENCY = 0.5  # the share of a matmul's FLOP/s a forward pass is assumed to reach, for the --budget estimate


@dataclass
class ComparePlan:
    request: CompareRequest
    model_config: object
    L: int
    base: float
    rotary_dim: int
    lengths: list[int]
    methods: list[str]  # the methods compared, 'none' first
    excluded: dict[str, str]  # method -> why it does not apply to this model or was not asked for
    tokenizer: object
    bos_id: int | None
    calibration: list  # Documents: searches only
    held_out: list  # Documents: the table only
    data: dict  # where the documents came from (DocumentSet.describe()) and the split
    runtime: dict  # device, dtype, attn_implementation, dtype_reason
    dtype_label: str  # bf16 | fp32 | fp16: the cells' key
    fingerprint: str  # the model, for the cells' key
    passkey_lengths: list[int]
    write_best: tuple[str, Path] | None
    estimate: dict = field(default_factory=dict)  # seconds: screen, forward at each length, how estimated
    task_specs: list = field(default_factory=list)  # --tasks as lm-eval knows them (ctxext.tasks.harness.TaskSpec)
    processes: object = None  # ctxext.runtime.Processes: this process among those `accelerate launch` started

    @property
    def searchable(self) -> list[str]:
        return [m for m in self.methods if is_searchable(m)]


# --------------------------------------------------------------------------------------------- methods
def default_config(method: str, length: int, L: int) -> dict | None:
    """A method's configuration at its defaults for `length` (s = length / L); None where it has no default."""
    if method == NONE:
        return {"method": NONE}
    if method == "theta":
        return None  # 'new_base' is required: the search starts where NTK-aware puts it
    return {"method": method, "factor": length / L}


def is_searchable(method: str) -> bool:
    """Whether the method declares a parameter to search beyond the factor (longrope: its per-pair factors)."""
    if method == "longrope":
        return True
    if method == NONE:
        return False
    return any("search" in f.metadata for f in searchable_fields(get_method(method)).values())


def why_not_applicable(method: str, frame, lengths: list[int], L: int, dim: int, base: float) -> str | None:
    """Why `method` cannot run on this model at these lengths, or None: the checks `patch` makes, asked of `frame`,
    the model's meta-device skeleton (its families, layer types, layout and shape)."""
    if method == NONE:
        return None
    for length in lengths:
        mapping = default_config(method, length, L) or search_start(method, length, L, dim, base)
        try:
            config = MethodConfig.from_mapping(mapping)
        except CtxextError as error:
            return str(error)
        reason = why_not(frame, method, config.factor, None, L, **config.params)
        if reason is not None:
            return reason
    return None


def select_methods(
    asked: list[str] | None, model_config, lengths: list[int], L: int, dim: int, base: float
) -> tuple[list[str], dict[str, str]]:
    """(the methods compared, 'none' first; {method: why not}) for --methods `asked` (None: every one that applies)."""
    frame = skeleton(model_config)
    excluded = {}
    applicable = []
    for method in METHODS:
        reason = why_not_applicable(method, frame, lengths, L, dim, base)
        if reason is None:
            applicable.append(method)
        else:
            excluded[method] = f"does not apply to this model: {reason}"
    chosen = []
    for item in asked or ["all"]:
        if item in PRESETS:
            for method in applicable:
                reason = preset_excludes(item, method, model_config, lengths, L, engine_support)
                if reason is None:
                    chosen.append(method)
                else:
                    excluded.setdefault(method, reason)
        elif item in applicable:
            chosen.append(item)
        else:
            raise CtxextError(f"--methods {item}: {excluded[item]}")
    chosen = list(dict.fromkeys([NONE, *chosen]))
    for method in METHODS:
        if method not in chosen:
            excluded.setdefault(method, "not asked for (--methods)")
    for method in chosen:
        excluded.pop(method, None)
    return chosen, excluded


def preset_excludes(preset: str, method: str, model_config, lengths, L, engine_support) -> str | None:
    if preset == "all" or method == NONE:
        return None
    if preset == "training-free":
        return NEEDS_FINE_TUNING.get(method)
    engine = preset.split(":", 1)[1]
    for length in lengths:
        config = default_config(method, length, L)
        if config is None:
            return f"{preset}: no configuration at its defaults to serve"
        level = engine_support(config, model_config, L)[engine]
        if level["level"] != "exact":
            return f"{preset}: {level['level']} ({level['how']})"
    return None


# ------------------------------------------------------------------------------------------------ data
def document_matches(doc, name: str) -> bool:
    return name in (doc.name, Path(doc.name).name, Path(doc.name).stem)


def pick(documents: list, names: list[str], flag: str, span: int, length: int) -> list:
    chosen = []
    for name in names:
        found = [d for d in documents if document_matches(d, name)]
        if not found:
            raise CtxextError(
                f"{flag} '{name}' is not among the documents ({', '.join(d.name for d in documents[:8])}"
                f"{', ...' if len(documents) > 8 else ''})"
            )
        if len(found[0]) < span:
            raise CtxextError(
                f"{flag} '{name}' has {len(found[0])} tokens; a {length}-token window needs {span} of them"
            )
        chosen.append(found[0])
    return chosen


def split_documents(request: CompareRequest, documents: list, bos_id: int | None) -> tuple[list, list]:
    """(calibration, held-out): named, or the first `calibration_docs` long-enough documents and the next
    `held_out_docs`; never the same document in both, and at least one held-out document."""
    longest = max(request.lengths)
    span = text_tokens_per_window(longest, bos_id)
    usable = [d for d in documents if len(d) >= span]
    if request.calibration is not None:
        calibration = pick(documents, request.calibration, "--calibration", span, longest)
    else:
        calibration = usable[: request.calibration_docs]
    if not calibration and request.search:
        raise CtxextError(
            f"no calibration text: none of the {len(documents)} documents holds the {span} tokens a {longest}-token "
            f"window needs (the longest has {max(len(d) for d in documents)})"
        )
    if request.held_out is not None:
        held_out = pick(documents, request.held_out, "--held-out", span, longest)
    else:
        held_out = [d for d in usable if all(d is not c for c in calibration)][: request.held_out_docs]
    shared = [d.name for d in held_out if any(d is c for c in calibration)]
    if shared:
        raise CtxextError(f"'{shared[0]}' is both calibration and held-out text; the two must never be mixed")
    if not held_out:
        raise CtxextError(
            f"no held-out text left after the split: {len(usable)} of {len(documents)} documents hold the {span} "
            f"tokens a {longest}-token window needs, and calibration takes {len(calibration)} of them (add "
            "documents, or name them with --calibration/--held-out)"
        )
    return calibration, held_out


# ------------------------------------------------------------------------------------------- estimates
def measured_flops(device, dtype, seconds: float = 0.2) -> float:
    """FLOP/s of square matmuls in `dtype` on `device`, measured for about `seconds`."""
    n = 512
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    (a @ b).sum().item()  # warm up
    count, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds:
        c = a @ b
        count += 1
    c.sum().item()
    return 2 * n**3 * count / (time.perf_counter() - started)


def screen_forwards(plan_values: dict) -> dict[int, float]:
    """length -> how many forward passes of that length the screen and the defaults table take."""
    v = plan_values
    needle = v["needle_prompts"] if "needle" in v["objective"] else 0
    calibration = 1 if v["objective"] != "needle-ppl" else 0
    out = {}
    for length in v["lengths"]:
        native_windows = max(1, math.ceil((length - v["L"]) / (v["L"] // 2)) + 1) * v["L"] / length
        out[length] = (
            v["searchable"] * (calibration + needle)  # the screen: each searchable method's defaults
            + v["methods"] * (v["held_out"] + v["passkey"])  # the defaults rows of the table
            + v["held_out"] * native_windows  # native
        )
    return out


def passkey_seconds(plan: ComparePlan, length: int, trials: int) -> float:
    """What `trials` passkey trials at `length` are estimated to take: one forward pass each, as `screen_forwards`
    counts them, at the estimate's seconds per forward (FLOPs over the measured rate); the decide stage's cost."""
    return trials * plan.estimate["forward_seconds"][length]


def estimate_screen(plan: ComparePlan, throughput: float) -> dict:
    values = {
        "objective": plan.request.objective,
        "needle_prompts": len(plan.request.passkey_depths),
        "lengths": plan.lengths,
        "L": plan.L,
        "searchable": len(plan.searchable) if plan.request.search else 0,
        "methods": len([m for m in plan.methods if default_config(m, plan.lengths[0], plan.L) is not None]),
        "held_out": len(plan.held_out),
        "passkey": len(plan.request.passkey_depths) * plan.request.passkey_trials,
    }
    forwards = screen_forwards(values)
    per_forward = {n: prefill_flops(plan.model_config, n) / (throughput * EFFICIENCY) for n in plan.lengths}
    return {
        "screen_seconds": sum(forwards[n] * per_forward[n] for n in plan.lengths),
        "forward_seconds": per_forward,
        "how": f"estimated from FLOPs: {throughput / 1e9:.0f} GFLOP/s measured on a matmul here, "
        f"{EFFICIENCY:.0%} of it assumed for a forward pass",
    }


# ------------------------------------------------------------------------------------------------ plan
TP_REFUSAL = (
    "--tp {tp}: compare shares its cells among the launched processes and runs its searches on the first process "
    "while the others wait, but tensor-parallel processes must each run every forward; use `ctxext eval --tp` and "
    "`ctxext search --tp` (which do), or compare a model larger than one device with --device-map"
)


def check_request(request: CompareRequest) -> None:
    if request.runtime.tp > 1:
        raise CtxextError(TP_REFUSAL.format(tp=request.runtime.tp))
    check_objective(request.objective)
    if not request.lengths:
        raise CtxextError("--lengths: give at least one length, e.g. 16k,32k")
    if request.max_passkey_trials < 0:
        raise CtxextError(f"--max-passkey-trials must be 0 (no added trials) or more, got {request.max_passkey_trials}")
    for name in ("calibration_docs", "held_out_docs", "passkey_trials"):
        if getattr(request, name) < 1:
            raise CtxextError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(request, name)}")
    if request.trials is not None and request.trials < 1:
        raise CtxextError(f"--trials must be at least 1, got {request.trials}")
    if not request.passkey_depths:
        raise CtxextError("--passkey-depths: give at least one depth")
    if request.full_searches and request.budget is not None:
        raise CtxextError("--budget cuts the screen and successive halving; --full-search runs every search in full")
    if request.output is None and request.page is None:
        raise CtxextError("give -o/--output (the report) or --page (the one-page layout), or both")
    if request.output is None and request.write_best is not None:
        raise CtxextError("--write-best needs -o/--output (the recommendation's method file is written there)")
    if request.output is None and request.cache is None:
        raise CtxextError("--page without -o/--output: give --cache, where the cells and searches are kept")
    if request.task_limit is not None and request.task_limit < 1:
        raise CtxextError(f"--task-limit must be at least 1, got {request.task_limit}")
    if request.task_limit is not None and not request.tasks:
        raise CtxextError("--task-limit limits the samples of --tasks; give --tasks too")
    if request.page is not None and Path(request.page).suffix != ".md":
        raise CtxextError(
            f"--page must name a .md file (its .json and .png are written beside it), got '{request.page}'"
        )
    check_page_notes(request)


def check_page_notes(request) -> None:
    if request.page_notes is None:
        return
    if request.page is None:
        raise CtxextError("--page-notes goes under the page's table: give --page too")
    if not Path(request.page_notes).is_file():
        raise CtxextError(f"--page-notes: no such file '{request.page_notes}' (a markdown file of notes on rows)")


def check_lengths(lengths: list[int], L: int) -> None:
    low = [n for n in lengths if n <= L]
    if low:
        raise CtxextError(
            f"compare is for lengths past the model's trained L = {L}; {low[0]} is not above it "
            f"(ctxext eval scores any length, the unpatched model included)"
        )


def check_passkey_lengths(asked: list[int] | None, lengths: list[int], L: int) -> None:
    for n in asked or []:
        if n != L and n not in lengths:
            raise CtxextError(
                f"--passkey-lengths {n}: each must be L = {L} (the unpatched model only: the baseline) or one of "
                f"--lengths ({', '.join(str(m) for m in lengths)})"
            )


def check_output(request: CompareRequest, protected: list) -> None:
    out = check_overlap(request.output, protected)
    if out.is_dir() and any(out.iterdir()) and not (out / RESULTS_FILE).is_file() and not (out / "cells").is_dir():
        raise CtxextError(
            f"output directory '{out}' exists and holds something other than a compare; choose another -o/--output"
        )


def model_fingerprint(name: str) -> str:
    """The model, as the cells' key names it: a local checkpoint by its content, a hub id by its revision."""
    path = Path(name).expanduser()
    if path.is_dir():
        return content_fingerprint(path)
    try:
        snapshot = Path(cached_file(name, "config.json")).parent
        return f"{name}@{snapshot.name}"
    except Exception:  # noqa: BLE001 - any hub failure: name it by its id alone
        return name


def dtype_label(dtype) -> str:
    return {"bfloat16": "bf16", "float32": "fp32", "float16": "fp16"}[str(dtype).removeprefix("torch.")]


def plan_compare(request: CompareRequest, measure=measured_flops) -> ComparePlan:
    """The plan of a compare, or a one-line CtxextError; reads the config, tokenizer and documents, no weights."""
    check_request(request)
    write_best = parse_write_best(request.write_best)
    check_model_source(request.model)
    model_config = load_config(request.model)
    check_supported(model_config, f"'{request.model}' (model type '{model_config.model_type}')")
    record = rope_record(model_config)
    L, dim, base = record.trained_context, record.rotary_dim, record.base  # extensions count from C
    lengths = sorted(set(request.lengths))
    check_lengths(lengths, L)
    methods, excluded = select_methods(request.methods, model_config, lengths, L, dim, base)
    task_specs = check_tasks(request.tasks, lengths) if request.tasks is not None else []
    tokenizer = load_tokenizer(request.model)
    bos_id, _ = bos_choice(request.runtime.bos, tokenizer)
    documents = request.data.load(tokenizer)
    calibration, held_out = split_documents(request, documents.documents, bos_id)
    check_outputs(request, write_best)
    rt = request.runtime
    processes = Processes(cpu=rt.device == "cpu" or None)
    runtime = inference_runtime(rt.device, rt.dtype, rt.attn_implementation, processes, rt.placement)
    if rt.placement is not None:  # a bad map fails here, before any cell or search is written
        check_placement(rt.placement, model_config)
    check_passkey_lengths(request.passkey_lengths, lengths, L)
    plan = ComparePlan(
        request=request,
        model_config=model_config,
        L=L,
        base=base,
        rotary_dim=dim,
        lengths=lengths,
        methods=methods,
        excluded=excluded,
        tokenizer=tokenizer,
        bos_id=bos_id,
        calibration=calibration,
        held_out=held_out,
        data={
            **{k: v for k, v in documents.describe().items() if k != "document_tokens"},
            "calibration": [d.name for d in calibration],
            "held_out": [d.name for d in held_out],
        },
        runtime=runtime,
        dtype_label=dtype_label(runtime["dtype"]),
        fingerprint=model_fingerprint(request.model),
        passkey_lengths=sorted(set(request.passkey_lengths)) if request.passkey_lengths else [L, *lengths],
        write_best=write_best,
        task_specs=task_specs,
        processes=processes,
    )
    plan.estimate = estimate_screen(plan, measure(runtime["device"], runtime["dtype"]))
    check_budget_fits(request, plan.estimate)
    return plan


def check_outputs(request: CompareRequest, write_best) -> None:
    """-o, --page and --write-best: none overlaps an input, and -o and --write-best hold nothing else."""
    protected = [p for p in [request.model] if Path(p).exists()] + request.data.local_paths()
    if request.output is not None:
        check_output(request, protected)
    if request.page is not None:
        check_overlap(Path(request.page).parent, protected)
    if write_best is not None:
        check_output_dir(write_best[1], protected)


def check_budget_fits(request: CompareRequest, estimate: dict) -> None:
    """A --budget that cannot fit even the screen is refused, with the time it needs."""
    if request.budget is not None and not request.report_only and estimate["screen_seconds"] > request.budget:
        raise CtxextError(
            f"--budget {format_seconds(request.budget)} cannot fit even the screen (every method at its defaults on "
            f"the calibration slice, and the table's defaults rows): it needs about "
            f"{format_seconds(estimate['screen_seconds'])} here ({estimate['how']})"
        )
