"""The bridge to lm-evaluation-harness: its tasks, run on a model that ctxext patched in memory.

One *cell* is one (method, task, length): the model is patched with the method, wrapped in lm-eval's `HFLM`,
and `lm_eval.simple_evaluate` runs the task with the length in the task's metadata, exactly as a user of
lm-eval would call it. `simple_evaluate` seeds Python's, NumPy's and torch's generators itself before it builds
the task, so RULER's synthetic prompts are the same for every method. Each cell's result is cached on disk
as soon as it is done, so an interrupted run resumes and a table can grow over several runs.

lm-eval is an optional dependency (`pip install "ctxext[tasks]"`): it is imported inside the functions here.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import importlib
import io
import json
import logging
import random
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy
import torch
from accelerate import Accelerator

from ..errors import CtxextError, did_you_mean, first_line
from ..extras import EXTRAS
from ..outputs import CellCache

INSTALL_HINT = EXTRAS["tasks"].install
# HFLM left-truncates a prompt to max_length minus the task's generation budget. RULER sizes its prompts so that
# prompt + generation fits the length; this margin keeps a BOS or a tokenizer difference from cutting the prompt.
GENERATION_MARGIN = 256
# lm-eval's RULER generators fail below a few hundred tokens (and ruler_vt does not finish at 400).
MIN_RULER_LENGTH = 1024
# Tasks whose data builders take the length from the metadata, by the folder lm-eval keeps them in.
LENGTH_CONVENTIONS = {"ruler": "RULER: max_seq_lengths=[N]", "babilong": "babilong: max_seq_lengths='Nk'"}


def import_lm_eval():
    """lm_eval, or a one-line error that says how to install it."""
    try:
        import lm_eval  # noqa: PLC0415 -- optional: tasks
        from lm_eval.models.huggingface import HFLM  # noqa: PLC0415, F401 -- optional: tasks; the wrapper every cell uses
    except ImportError as error:
        raise CtxextError(
            f"ctxext tasks needs lm-evaluation-harness, which is not installed "
            f"({first_line(error)}); install it with: {INSTALL_HINT}"
        ) from None
    return lm_eval


# ------------------------------------------------------------------------------------------------ tasks
@dataclass(frozen=True)
class TaskSpec:
    """A task (or group, or tag) name as lm-eval knows it, and how it takes a length (None: it does not)."""

    name: str
    convention: str | None


class TaskManagers:
    """lm-eval TaskManagers, one per metadata, kept for the whole process. A TaskManager builds fresh tasks at
    every load, so sharing one changes no result; indexing lm-eval's 14k task YAMLs takes 14 s on an idle core here
    (about a minute under load, in every `ctxext tasks` process), so the index is built once and each metadata gets a
    copy of the manager with its own task factory.

    Given the task `names` a run asks for, the index covers only the folders whose YAMLs define them (RULER's: well
    under a second), found by a plain text scan for `task: NAME`; where a name is not found that way (a group, a
    tag, a typo, which the did-you-mean needs the whole index for), lm-eval's whole index is built as before."""

    _by_metadata: dict[tuple, object] = {}  # (index folders, or None for the whole index; metadata) -> manager

    def __init__(self, names=()):
        self.folders = _task_folders(tuple(names))

    def get(self, metadata: dict):
        from lm_eval.tasks import TaskManager  # noqa: PLC0415 -- optional: tasks

        key = (self.folders, json.dumps(metadata, sort_keys=True))
        if key not in self._by_metadata:
            _drop_metadata_hint()
            base = self._base()
            self._by_metadata[key] = (_with_metadata(base, metadata) if base is not None else None) or TaskManager(
                metadata=metadata,
                **({} if self.folders is None else {"include_path": list(self.folders), "include_defaults": False}),
            )
        return self._by_metadata[key]

    def _base(self):
        return next((manager for (folders, _), manager in self._by_metadata.items() if folders == self.folders), None)

    def any(self):
        return self._base() or self.get({})


@functools.cache
def _task_folders(names: tuple[str, ...]) -> tuple[str, ...] | None:
    """The folders of lm-eval's task YAMLs that define every one of `names` as `task: NAME`, or None (a name not found
    so: a group, a tag, a task of another package, a typo)."""
    if not names:
        return None
    root = Path(importlib.import_module("lm_eval.tasks").__file__).parent
    pattern = re.compile(r"^task:\s*[\"']?([^\s\"'#]+)", re.MULTILINE)
    found: dict[str, str] = {}
    for path in root.rglob("*.yaml"):
        for match in pattern.finditer(path.read_text(encoding="utf-8", errors="replace")):
            if match.group(1) in names:
                found.setdefault(match.group(1), str(path.parent))
    return tuple(sorted(set(found.values()))) if set(found) == set(names) else None


