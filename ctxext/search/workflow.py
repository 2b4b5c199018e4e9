"""`run_search(request)`: one search end to end, the library behind `ctxext search`.

plan (no model) -> output directory -> the study -> trials (this process and `workers - 1` more on this machine;
any other process on the same storage and study joins in) -> held-out re-scoring -> checkpoint -> results.json,
trials.jsonl and the plots. The returned `SearchResult` carries the settings (search.json) and results.json.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from ..checkpoint import write_patched_checkpoint
from ..errors import CtxextError
from ..loading import load_config, load_model
from ..methods import get_method
from ..outputs import provenance, write_json
from ..patching import pair_selection
from ..patching.record import model_rope_record, rope_record
from . import output
from .longrope import critical_space, start_factors
from .loop import best_trial, critical_search, longrope_search, scalar_search
from .objective import method_config
from .output import SearchSettings
from .plan import SearchPlan, SearchRequest, plan_search
from .space import element_default
from .store import TrialStore, read_trials, storage_url
from .tensor_parallel import Leader, follow, held_out_scorer, make_objective, tensor_parallel_processes


@dataclass
class SearchResult:
    """A finished search: where it was written, its settings (its protocol), results.json and every trial."""

    output: Path
    settings: object  # output.SearchSettings
    results: dict
    history: list[dict] = field(default_factory=list)
    resumed: bool = False

    @property
    def protocol(self) -> dict:
        return self.settings.to_dict()


def run_search(
    request: SearchRequest, log: Callable[[str], None] | None = None, model=None, leader: Leader | None = None
) -> SearchResult | None:
    """Plan, search and write the results of `request`; `log` receives a few lines of progress. `model`: the model
    already loaded as the request's runtime asks (`ctxext compare` runs many searches on one model); None loads it.
    Under --tp N (request.runtime.tp) the processes search together (ctxext.search.tensor_parallel): the first one
    returns the result, the others None."""
    if request.runtime.tp > 1 and leader is None:
        return run_tensor_parallel_search(request, log)
    started = time.perf_counter()
    say = log or (lambda line: None)
    plan = plan_search(request)  # every check that needs no model: bad input fails here, before anything is written
    out = Path(request.output)
    settings = plan.settings.to_dict()
    mode = output.check_output(out, settings, request.resume, request.overwrite, plan.protected)
    study = {"storage": storage_url(request.storage, out) if request.storage else None, "name": request.study_name}
    output.check_study(out, study, mode)
    store = open_store(request, settings) if request.storage else None  # a study elsewhere is checked first
    model = model if model is not None else load_search_model(plan)
    output.start_output(out, settings, mode)
    write_json(out / output.STUDY_FILE, study)
    store = store or open_store(request, settings)
    if not store.frozen() and (out / output.TRIALS_FILE).is_file():
        store.import_records(read_trials(out / output.TRIALS_FILE))  # a search from before the studies
    plan = with_selected_pairs(plan, model, store)
    if plan.settings.selected_pairs is not None:
        write_json(out / output.SEARCH_FILE, plan.settings.to_dict())  # search.json records the pairs measured
    store.export_to = out / output.TRIALS_FILE
    say(header(plan, mode))
    history = run_with_workers(plan, model, store, leader)
    best = best_trial(history)
    if best is None:
        raise CtxextError(f"no trial of the search in '{out}' gave a score (see {output.TRIALS_FILE})")
    store.export(out / output.TRIALS_FILE)
    held_out = {}
    if plan.held_out:
        say(f"re-scoring on {len(plan.held_out)} held-out documents ...")
        score = held_out_scorer(plan, model, request.baseline)
        held_out = score(history) if leader is None else leader.held_out(history, score)
    if leader is not None:
        leader.stop()  # nothing below runs the model
    del model  # the checkpoint is written from the source's weights
    checkpoint = write_checkpoint(plan, best, out) if request.checkpoint else None
    results = write_results(plan, store, history, held_out, checkpoint, time.perf_counter() - started)
    return SearchResult(out, plan.settings, results, history, resumed=mode == "resume")


def run_tensor_parallel_search(request: SearchRequest, log: Callable[[str], None] | None) -> SearchResult | None:
    """`--tp N`: every process loads its shard of the model; the first searches (`Leader`), the others score what
    it scores (`follow`) until it is done, also when it fails."""
    processes = tensor_parallel_processes(request)
    plan = plan_search(request)
    model = load_search_model(plan)
    if not processes.is_main:
        follow(processes, plan, model)
        return None
    leader = Leader(processes)
    try:
        return run_search(request, log, model=model, leader=leader)
    finally:
        leader.stop()


def open_store(request: SearchRequest, settings: dict) -> TrialStore:
    return TrialStore.open(storage_url(request.storage, request.output), request.study_name, settings)


def load_search_model(plan: SearchPlan):
    runtime = plan.runtime
    return load_model(
        plan.request.model,
        dtype=runtime["dtype"],
        device=runtime["device"],
        attn_implementation=runtime["attn_implementation"],
        progress=plan.request.runtime.progress,
        placement=runtime["placement"],
        tp=runtime["tp"],
    )


def with_selected_pairs(plan: SearchPlan, model, store) -> SearchPlan:
    """The plan with DPE's selected pairs (--select-pairs/--top-pairs), measured on the unpatched `model` by the
    first process of the study and kept there, so every worker and every resume uses that one measurement."""
    selection = plan.settings.pair_selection
    if selection is None:
        return plan
    if PAIRS_ATTR not in store.study.user_attrs:
        text = Path(selection["text"]).read_text(encoding="utf-8")
        chosen = pair_selection.select_pairs(
            model, plan.tokenizer, text, selection["top_pairs"], selection["max_tokens"]
        )
        store.study.set_user_attr(PAIRS_ATTR, chosen)
    settings = dataclasses.replace(plan.settings, selected_pairs=store.study.user_attrs[PAIRS_ATTR])
    return dataclasses.replace(plan, settings=settings)


PAIRS_ATTR = "ctxext_selected_pairs"  # the study's user attribute with DPE's selected pairs


def header(plan: SearchPlan, mode: str) -> str:
    settings, request = plan.settings, plan.request
    text = (
        f"ctxext search: {settings.method} x{settings.factor:g} at {settings.length} tokens (L = "
        f"{settings.original_max_position_embeddings}), objective {settings.objective}, {request.trials} trials"
        f"{' (resumed)' if mode == 'resume' else ''}; calibration: {', '.join(d.name for d in plan.calibration)}"
        f"; held out: {', '.join(d.name for d in plan.held_out) or 'none'}; {settings.dtype} on "
        f"{plan.runtime['device']}"
    )
    if request.workers > 1:
        text += f"; {request.workers} workers"
    if settings.space:
        text += "\n  space: " + ", ".join(f"{r.name} {r.describe()}" for r in settings.space)
    return text


def search_trials(plan: SearchPlan, model, store, progress=None, leader: Leader | None = None) -> list[dict]:
    """This process's share of the trials: until the study has the requested number finished. With a `leader`
    (--tp), the other processes score each trial too."""
    settings = plan.settings
    objective = make_objective(plan, model)
    if leader is not None:
        objective = leader.objective(objective)
    record = model_rope_record(model)
    return run_trials(settings, objective, store, plan.request.trials, record.rotary_dim, record.base, progress)


def run_trials(settings: SearchSettings, objective, store, trials: int, rotary_dim: int, base: float, progress=None):
    """Run (or join, or continue) the search in `store` until `trials` trials are finished; every finished trial."""
    if settings.method == "longrope" and settings.longrope.get("space") == "critical":
        lr = settings.longrope
        space = critical_space_of(settings, rotary_dim, base)
        return critical_search(space, objective, store, trials, settings.seed, lr["sigma"], lr.get("popsize"), progress)
    if settings.method == "longrope":
        start, defaults, upper = longrope_curves(settings, rotary_dim, base)
        lr = settings.longrope
        return longrope_search(
            start, defaults, objective, store, trials, settings.seed, lr["knots"], lr["sigma"], upper,
            lr.get("popsize"), progress,
        )  # fmt: skip
    start = {r.name: settings.start.get(r.name, _default(settings.method, r.name)) for r in settings.space}
    return scalar_search(
        settings.space, start, objective, store, trials, settings.seed, settings.startup_trials, progress
    )


def _default(method_name: str, name: str):
    return element_default(get_method(method_name), name)


def longrope_curves(settings: SearchSettings, rotary_dim: int, base: float):
    """(starting factors, the defaults' factors, the upper bound) of a LongRoPE search."""
    lr = settings.longrope
    L, s = settings.original_max_position_embeddings, settings.factor
    if lr.get("space") == "critical":
        space = critical_space_of(settings, rotary_dim, base)
        return space.factors_of(np.zeros(space.dimension))[1], [float(s)] * (rotary_dim // 2), space.upper
    start = np.maximum.accumulate(start_factors(lr["start_method"], s, rotary_dim, base, L))
    upper = float(lr.get("upper") or max(2.0 * s, float(start.max())))
    return start, [float(s)] * (rotary_dim // 2), upper


def critical_space_of(settings: SearchSettings, rotary_dim: int, base: float):
    """LongRoPE2's space (`ctxext.search.longrope.CriticalSpace`) of a `--space critical` search."""
    lr = settings.longrope
    L = settings.original_max_position_embeddings
    return critical_space(rotary_dim, base, settings.factor, L, lr["knots"], lr.get("upper"))


def run_with_workers(plan: SearchPlan, model, store, leader: Leader | None = None) -> list[dict]:
    """The trials, run here and in `workers - 1` more processes (spawned: each loads the model itself)."""
    request = plan.request
    context = multiprocessing.get_context("spawn")
    helpers = [context.Process(target=run_worker, args=(request,)) for _ in range(request.workers - 1)]
    for helper in helpers:
        helper.start()
    progress = _progress(request, plan.settings.method)
    try:
        search_trials(plan, model, store, progress, leader)
    except BaseException:
        for helper in helpers:
            helper.terminate()  # their running trials are queued again when the search resumes
        raise
    finally:
        if progress is not None:
            progress.close()
        for helper in helpers:
            helper.join()
    failed = [h.exitcode for h in helpers if h.exitcode != 0]
    if failed:
        raise CtxextError(f"{len(failed)} of the {len(helpers)} other workers stopped with an error (see above)")
    return store.history()


def run_worker(request: SearchRequest) -> None:
    """A spawned worker: the same plan, its own model, trials of the same study until the search has its trials;
    an error is one line on stderr and exit code 2."""
    try:
        plan = plan_search(request)
        model, store = load_search_model(plan), open_store(request, plan.settings.to_dict())
        search_trials(with_selected_pairs(plan, model, store), model, store)
    except CtxextError as error:
        print(f"ctxext: error: {error}", file=sys.stderr, flush=True)
        sys.exit(2)


def _progress(request: SearchRequest, method: str):
    if not request.runtime.progress:
        return None

    return tqdm(total=request.trials, unit="trial", desc=f"{method} search", dynamic_ncols=True, file=sys.stderr)


def write_checkpoint(plan: SearchPlan, best: dict, out: Path) -> dict:
    """The best trial's parameters as a checkpoint in OUT/checkpoint (the code of `ctxext patch`)."""
    settings = plan.settings
    written = write_patched_checkpoint(
        plan.request.model,
        method_config(settings.base, best["params"]),
        out / output.CHECKPOINT_DIR,
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
    return {
        "path": str(written.output),
        "rope_type": written.form.rope_parameters["rope_type"],
        "written_as": written.form.how,
        "loads_in_plain_transformers": written.loads_in_plain_transformers,
    }


def write_results(plan: SearchPlan, store, history, held_out: dict, checkpoint, seconds: float) -> dict:
    """results.json, objective.png and (longrope) factors.png; returns results.json's content."""
    settings, out = plan.settings, Path(plan.request.output)
    results = output.summarize(settings, history, held_out, seconds, provenance(), checkpoint)
    results["study"] = {"storage": store.url, "name": store.study.study_name}
    write_json(out / output.RESULTS_FILE, results)
    title = (
        f"{Path(plan.request.model).name}: {settings.method} x{settings.factor:g} at {settings.length} "
        f"(L={settings.original_max_position_embeddings})"
    )
    output.plot_objective(history, out / output.OBJECTIVE_PLOT, title, settings.objective)
    if settings.method == "longrope":
        best = results["best"]
        pairs = len(best["params"]["long_factor"])
        start, defaults, _ = longrope_curves(settings, 2 * pairs, _rope_base(plan.request.model))
        curves = {
            "defaults (every pair / s)": defaults,
            f"start ({settings.longrope['start_method']})": [float(f) for f in start],
            f"best (trial {best['number']})": best["params"]["long_factor"],
        }
        output.plot_factors(curves, out / output.FACTORS_PLOT, title)
    return results


def _rope_base(model: str) -> float:
    return rope_record(load_config(model)).base
