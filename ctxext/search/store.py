"""The trials of a search as an Optuna study in an Optuna storage: what resumes a search and shares it between
processes and machines.

The storage is a journal file (`optuna.storages.JournalStorage` over a `JournalFileBackend`; the default,
OUT/study.journal) or any RDB URL Optuna takes (`sqlite:///search.db`, `postgresql://...`, `mysql://...`). Every
process that opens the same study with the same settings works on the same search; the study records those
settings (user attribute `ctxext_search`) and refuses a process that brings other ones (the model's path aside:
another machine may keep the same model elsewhere).

**Slots.** A search of K trials fills slots 0..K-1; slot 0 is the defaults. A slot is what `trials.jsonl` calls a
trial's `number`, and a proposal depends only on the seed, the slot and the trials in earlier slots (see `loop`).
Optuna numbers every trial it stores; a slot is taken by exactly one finished trial:

- A worker claims a slot with `study.ask()`. Optuna hands out trial numbers atomically, so two workers never get
  one number. A trial Optuna had queued (WAITING, from `study.enqueue_trial`) carries its slot (and, when it is a
  retry, its parameters) as user attributes; any other trial takes the next fresh slot, its number less the
  queued trials before it (those fill earlier slots again).
- A finished trial (user attribute `state`: complete, invalid or diverged) is COMPLETE with its value, or FAIL;
  it carries its `params`, `metrics`, `role`, `seconds`, `slot`, `worker` (host, pid), and `error` for an invalid
  one. Its parameters inside their ranges are the Optuna trial's own parameters too, so Optuna's plots and
  importances read the study (LongRoPE's knot corrections `z` and factors are user attributes only).
- A trial that ends without a result is FAIL without `state`, and its slot is queued again: a worker that died
  mid-trial (a process gone on this machine, or no heartbeat for `GRACE_SECONDS` from another one; the retry's
  `reason` says which), an error that stopped the search (`error`), or a slot beyond the requested count that
  lost a race (`error`). Whoever marks a trial FAIL first queues its slot; Optuna's storages let one writer
  finish a running trial, so a slot is never queued twice.

Optuna is imported only when a study is opened.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import uuid
import warnings
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import CtxextError
from ..outputs import atomic_write_text
from .space import optuna_module

SETTINGS_ATTR = "ctxext_search"
DERIVED = ("selected_pairs",)  # settings measured on the model once the search starts: recorded, not compared
DEFAULT_STUDY = "ctxext-search"
JOURNAL_FILE = "study.journal"
HEARTBEAT_SECONDS = 30.0  # a running trial's `heartbeat` user attribute is refreshed this often
GRACE_SECONDS = 600.0  # a running trial of another machine is given up after this long without a heartbeat
UNCLAIMED_SECONDS = 60.0  # a running trial whose worker never recorded itself is given up after this long
DONE_STATES = ("complete", "invalid", "diverged")
WORKER = {"host": socket.gethostname(), "pid": os.getpid(), "token": uuid.uuid4().hex}


def storage_url(storage: str | Path | None, output: str | Path) -> str:
    """The storage a search uses: an RDB URL as given, or a journal file (default: the one in the output
    directory) as an absolute path."""
    if storage and "://" in str(storage):
        return str(storage)
    return str(Path(storage or Path(output) / JOURNAL_FILE).expanduser().resolve())


def open_storage(url: str):
    """An Optuna storage: an RDB URL (`scheme://...`), else a journal file at that path."""
    optuna = optuna_module()
    if "://" not in url:
        journal = optuna.storages.journal
        Path(url).expanduser().parent.mkdir(parents=True, exist_ok=True)
        return journal.JournalStorage(journal.JournalFileBackend(str(Path(url).expanduser())))
    from sqlalchemy.exc import SQLAlchemyError  # noqa: PLC0415 -- optional: search

    engine = {"connect_args": {"timeout": 60}} if url.startswith("sqlite") else None  # workers wait for the lock
    try:
        return optuna.storages.RDBStorage(url, engine_kwargs=engine)
    except (ImportError, ValueError, optuna.exceptions.OptunaError, SQLAlchemyError) as error:
        raise CtxextError(f"--storage '{url}' cannot be opened: {error}".splitlines()[0]) from error


def differing(recorded: dict, expected: dict) -> list[str]:
    """The top-level keys whose values differ between two JSON-like mappings (compared as JSON)."""
    recorded, expected = (json.loads(json.dumps(m, default=str)) for m in (recorded, expected))
    return sorted(k for k in set(recorded) | set(expected) if recorded.get(k) != expected.get(k))


def read_trials(path: str | Path) -> list[dict]:
    """The trials of a trials.jsonl (the export `TrialStore.export` writes, or a search from before the studies),
    in order. The file is only read: a cut-off last line (an old search killed mid-write) is left out."""
    records = []
    for line in Path(path).read_text(encoding="utf-8").splitlines(keepends=True):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            if line.endswith("\n"):
                raise CtxextError(f"{path} is not a trial log of ctxext search (a line is not JSON)") from None
            break  # the last line, cut off
    return records


@dataclass
class Claim:
    """A slot a worker holds: its running Optuna trial, and what a retry carries over."""

    trial: object  # optuna.Trial
    slot: int
    carried: dict = field(default_factory=dict)  # params, role, z of a retried trial
    started: float = field(default_factory=time.perf_counter)


class TrialStore:
    """One search's trials in an Optuna study; see the module docstring."""

    def __init__(self, study, url: str):
        self.study, self.url = study, url
        self.export_to: Path | None = None  # trials.jsonl, rewritten after each trial this process finishes

    @classmethod
    def open(cls, url: str, study_name: str, settings: dict) -> TrialStore:
        """The study `study_name` in the storage at `url`, created if missing; a CtxextError if it holds a search
        with other settings."""
        optuna = optuna_module()

        optuna.logging.set_verbosity(optuna.logging.WARNING)
        study = optuna.create_study(
            storage=open_storage(url),
            study_name=study_name,
            direction="minimize",
            sampler=optuna.samplers.RandomSampler(seed=0),  # never asked: ctxext proposes (see loop)
            load_if_exists=True,
        )
        store = cls(study, url)
        # The model's path is recorded, not compared: other machines may hold the same model elsewhere.
        store.require(SETTINGS_ATTR, settings, "a search with other settings", ignore=("model", *DERIVED))
        return store

    def require(self, key: str, value: dict, what: str, ignore=()) -> None:
        """Record `value` as the study's user attribute `key`, or check it against the one recorded."""
        if key not in self.study.user_attrs:
            self.study.set_user_attr(key, json.loads(json.dumps(value, default=str)))
        wrong = [k for k in differing(self.study.user_attrs[key], value) if k not in ignore]
        if wrong:
            raise CtxextError(
                f"study '{self.study.study_name}' in '{self.url}' does not match this search: it holds {what} "
                f"(they differ in: {', '.join(wrong)}); give the same settings, or another --study-name/--storage"
            )

    # ------------------------------------------------------------------------------------------ reading
    def frozen(self) -> list:
        return self.study.get_trials(deepcopy=False)

    def running(self, number: int) -> bool:
        return any(t.number == number and t.state.name == "RUNNING" for t in self.frozen())

    def history(self, trials: list | None = None) -> list[dict]:
        """The finished trials as records (trials.jsonl's lines), one per slot, in slot order."""
        done = [t for t in (self.frozen() if trials is None else trials) if _is_done(t)]
        return [record_of(t) for t in sorted(done, key=lambda t: t.user_attrs["slot"])]

    def export(self, path: str | Path) -> None:
        """trials.jsonl, derived from the study: one finished trial a line, in slot order (written whole)."""
        text = "".join(json.dumps(r, allow_nan=False) + "\n" for r in self.history())
        atomic_write_text(path, text)

    def import_records(self, records: list[dict]) -> None:
        """Add the trials of a trials.jsonl (a search started before the studies) to an empty study."""
        optuna = optuna_module()

        for record in records:
            complete = record["state"] == "complete"
            attrs = {k: v for k, v in record.items() if k not in ("number", "value")}
            self.study.add_trial(
                optuna.trial.create_trial(
                    state=optuna.trial.TrialState.COMPLETE if complete else optuna.trial.TrialState.FAIL,
                    value=record["value"] if complete else None,
                    user_attrs={**attrs, "slot": record["number"]},
                )
            )

    # ------------------------------------------------------------------------------------------ claiming
    def claim(self, trials: int) -> Claim | None:
        """A slot below `trials` to work on, or None while every such slot is finished or being worked on."""
        frozen = self.frozen()
        done = {t.user_attrs["slot"] for t in frozen if _is_done(t) and t.user_attrs["slot"] < trials}
        running = sum(t.state.name == "RUNNING" for t in frozen)
        if len(done) + running >= trials:
            return None
        trial = self.study.ask()
        attrs = dict(trial.user_attrs)
        if attrs.get("requeued"):
            slot, carried = attrs["slot"], {k: attrs[k] for k in ("params", "role", "z") if k in attrs}
        else:
            queued = sum(1 for t in self.frozen() if t.number < trial.number and t.user_attrs.get("requeued"))
            slot, carried = trial.number - queued, {}
        trial.set_user_attr("slot", slot)
        trial.set_user_attr("worker", WORKER)
        trial.set_user_attr("heartbeat", time.time())
        claim = Claim(trial, slot, carried)
        if slot in done:  # a queued slot finished meanwhile (it cannot be, but must not be run twice)
            self.give_back(claim, f"slot {slot} is finished already", requeue=False)
            return self.claim(trials)
        if slot >= trials:  # lost a race for the last slots: queued for a search resumed with more trials
            self.give_back(claim, f"slot {slot} is not needed: the search has its {trials} trials")
            return None
        return claim

    def begin(self, claim: Claim, role: str, params: dict, extra: dict, distributions: dict | None = None) -> None:
        """Record what the trial scores before scoring it, so that a retry after a crash scores the same. The
        parameters in `distributions` (those inside their range) become the Optuna trial's own parameters too,
        for Optuna's plots and analyses of the study."""
        claim.carried = {"role": role, "params": params, **extra}
        for key, value in claim.carried.items():
            claim.trial.set_user_attr(key, value)
        if distributions:
            self._set_params(claim.trial, {k: params[k] for k in distributions if k in params}, distributions)

    def _set_params(self, trial, params: dict, distributions: dict) -> None:
        """`trial.suggest_*` answered with `params` (Optuna's PartialFixedSampler), for the trial's own record."""
        optuna = optuna_module()

        sampler = self.study.sampler
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            self.study.sampler = optuna.samplers.PartialFixedSampler(params, sampler)
        try:
            for name in params:
                _suggest(trial, name, distributions[name])
        finally:
            self.study.sampler = sampler

    def finish(self, claim: Claim, record: dict) -> bool:
        """Record a scored trial: COMPLETE with its value, or FAIL (invalid, diverged) with `state` and `error`.
        False when another worker gave the trial up meanwhile (no heartbeat for too long): its slot is queued."""
        TrialState = optuna_module().trial.TrialState  # noqa: N806 (the class)

        try:
            for key in ("state", "metrics", "error", "repeat_of"):
                if key in record:
                    claim.trial.set_user_attr(key, record[key])
            claim.trial.set_user_attr("seconds", round(time.perf_counter() - claim.started, 3))
            if record["state"] == "complete":
                self.study.tell(claim.trial, record["value"])
            else:
                self.study.tell(claim.trial, state=TrialState.FAIL)
        except _finished_elsewhere():
            if self.running(claim.trial.number):
                raise  # the storage failed, not a race
            return False
        if self.export_to is not None:
            self.export(self.export_to)
        return True

    def give_back(self, claim: Claim, reason: str, requeue: bool = True) -> None:
        """End a trial without a result (FAIL with `error`) and queue its slot again."""
        TrialState = optuna_module().trial.TrialState  # noqa: N806 (the class)

        claim.trial.set_user_attr("error", reason)
        self.study.tell(claim.trial, state=TrialState.FAIL)
        if requeue:
            self._requeue(claim.slot, claim.carried, claim.trial.number, reason)

    def _requeue(self, slot: int, carried: dict, number: int, reason: str) -> None:
        self.study.enqueue_trial(
            {}, user_attrs={**carried, "slot": slot, "requeued": True, "retry_of": number, "reason": reason}
        )

    def release_lost(self) -> int:
        """Give up the running trials whose worker is gone (a dead process here, or no heartbeat for
        `GRACE_SECONDS`) and queue their slots again; how many."""
        TrialState = optuna_module().trial.TrialState  # noqa: N806 (the class)

        released = 0
        for t in self.frozen():
            reason = _lost(t) if t.state == TrialState.RUNNING else None
            if reason is None:
                continue
            try:
                self.study.tell(t.number, state=TrialState.FAIL)
            except _finished_elsewhere():  # another worker finished or released it first: not ours to queue
                continue
            carried = {k: t.user_attrs[k] for k in ("params", "role", "z") if k in t.user_attrs}
            if "slot" in t.user_attrs:
                self._requeue(t.user_attrs["slot"], carried, t.number, reason)
            released += 1
        return released

    def heartbeat(self, claim: Claim):
        """A context manager that refreshes the trial's heartbeat in a thread while the trial runs."""
        return _Heartbeat(claim.trial)