def _with_metadata(manager, metadata: dict):
    """`manager` with its index and another metadata: what TaskManager(metadata=...) makes, without indexing
    again (lm-eval 0.4.13's layout; None if it differs, and a fresh TaskManager is built instead)."""
    try:
        from lm_eval.tasks._factory import TaskFactory  # noqa: PLC0415 -- optional: tasks

        if not hasattr(manager, "_factory"):
            return None
        view = copy.copy(manager)
        view.metadata = metadata
        view._factory = TaskFactory(meta=metadata)
        return view
    except (ImportError, TypeError):
        return None


class _MetadataHintFilter(logging.Filter):
    """lm-eval tells, at every task it builds from metadata, that metadata can be passed: ctxext passes it."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Custom kwargs can be passed to `--metadata`" not in record.getMessage()


def _drop_metadata_hint() -> None:
    logger = logging.getLogger("lm_eval.api.task")
    if not any(isinstance(f, _MetadataHintFilter) for f in logger.filters):
        logger.addFilter(_MetadataHintFilter())


def resolve_tasks(names: list[str], manager) -> list[TaskSpec]:
    """TaskSpecs for the names; an unknown name is a one-line error with the closest known name."""
    specs = []
    for name in names:
        entry = manager.task_index.get(name)
        if entry is None:
            raise CtxextError(
                f"unknown lm-eval task '{name}'{did_you_mean(name, manager.all_tasks)}; "
                f"`lm-eval ls tasks` lists them (ctxext runs any of them)"
            )
        specs.append(TaskSpec(name, _length_convention(name, manager)))
    return specs


def _length_convention(name: str, manager, seen: frozenset = frozenset()) -> str | None:
    entry = manager.task_index[name]
    if entry.yaml_path is not None:
        folder = Path(entry.yaml_path).parent.name
        return folder if folder in LENGTH_CONVENTIONS else None
    members = [m for m in sorted(entry.tags or ()) if m in manager.task_index and m not in seen]  # a tag
    conventions = {_length_convention(m, manager, seen | {name}) for m in members}
    return conventions.pop() if len(conventions) == 1 else None


def check_lengths(specs: list[TaskSpec], lengths: list[int]) -> None:
    for spec in specs:
        if spec.convention == "ruler" and lengths[0] < MIN_RULER_LENGTH:
            raise CtxextError(
                f"RULER tasks ({spec.name}) need --lengths of at least {MIN_RULER_LENGTH} tokens "
                f"(lm-eval cannot build shorter prompts), got {lengths[0]}"
            )
        if spec.convention == "babilong" and any(n % 1024 for n in lengths):
            raise CtxextError(
                f"babilong tasks ({spec.name}) come in lengths of whole thousands (1k = 1024 tokens: "
                f"4k, 8k, ...), got {', '.join(str(n) for n in lengths if n % 1024)}"
            )


def task_metadata(spec: TaskSpec, length: int | None, tokenizer_name: str) -> dict:
    """What lm-eval hands the task's data builder: the tokenizer (RULER sizes its prompts with it) and the length."""
    metadata = {"tokenizer": tokenizer_name, "pretrained": tokenizer_name}
    if spec.convention == "ruler":
        metadata["max_seq_lengths"] = [length]
    elif spec.convention == "babilong":
        metadata["max_seq_lengths"] = f"{length // 1024}k"
    return metadata


def task_lengths(spec: TaskSpec, lengths: list[int]) -> list[int | None]:
    return list(lengths) if spec.convention else [None]


def check_task_data(spec: TaskSpec, manager, length: int | None) -> None:
    """Build the task's data once (at the shortest length; one sample of a needle task), so that what cannot be
    fetched or built fails now, in one line, before any model runs. lm-eval's chatter while it builds goes
    nowhere unless it fails."""
    chatter = io.StringIO()
    try:
        with contextlib.redirect_stdout(chatter), contextlib.redirect_stderr(chatter), _lm_eval_logging(logging.ERROR):
            _seed_like_simple_evaluate()  # the data the first cell will build, not data from another seed
            with needle_samples_up_to(spec, 1):
                manager.load([spec.name])
    except ImportError as error:
        raise CtxextError(
            f"task '{spec.name}' needs a package that is not installed ({first_line(error)}); "
            f"{INSTALL_HINT} installs what the RULER tasks need"
        ) from None
    except OSError as error:  # ConnectionError, requests' errors, a missing file
        raise CtxextError(f"task '{spec.name}' needs data that could not be fetched: {fetch_failure(error)}") from None
    except (ValueError, KeyError, AssertionError, TypeError) as error:  # what lm-eval's task builders raise
        at = f" at length {length}" if length else ""
        raise CtxextError(
            f"lm-eval could not build task '{spec.name}'{at}: {type(error).__name__}: {first_line(error)}"
        ) from None


