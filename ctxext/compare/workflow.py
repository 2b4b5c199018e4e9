"""`run_compare(request)`: which method, with which settings, works for this model at these lengths, and which
engine serves it; the library behind `ctxext compare`.

plan (no weights) -> output directory -> the defaults table (native, every method at its defaults: held-out
perplexity and passkey; --tasks: lm-eval's task scores) -> the screen and successive halving (ordinary `ctxext search` studies) -> the searched
rows -> ranking, recommendation per serving target, cost -> report.md, results.json, results.csv, plots (after
every stage) -> --write-best. Every cell is kept as soon as it is computed; the same command resumes. Under
`accelerate launch` the processes share the cells; the searches, the report and --write-best run on the main
process (ctxext.compare.processes).
"""

from __future__ import annotations

import contextlib
import math
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from tqdm.auto import tqdm

from .. import loading
from ..checkpoint import write_patched_checkpoint
from ..config import MethodConfig
from ..errors import CtxextError
from ..extras import require
from ..runtime import Processes, machine_description
from .cells import Cells
from .decide import SessionTrials, decide
from .page import write_page
from .plan import NONE, ComparePlan, default_config, plan_compare
from .processes import MainOnly, alone, my_share
from .report import report_results, write_report
from .request import BUDGET_TRIALS_CAP, DEFAULT_TRIALS, CompareRequest, needed_extras
from .searches import StudyRunner, read_history, search_pending, searched_config, successive_halving
from .serving import TARGETS
from .tasks import run_task_cells


@dataclass
class Row:
    """A row of the table: a method at its defaults or searched; its configuration per length (None: none)."""

    label: str
    method: str
    kind: str  # defaults | searched
    configs: dict[int, dict | None]
    note: str = ""
    search: dict = field(default_factory=dict)  # length -> what the report says of its search
    objective: str | None = None  # a searched row's objective
    pending: dict = field(default_factory=dict)  # length -> why a full search has no configuration there yet


@dataclass
class Measurements:
    """Every cell found so far: perplexity[(label, doc, length)], native[(doc, length)], passkey[(label, length)],
    tasks[(label, length)]."""

    perplexity: dict = field(default_factory=dict)
    native: dict = field(default_factory=dict)
    passkey: dict = field(default_factory=dict)
    tasks: dict = field(default_factory=dict)  # (label, length) -> --tasks score rows (task, metric, value, ...)
    failed: dict = field(default_factory=dict)  # label -> why its cells cannot be computed here
    missing: list = field(default_factory=list)


@dataclass
class CellJob:
    """One cell of a stage: `compute()` finds or computes it; the measurement goes to `into[key]`; a CtxextError
    marks `failing` (a row's label; None: what[0]) as failed."""

    what: tuple
    compute: Callable
    into: dict
    key: tuple
    failing: str | None = None


@dataclass
class CompareResult:
    output: Path
    plan: ComparePlan
    results: dict  # results.json
    written: Path | None = None  # --write-best
    main_process: bool = True  # False on the other processes of an `accelerate launch` (they write nothing)

    @property
    def protocol(self) -> dict:
        return self.results["protocol"]