def _suggest(trial, name: str, distribution) -> None:
    distributions = optuna_module().distributions

    if isinstance(distribution, distributions.CategoricalDistribution):
        trial.suggest_categorical(name, distribution.choices)
    elif isinstance(distribution, distributions.IntDistribution):
        trial.suggest_int(name, distribution.low, distribution.high, log=distribution.log)
    else:
        trial.suggest_float(name, distribution.low, distribution.high, log=distribution.log)


def _finished_elsewhere() -> tuple:

    return (
        optuna_module().exceptions.OptunaError,
        RuntimeError,
        ValueError,
    )  # Optuna's errors for a trial another process finished


def _is_done(trial) -> bool:
    return trial.user_attrs.get("state") in DONE_STATES and trial.state.name in ("COMPLETE", "FAIL")


def record_of(trial) -> dict:
    """A finished trial as a trials.jsonl line."""
    attrs = trial.user_attrs
    record = {
        "number": attrs["slot"],
        "role": attrs["role"],
        "state": attrs["state"],
        "value": trial.value if attrs["state"] == "complete" else None,
        "metrics": attrs.get("metrics", {}),
    }
    record.update({k: attrs[k] for k in ("error", "repeat_of") if k in attrs})
    record["params"] = attrs["params"]
    record.update({k: attrs[k] for k in ("z",) if k in attrs})
    record["seconds"] = attrs.get("seconds", 0.0)
    return record