def _seed_like_simple_evaluate() -> None:
    from lm_eval.defaults import DEFAULT_OTHER_SEED, DEFAULT_RANDOM_SEED  # noqa: PLC0415 -- optional: tasks

    random.seed(DEFAULT_RANDOM_SEED)
    numpy.random.seed(DEFAULT_OTHER_SEED)
    torch.manual_seed(DEFAULT_OTHER_SEED)


# lm-eval 0.4.13's RULER needle tasks (niah_*) generate 500 samples at every length whatever the limit, and
# every cell builds its task again: at 64k a build takes minutes. The samples are drawn one after another from
# generators seeded just before the build, so a build of N samples gives the first N of the 500. Under a limit,
# ctxext asks RULER's needle generator for only those (tests/test_tasks.py checks the prompts against lm-eval's).
_NEEDLE_GENERATOR_MODULES = ("lm_eval.tasks.ruler.prepare_niah", "lm_eval.tasks.ruler.niah_utils")
_needle_samples_cap: int | None = None


def _builds_needles(spec: TaskSpec) -> bool:
    return spec.convention == "ruler" and not spec.name.startswith("ruler_")  # ruler_vt, ruler_cwe, ...: no needles


def _capped(generate):
    @functools.wraps(generate)
    def generate_samples(*args, **kwargs):
        if _needle_samples_cap is not None and "num_samples" in kwargs:
            kwargs["num_samples"] = min(kwargs["num_samples"], _needle_samples_cap)
        return generate(*args, **kwargs)

    generate_samples.ctxext_capped = True
    return generate_samples


@contextlib.contextmanager
def needle_samples_up_to(spec: TaskSpec, limit: int | None):
    """While it is open, RULER's needle tasks build only the first `limit` samples (all of them if None).
    The generator is wrapped once, where niah_utils finds it whether lm-eval has loaded that module yet or not;
    outside this context the wrapper passes every call through unchanged."""
    global _needle_samples_cap
    if limit is None or not _builds_needles(spec):
        yield
        return
    importlib.import_module(_NEEDLE_GENERATOR_MODULES[0])
    for name in _NEEDLE_GENERATOR_MODULES:
        module = sys.modules.get(name)
        generate = getattr(module, "generate_samples", None)
        if generate is not None and not getattr(generate, "ctxext_capped", False):
            module.generate_samples = _capped(generate)
    _needle_samples_cap = limit
    try:
        yield
    finally:
        _needle_samples_cap = None


def fetch_failure(error: BaseException) -> str:
    """What could not be fetched: the URL of a failed request, else the error's first line."""
    request = getattr(error, "request", None)
    url = getattr(request, "url", None)
    if url:
        return f"{url} ({type(error).__name__}; no network?)"
    return first_line(error)


@contextlib.contextmanager
def _lm_eval_logging(level: int):
    logger = logging.getLogger("lm_eval")
    before = logger.level
    logger.setLevel(level)
    try:
        yield
    finally:
        logger.setLevel(before)


# ------------------------------------------------------------------------------------------------ cells
@dataclass
class Cell:
    """One (method, task, length) and, once run or read from the cache, lm-eval's result."""

    method: object  # ctxext.eval.rows.EvalMethod
    task: TaskSpec
    length: int | None
    key: dict = field(default_factory=dict)
    result: dict | None = None
    cached: bool = False

    @property
    def name(self) -> str:
        return f"{self.method.label} | {self.task.name}{f' | {self.length}' if self.length else ''}"


def plan_cells(methods: list, specs: list[TaskSpec], lengths: list[int]) -> list[Cell]:
    """Task by task, length by length, every method: an interrupted run leaves whole columns done."""
    return [
        Cell(method, spec, length) for spec in specs for length in task_lengths(spec, lengths) for method in methods
    ]


def max_length_for(cell: Cell, lengths: list[int]) -> int:
    """HFLM's max_length: the cell's length (the longest one for tasks without lengths) plus the margin."""
    return (cell.length or max(lengths)) + GENERATION_MARGIN


def cell_key(cell: Cell, common: dict, max_length: int) -> dict:
    """Everything a cell's result depends on; its hash names the cache file."""
    return {
        **common,
        "method": cell.method.description,
        "task": cell.task.name,
        "length": cell.length,
        "max_length": max_length,
    }