class Session:
    """One compare: the plan, the model (loaded on first need), the cells, the searches and the rows so far."""

    def __init__(self, plan: ComparePlan, log: Callable[[str], None]):
        self.processes = plan.processes or Processes()
        self.plan, self.say = plan, log
        self.log = log if self.processes.is_main else (lambda line: None)  # the other processes: their cells only
        self.request = plan.request
        self.main_only = MainOnly(self.processes, self.request.cache_dir)  # every process has planned: now write
        self.started = time.perf_counter()
        self.machine = machine_description()
        self.model = None
        self.compute = not self.request.report_only
        context = {"model": plan.fingerprint, "dtype": plan.dtype_label, "bos": plan.bos_id}
        root = self.request.cache_dir
        self.cells = Cells(
            root / "cells", context, self.load_model, plan.tokenizer, plan.bos_id, self.machine, self.compute
        )
        self.cells.process = (self.processes.rank, self.processes.world_size)
        self.cells.on_computed = self.cell_computed
        self.runner = StudyRunner(plan, root, self.load_model, self.compute, self.log)
        self.measured = Measurements()
        self.halving: dict[int, dict] = {}
        self.decisions: dict[str, dict] = {}  # target -> how the decide stage ended (ctxext.compare.decide)
        self.progress = None

    def load_model(self):
        if self.model is None:
            runtime = self.plan.runtime
            self.log(f"loading {self.request.model} ({self.plan.dtype_label} on {runtime['device']})")
            self.model = loading.load_model(
                self.request.model,
                dtype=runtime["dtype"],
                device=runtime["device"],
                attn_implementation=runtime["attn_implementation"],
                progress=self.request.runtime.progress,
                placement=runtime["placement"],
            )
        return self.model

    # ----------------------------------------------------------------------------------------- rows
    def default_rows(self) -> list[Row]:
        plan = self.plan
        rows = []
        for method in plan.methods:
            configs = {n: default_config(method, n, plan.L) for n in plan.lengths}
            note = "no default: 'new_base' is required (see the searched row)" if method == "theta" else ""
            rows.append(Row(method, method, "defaults", configs, note))
        return rows

    def searched_rows(self) -> list[Row]:
        if self.request.full_searches:
            return self.full_search_rows()
        plan, rows = self.plan, []
        for method in plan.methods:
            searched_at = [n for n in plan.lengths if any(method in r["methods"] for r in self.halving_at(n))]
            if not searched_at:
                continue
            row = Row(f"{method} (searched)", method, "searched", {}, objective=self.request.objective)
            for length in plan.lengths:
                if length in searched_at:
                    config, info = searched_config(self.runner.folder(method, length, False))
                    row.configs[length] = config
                    if info:
                        row.search[length] = info
                else:
                    row.configs[length] = default_config(method, length, plan.L)
                    row.search[length] = {"pruned": "pruned before the rungs (the screen): its defaults"}
            rows.append(row)
        return rows

    def full_search_rows(self) -> list[Row]:
        """One row per method and --full-search kind that covers it: the first kind's rows are 'METHOD (searched)',
        the others' 'METHOD (searched, OBJECTIVE)'; a length whose search is not done has no configuration yet."""
        plan, rows = self.plan, []
        for method in plan.searchable:
            for index, kind in enumerate(self.request.full_searches):
                if not kind.covers(method):
                    continue
                label = f"{method} (searched)" if index == 0 else f"{method} (searched, {kind.objective})"
                row = Row(label, method, "searched", {}, objective=kind.objective)
                for length in plan.lengths:
                    folder = self.runner.folder(method, length, False, kind.objective)
                    pending = search_pending(folder, kind.trials)
                    config, info = (None, None) if pending else searched_config(folder)
                    row.configs[length] = config
                    if info:
                        row.search[length] = info
                    if pending:
                        row.pending[length] = pending
                rows.append(row)
        return rows

    def halving_at(self, length: int) -> list[dict]:
        return self.halving.get(length, {}).get("rungs", [])

    # ---------------------------------------------------------------------------------------- cells
    def cell_jobs(self, rows: list[Row], with_native: bool, failed: dict) -> Iterator[CellJob]:
        """A stage's cells in their order; a row in `failed` (read as the jobs are taken) has no more cells."""
        plan, m = self.plan, self.measured
        for length in plan.lengths:
            if with_native:
                for doc in plan.held_out:
                    yield CellJob(
                        ("native", doc.name, length),
                        lambda d=doc, n=length: self.cells.perplexity("native", None, d, n, native_L=plan.L),
                        m.native,
                        (doc.name, length),
                    )
            for row in rows:
                config = row.configs.get(length)
                if config is None or row.label in failed:
                    continue
                for doc in plan.held_out:
                    yield CellJob(
                        (row.label, doc.name, length),
                        lambda r=row, c=config, d=doc, n=length: self.cells.perplexity(r.label, c, d, n),
                        m.perplexity,
                        (row.label, doc.name, length),
                    )
                if length in plan.passkey_lengths:
                    yield self.passkey_job(row, config, length)
        baseline = with_native and plan.L in plan.passkey_lengths
        if baseline and any(r.method == NONE for r in rows):  # the unpatched model inside its window
            none = next(r for r in rows if r.method == NONE)
            yield self.passkey_job(none, {"method": NONE}, plan.L, f"none at {plan.L}")

    def passkey_job(self, row: Row, config: dict, length: int, failing: str | None = None) -> CellJob:
        request = self.request
        return CellJob(
            (f"passkey {row.label}", length),
            lambda: self.cells.passkey(row.label, config, length, request.passkey_depths, request.passkey_trials),
            self.measured.passkey,
            (row.label, length),
            failing or row.label,
        )

    def measure(self, rows: list[Row], with_native: bool) -> None:
        """Every cell of a stage, found or computed, into the measurements (as one process does it)."""
        for job in self.cell_jobs(rows, with_native, self.measured.failed):
            self.cell(job)

    def compute_my_share(self, rows: list[Row], with_native: bool, what: str) -> None:
        """This process's share of a stage's cells (ctxext.compare.processes.my_share), into the cache only. The
        order does not depend on failures, so every process takes the same one; a cell that fails is left to the
        main process, which computes it again as it measures and records why."""
        processes = self.processes
        mine = my_share(list(self.cell_jobs(rows, with_native, failed={})), processes.rank, processes.world_size)
        progress = self.progress_of(len(mine) if processes.is_main else 0, f"{what} (this process's share)")
        with progress, alone():
            for job in mine:
                with contextlib.suppress(CtxextError):
                    job.compute()
                if self.progress is not None:
                    self.progress.update(1)

    def cell_computed(self, what: str, record: dict) -> None:
        processes = self.processes
        by = f" [process {processes.rank} of {processes.world_size}]" if processes.world_size > 1 else ""
        self.say(f"  {what} ({record['seconds']:.1f} s){by}")

    def cell(self, job: CellJob) -> None:
        """Find or compute one cell into `job.into[job.key]`; a CtxextError marks the job's row as failed."""
        what, into, key = job.what, job.into, job.key
        failing = job.failing or what[0]
        try:
            found = job.compute()
        except CtxextError as error:
            self.measured.failed[failing] = str(error)
            self.log(f"{failing}: {error}")
            found = None
        if self.progress is not None:
            self.progress.update(1)
        if found is None:
            if failing not in self.measured.failed:
                self.measured.missing.append(" ".join(str(w) for w in what))
        else:
            into[key] = found

    def count_cells(self, rows: list[Row], with_native: bool) -> int:
        plan = self.plan
        per_length = sum(
            len(plan.held_out) + (n in plan.passkey_lengths)
            for r in rows
            for n in plan.lengths
            if r.configs.get(n) is not None
        )
        return per_length + (len(plan.held_out) * len(plan.lengths) + 1 if with_native else 0)

    # ------------------------------------------------------------------------------------- budget
    def spent_seconds(self) -> float:
        """Seconds recorded in the cells and trials this compare uses (so a resumed run decides the same)."""
        m = self.measured
        cells = [*m.perplexity.values(), *m.native.values(), *m.passkey.values()]
        seconds = math.fsum(c.get("seconds", 0.0) for c in cells)
        root = self.runner.root / "searches"
        for method in self.plan.searchable:
            for length in self.plan.lengths:
                for screen in {False, self.runner.screen_is_separate()}:
                    folder = self.runner.folder(method, length, screen)
                    seconds += math.fsum(t.get("seconds") or 0.0 for t in read_history(folder))
        del root
        return seconds

    def seconds_left(self) -> float:
        return self.request.budget - self.spent_seconds()

    def row_reserve(self, method: str) -> float:
        """Seconds to score a searched row at one length: its defaults row's cells there (one length's worth)."""
        m = self.measured
        cells = [v for (label, _doc, _n), v in m.perplexity.items() if label == method]
        cells += [v for (label, _n), v in m.passkey.items() if label == method]
        return math.fsum(c.get("seconds", 0.0) for c in cells) / max(1, len(self.plan.lengths))

    # ------------------------------------------------------------------------------------- stages
    def run_progress(self, total: int, what: str):
        if not self.request.runtime.progress:
            return None
        return tqdm(total=total, unit="cell", desc=what, dynamic_ncols=True, file=sys.stderr)

    def stage_cells(self, rows: list[Row], with_native: bool, what: str) -> None:
        """Every cell of a stage into the measurements. Under several processes each first computes its share, then
        the main process measures (finding them all) and its measurements reach the others."""
        if self.processes.world_size == 1:
            with self.progress_of(self.count_cells(rows, with_native), what):
                self.measure(rows, with_native)
            return
        if self.compute:
            self.compute_my_share(rows, with_native, what)

        def measured():
            self.measure(rows, with_native)
            return self.measured

        self.measured = self.main_only.run(measured)

    @contextlib.contextmanager
    def progress_of(self, total: int, what: str):
        self.progress = self.run_progress(total, what) if total else None
        try:
            yield
        finally:
            if self.progress is not None:
                self.progress.close()
            self.progress = None

    def stage_tasks(self, rows: list[Row]) -> None:
        """--tasks: every row's lm-eval task cells at every length (found, or computed unless report-only)."""
        if self.plan.task_specs:
            run_task_cells(self.plan, rows, self.load_model, self.compute, self.measured, self.log)

    def stage_full_searches(self) -> None:
        """Every --full-search kind's searches run to its trials, length by length (report-only: none)."""
        plan = self.plan
        searchable = [m for m in plan.searchable if m not in self.measured.failed]
        for length in plan.lengths:
            for kind in self.request.full_searches:
                for method in [m for m in searchable if kind.covers(m)]:
                    self.runner.run(method, length, kind.trials, objective=kind.objective)

    def stage_decide(self, rows: list[Row]) -> None:
        """More passkey trials for the rows tied with a recommendation (ctxext.compare.decide), on the main process
        (its blocks are cells, kept as computed); the measurements and decisions reach every process."""
        request = self.request
        size = len(request.passkey_depths) * request.passkey_trials
        if request.max_passkey_trials <= size:
            return

        def decided():
            source = SessionTrials(self, rows)
            self.decisions = decide(source, TARGETS, size, request.max_passkey_trials, self.log)
            self.measured.missing += source.missing
            return self.measured, self.decisions

        self.measured, self.decisions = self.main_only.run(decided)

    def stage_searches(self) -> None:
        """The searches, on the main process only (ctxext.compare.processes); the halving record reaches all."""

        def searched():
            self.run_searches()
            return self.halving

        self.halving = self.main_only.run(searched)

    def run_searches(self) -> None:
        request, plan = self.request, self.plan
        if request.full_searches:
            self.stage_full_searches()
            return
        final = request.trials or (DEFAULT_TRIALS if request.budget is None else BUDGET_TRIALS_CAP)
        searchable = [m for m in plan.searchable if m not in self.measured.failed]
        for length in plan.lengths:
            self.halving[length] = successive_halving(
                self.runner,
                searchable,
                length,
                final,
                seconds_left=self.seconds_left if request.budget is not None else None,
                reserve=self.row_reserve,
            )