def _lost(trial) -> str | None:
    """Why a running trial's worker is gone, or None while it may still be working."""
    worker = trial.user_attrs.get("worker")
    if worker and worker.get("host") == WORKER["host"]:
        if worker.get("token") == WORKER["token"]:
            return None
        if worker.get("pid") == WORKER["pid"] or not _alive(worker.get("pid")):
            return f"worker {worker['host']}:{worker['pid']} ended without finishing the trial"
    beat = trial.user_attrs.get("heartbeat")
    if beat is None:  # a worker records itself right after it asks: one that has not in a minute is gone
        started = trial.datetime_start.timestamp() if trial.datetime_start else time.time()
        return "the worker never recorded itself" if time.time() - started > UNCLAIMED_SECONDS else None
    if time.time() - beat > GRACE_SECONDS:
        return f"no heartbeat for {time.time() - beat:.0f} s"
    return None


def _alive(pid) -> bool:
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except (PermissionError, TypeError, ValueError):
        return True
    return True


class _Heartbeat:
    def __init__(self, trial):
        self.trial, self.stop = trial, threading.Event()
        self.thread = threading.Thread(target=self._beat, daemon=True)

    def _beat(self) -> None:
        while not self.stop.wait(HEARTBEAT_SECONDS):
            try:
                self.trial.set_user_attr("heartbeat", time.time())
            except _finished_elsewhere():
                return  # given up by another worker: `finish` will say so

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()