class TaskCellCache(CellCache):
    """ctxext.outputs.CellCache for task cells: a file holds {"key": ..., "result": lm-eval's result}, named by
    the first 20 hex digits of the key's hash (the names task cells have always had), and lm-eval's own request
    cache per cell, for resuming inside a cell."""

    def __init__(self, folder: str | Path | None):
        super().__init__(folder, {}, digits=20, default=jsonable)

    def load(self, key: dict) -> dict | None:
        record = self.get(key)
        return None if record is None else record.get("result")

    def save(self, key: dict, result: dict) -> None:
        self.put(key, {"result": result})

    def requests_path(self, key: dict) -> str | None:
        """Where lm-eval's own request cache for this cell lives (its CachingLM adds `_rank<N>.db`): every sample
        is stored as soon as it is answered, so an interrupted cell resumes at its next sample. The name is the
        cell's digest, so a change of method, parameters, model, length or lm-eval version starts afresh."""
        return None if self.folder is None else str(self.folder / "requests" / self.digest(key))

    def drop_requests(self, key: dict) -> None:
        """Remove a finished cell's request cache (its result is cached whole)."""
        prefix = self.requests_path(key)
        if prefix is not None:
            for db in Path(prefix).parent.glob(f"{Path(prefix).name}_rank*.db"):
                db.unlink(missing_ok=True)


def jsonable(value):
    """What lm-eval writes for a value JSON cannot hold (its own rule)."""
    from lm_eval.utils import handle_non_serializable  # noqa: PLC0415 -- optional: tasks

    return handle_non_serializable(value)


# -------------------------------------------------------------------------------------------------- run
# What results.json keeps of simple_evaluate's config.
CONFIG_KEPT = (
    "limit",
    "bootstrap_iters",
    "gen_kwargs",
    "random_seed",
    "numpy_seed",
    "torch_seed",
    "fewshot_seed",
    "batch_size",
    "model_dtype",
    "model_num_parameters",
)


def harness_model(model, tokenizer, max_length: int, batch_size, processes):
    """lm-eval's HFLM around the (patched) model. Under several processes it gets lm-eval's data-parallel setup
    (which HFLM makes only for a model it loads itself): each process answers every world_size-th request."""
    from lm_eval.models.huggingface import HFLM  # noqa: PLC0415 -- optional: tasks

    with _lm_eval_logging(logging.ERROR):  # its warnings about a pre-built model are about what we do below
        lm = HFLM(pretrained=model, tokenizer=tokenizer, max_length=max_length, batch_size=batch_size)
    if processes.world_size > 1:
        lm.accelerator = Accelerator()
        lm._rank, lm._world_size = processes.rank, processes.world_size
    return lm


def evaluate_cell(
    lm,
    spec: TaskSpec,
    manager,
    limit: int | None,
    apply_chat_template: bool,
    quiet: bool = False,
    requests_cache: str | None = None,
) -> dict | None:
    """lm_eval.simple_evaluate on one task; what it returns, reduced to what results.json keeps (None off the
    main process). `requests_cache`: lm-eval's per-request cache (`use_cache`), for resuming a cell."""
    import lm_eval  # noqa: PLC0415 -- optional: tasks

    started = time.perf_counter()
    sink = _Discard() if quiet else None
    if requests_cache is not None:
        Path(requests_cache).parent.mkdir(parents=True, exist_ok=True)
    with contextlib.redirect_stderr(sink) if quiet else contextlib.nullcontext(), needle_samples_up_to(spec, limit):
        out = lm_eval.simple_evaluate(
            model=lm,
            tasks=[spec.name],
            limit=limit,
            task_manager=manager,
            apply_chat_template=apply_chat_template,
            use_cache=requests_cache,
        )
    if out is None:
        return None
    config = out.get("config", {})
    return {
        "results": out["results"],
        "groups": out.get("groups", {}),
        "n-samples": out.get("n-samples", {}),
        "versions": out.get("versions", {}),
        "n-shot": out.get("n-shot", {}),
        "higher_is_better": out.get("higher_is_better", {}),
        "configs": json.loads(json.dumps(out.get("configs", {}), default=jsonable)),
        "config": {k: config.get(k) for k in CONFIG_KEPT},
        "max_length": out.get("max_length"),
        "lm_eval_version": out.get("lm_eval_version"),
        # In doc order: under several processes lm-eval gathers them rank by rank.
        "samples": {
            task: [sample_record(s) for s in sorted(samples, key=lambda s: int(s.get("doc_id", 0)))]
            for task, samples in out.get("samples", {}).items()
        },
        "seconds": time.perf_counter() - started,
    }