def run_compare(request: CompareRequest, log: Callable[[str], None] | None = None) -> CompareResult:
    """Plan, compute what is missing, rank, recommend and write the report of `request`."""
    say = log or (lambda line: None)
    plan = plan_compare(request)  # every check that needs no weights: bad input fails here, nothing written
    for extra, needed_by in needed_extras(request):  # a missing package is said before any cell is computed
        require(extra, needed_by)
    session = Session(plan, say)  # under several processes, once every one of them has planned
    out = Path(request.output) if request.output is not None else None
    if out is not None and session.processes.is_main:
        out.mkdir(parents=True, exist_ok=True)
    session.log(header(plan))
    defaults = session.default_rows()
    session.stage_cells(defaults, with_native=True, what="defaults")
    session.stage_tasks(defaults)
    searching = request.search and bool(plan.searchable)
    once = session.main_only.run
    rows = defaults
    if searching:
        once(lambda: write_outputs(session, defaults, final=False))
        session.stage_searches()
        searched = session.searched_rows()
        session.stage_cells(searched, with_native=False, what="searched rows")
        session.stage_tasks(searched)
        rows = defaults + searched
    session.stage_decide(rows)
    results = once(lambda: write_outputs(session, rows))
    written = once(lambda: write_best(session, results)) if plan.write_best else None
    if written is not None:
        results = once(lambda: write_report(session, rows, written=written, final=False))
    session.main_only.close()
    return CompareResult(out, plan, results, written, session.processes.is_main)