class _Discard(io.TextIOBase):
    def write(self, text):
        return len(text)


def sample_record(sample: dict) -> dict:
    """A sample without its prompt (RULER prompts are the length itself): ids, hashes, the answer and scores."""
    doc = sample.get("doc", {}) if isinstance(sample.get("doc"), dict) else {}
    responses = sample.get("filtered_resps", [])
    record = {
        "doc_id": sample.get("doc_id"),
        "doc_hash": sample.get("doc_hash"),
        "prompt_hash": sample.get("prompt_hash"),
        "target": sample.get("target"),
        "response": responses[0] if len(responses) == 1 else responses,
        "metrics": {m: sample.get(m) for m in sample.get("metrics", [])},
    }
    if "length" in doc:
        record["ruler_length"] = doc["length"]  # RULER's count: prompt tokens + the generation budget
    return json.loads(json.dumps(record, default=jsonable))


def run_cells(
    cells: list[Cell],
    model,
    tokenizer,
    managers: TaskManagers,
    cache: TaskCellCache,
    *,
    lengths: list[int],
    tokenizer_name: str,
    common_key: dict,
    limit: int | None,
    batch_size,
    apply_chat_template: bool,
    processes,
    cached_only: bool = False,
    quiet: bool = False,
    log=print,
) -> list[Cell]:
    """Run (or read from the cache) every cell; `log(line)` is called on the main process after each one."""
    for cell in cells:
        cell.key = cell_key(cell, common_key, max_length_for(cell, lengths))
    found = [cache.load(cell.key) for cell in cells] if processes.is_main else None
    found = processes.from_main(found)
    todo = sum(f is None for f in found)
    if processes.is_main and todo < len(cells):
        log(f"{len(cells) - todo} of {len(cells)} cells from the cache ({cache.folder})")
    for index, (cell, result) in enumerate(zip(cells, found), 1):
        if result is not None:
            cell.result, cell.cached = result, True
            continue
        if cached_only:
            continue
        manager = managers.get(task_metadata(cell.task, cell.length, tokenizer_name))
        # Under --tp every process is lm-eval's rank 0 and must answer every request in step with the others, so
        # none keeps lm-eval's per-request cache (one file that all would write, and a resumed cell must not
        # skip on one process what another answers): an interrupted cell starts again at its first sample.
        requests_cache = None if processes.tensor_parallel else cache.requests_path(cell.key)
        lm = harness_model(model, tokenizer, max_length_for(cell, lengths), batch_size, processes)
        cell.method.apply(model)
        try:
            cell.result = evaluate_cell(lm, cell.task, manager, limit, apply_chat_template, quiet, requests_cache)
        finally:
            cell.method.remove(model)
        if processes.is_main:
            cache.save(cell.key, cell.result)
            cache.drop_requests(cell.key)  # every process is past simple_evaluate's final gather
            log(f"[{index}/{len(cells)}] {cell.name}: {cell_summary(cell)} ({cell.result['seconds']:.0f} s)")
    return cells


# ---------------------------------------------------------------------------------------------- scores
def cell_scores(cell: Cell) -> list[dict]:
    """The numbers of a cell as rows (method, task, length, metric, value, samples), one per lm-eval result
    entry and metric. A RULER cell's metric named after its length is called 'score'; RULER's -1 placeholders
    for the lengths the cell did not run are left out."""
    if cell.result is None:
        return []
    rows = []
    for task, entry in cell.result["results"].items():
        samples = entry.get("sample_len", cell.result.get("n-samples", {}).get(task, {}).get("effective"))
        for metric, value in entry.items():
            if "," not in metric or "_stderr" in metric or not isinstance(value, (int, float)):
                continue
            name, _, filter_name = metric.partition(",")
            if cell.task.convention == "ruler":
                if name != str(cell.length):
                    continue
                name = "score"
            rows.append(
                {
                    "method": cell.method.label,
                    "task": task,
                    "length": cell.length,
                    "metric": name if filter_name == "none" else f"{name},{filter_name}",
                    "value": float(value),
                    "samples": samples,
                    "seconds": cell.result.get("seconds"),
                    "cached": cell.cached,
                }
            )
    return rows


def cell_summary(cell: Cell) -> str:
    rows = cell_scores(cell)
    return (
        ", ".join(f"{r['task']} {r['metric']} {r['value']:.3f}" for r in rows[:4]) + (", ..." if len(rows) > 4 else "")
        if rows
        else "no scores"
    )