def write_outputs(session: Session, rows: list[Row], final: bool = True) -> dict:
    """The report in OUTPUT (when given) and the one-page layout at --page (when asked); results.json's record."""
    if session.request.page is not None:
        write_page(session, rows, Path(session.request.page), final=final)
    if session.request.output is None:
        return report_results(session, rows)
    return write_report(session, rows, final=final)


def header(plan: ComparePlan) -> str:
    request = plan.request
    return (
        f"ctxext compare: {request.model} (L = {plan.L}) at {', '.join(str(n) for n in plan.lengths)}; "
        f"{len(plan.methods)} methods; calibration: {', '.join(d.name for d in plan.calibration) or 'none'}; "
        f"held out: {', '.join(d.name for d in plan.held_out)}; {plan.dtype_label} on {plan.runtime['device']}"
        + (f"; budget {request.budget:.0f} s" if request.budget is not None else "")
    )


def write_best(session: Session, results: dict) -> Path:
    """The recommended row for --write-best's target, written as a checkpoint (the code of `ctxext patch`)."""
    target, folder = session.plan.write_best
    chosen = results["recommendations"].get(target)
    if chosen is None:
        raise CtxextError(f"--write-best {target}: no complete row is served exactly by {target}; nothing written")
    config = chosen["config"]
    write_patched_checkpoint(
        session.request.model,
        MethodConfig.from_mapping(config),
        folder,
        written_by="ctxext compare",
        extra_record={
            "compare": {
                "output": str(Path(session.request.output).resolve()),
                "row": chosen["label"],
                "target": target,
                "length": max(session.plan.lengths),
            }
        },
    )
    session.log(f"--write-best: {chosen['label']} ({target}) written to {folder}")
    return Path(folder)
