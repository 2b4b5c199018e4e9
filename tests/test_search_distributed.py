"""`ctxext search` on an Optuna storage, with real processes: two processes on one SQLite study share its trials
(none run twice), `--workers 2` does the same from one command, and a search killed mid-trial (SIGKILL) resumes
to the trials an uninterrupted search has.

A process is caught in the middle of a trial by pausing it (SIGSTOP) once its running trial holds its parameters
and no result, and checking that again while it is paused: a trial's scoring holds no lock on the storage, so the
other processes carry on. Its heartbeat thread writes to the storage every 30 s, though, so a pause that lands
in such a write is undone and tried again (a paused writer would hold SQLite's lock, or the journal's lock file).
"""

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.helpers import run_cli, save_tiny_checkpoint, tiny_model, trials_of

pytest.importorskip("optuna")
pytest.importorskip("cma")

REPO = Path(__file__).resolve().parents[1]
LENGTH = 4096  # a tiny LLaMA (L = 64) at 64x: about 0.4 s a document, long enough to catch a trial running

pytestmark = pytest.mark.slow  # real processes sharing one study: `make test-slow`, CI's second step


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("distributed")
    source = save_tiny_checkpoint(root / "tiny", tiny_model("llama"))
    g = torch.Generator().manual_seed(0)
    (root / "docs").mkdir()
    for index in range(2):
        ids = torch.randint(0, 256, (LENGTH + 50,), generator=g)
        (root / "docs" / f"doc{index}.txt").write_text(" ".join(f"w{int(i)}" for i in ids))
    return source, root / "docs"


def search_argv(tiny, out, trials, *extra):
    source, docs = tiny
    return [
        sys.executable, "-m", "ctxext", "search", str(source), "--method", "yarn", "--lengths", str(LENGTH),
        "--text-file", str(docs), "--calibration-docs", "2", "--held-out-docs", "0", "--trials", str(trials),
        "--no-checkpoint", "--no-progress", "--dtype", "fp32", "-o", str(out), *map(str, extra),
    ]  # fmt: skip


STARTED: list[subprocess.Popen] = []


@pytest.fixture(autouse=True)
def no_process_left_behind():
    """A failed test leaves none of its searches running, or paused (SIGKILL ends a stopped process too)."""
    yield
    while STARTED:
        process = STARTED.pop()
        if process.poll() is None:
            process.kill()
            process.wait(30)


def start(argv, log):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    process = subprocess.Popen(argv, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    STARTED.append(process)
    return process


def finish(process, log, timeout=300):
    try:
        code = process.wait(timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        raise
    assert code == 0, Path(log.name).read_text()[-3000:]


def pause_mid_trial(process, storage, after: int = 0, timeout: float = 240) -> int:
    """SIGSTOP `process` while it scores a trial (parameters recorded, no result), once `after` trials are done;
    the number of the trial it holds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert process.poll() is None, "the search ended before it could be paused"
        trials = trials_of(storage)
        scoring = [t for t in trials if _scoring(t, process.pid)]
        if scoring and sum("state" in t.user_attrs for t in trials) >= after:
            process.send_signal(signal.SIGSTOP)
            # the lock first: a process paused inside a write holds it, and a read would wait on it and fail
            if _unlocked(storage):
                again = {t.number: t for t in trials_of(storage)}[scoring[0].number]
                if _scoring(again, process.pid):
                    return again.number
            process.send_signal(signal.SIGCONT)  # it was writing, or finished the trial: try again
        time.sleep(0.05)
    raise AssertionError("no trial of the search was caught running")


def _unlocked(storage) -> bool:
    """Whether no process holds the storage's write lock (SQLite's, or the journal file's lock file)."""
    if "://" not in str(storage):
        return not os.path.lexists(f"{storage}.lock")
    connection = sqlite3.connect(str(storage).removeprefix("sqlite:///"), timeout=0.2, isolation_level=None)
    try:
        connection.execute("BEGIN IMMEDIATE")
        connection.execute("ROLLBACK")
        return True
    except sqlite3.OperationalError:  # database is locked
        return False
    finally:
        connection.close()


def _scoring(trial, pid) -> bool:
    attrs = trial.user_attrs
    return (
        trial.state.name == "RUNNING"
        and attrs.get("worker", {}).get("pid") == pid
        and "params" in attrs
        and "state" not in attrs
    )


def wait_for_trials_of_another(storage, pid, process, log, count=2, timeout=240) -> None:
    """Until `count` trials are finished by processes other than `pid` (while `process` still runs)."""
    deadline = time.monotonic() + timeout
    while sum(t.user_attrs.get("worker", {}).get("pid") != pid for t in done(trials_of(storage))) < count:
        assert process.poll() is None and time.monotonic() < deadline, Path(log.name).read_text()[-3000:]
        time.sleep(0.1)


def done(trials) -> list:
    return sorted((t for t in trials if "state" in t.user_attrs), key=lambda t: t.user_attrs["slot"])


def check_each_slot_once(trials, count) -> list:
    """The oracle of 'no trial run twice': the finished trials fill slots 0..count-1 once each, with parameter
    sets that are all different; every trial in the storage has its own number, and is finished or one of the
    leftovers of two workers claiming the last slot at once (see `race_leftovers`). The trials of slots below
    `count`."""
    finished = done(trials)
    assert [t.user_attrs["slot"] for t in finished] == list(range(count))
    params = [json.dumps(t.user_attrs["params"], sort_keys=True) for t in finished]
    assert len(set(params)) == count
    assert len({t.number for t in trials}) == len(trials)
    leftovers = race_leftovers(trials, count)
    assert all(t.state.name in ("COMPLETE", "FAIL") for t in trials if t not in leftovers)
    return [t for t in trials if t not in leftovers]


def race_leftovers(trials, count) -> list:
    """The trials left by a worker that lost the race for the last slot: it asked for a trial while the others
    ran, got slot `count`, gave it back (FAIL, 'not needed') and queued the slot (WAITING) for a search resumed
    with more trials, as the store documents. Nothing was scored in them."""
    beyond = [t for t in trials if t.user_attrs.get("slot", count) >= count]
    for t in beyond:
        assert "state" not in t.user_attrs and "params" not in t.user_attrs, t.user_attrs
        given_back = t.state.name == "FAIL" and "is not needed" in t.user_attrs.get("error", "")
        queued = t.state.name == "WAITING" and t.user_attrs.get("requeued")
        assert given_back or queued, (t.state, t.user_attrs)
    return beyond


def test_two_processes_on_one_sqlite_study_share_its_trials(tiny, tmp_path):
    storage = f"sqlite:///{tmp_path / 'search.db'}"
    with open(tmp_path / "a.log", "w") as log_a, open(tmp_path / "b.log", "w") as log_b:
        a = start(search_argv(tiny, tmp_path / "a", 8, "--storage", storage), log_a)
        pause_mid_trial(a, storage, after=1)  # a holds a trial; b must take the others
        b = start(search_argv(tiny, tmp_path / "b", 8, "--storage", storage), log_b)
        wait_for_trials_of_another(storage, a.pid, b, log_b)
        a.send_signal(signal.SIGCONT)
        finish(a, log_a)
        finish(b, log_b)
    trials = trials_of(storage)
    assert len(check_each_slot_once(trials, 8)) == 8  # nothing lost, nothing given back: 8 trials in its slots
    workers = {t.user_attrs["worker"]["pid"] for t in done(trials)}
    assert workers == {a.pid, b.pid}
    exported = [(tmp_path / name / "trials.jsonl").read_text() for name in ("a", "b")]
    assert exported[0] == exported[1] and len(exported[0].splitlines()) == 8
    assert [json.loads(line)["params"] for line in exported[0].splitlines()] == [
        t.user_attrs["params"] for t in done(trials)
    ]


def test_workers_run_one_study_from_one_command(tiny, tmp_path):
    storage = f"sqlite:///{tmp_path / 'search.db'}"
    with open(tmp_path / "log", "w") as log:
        search = start(search_argv(tiny, tmp_path / "out", 6, "--storage", storage, "--workers", 2), log)
        pause_mid_trial(search, storage)  # the command holds a trial while the worker it spawned starts up
        wait_for_trials_of_another(storage, search.pid, search, log, count=1)
        search.send_signal(signal.SIGCONT)
        finish(search, log)
    trials = trials_of(storage)
    check_each_slot_once(trials, 6)
    assert len({t.user_attrs["worker"]["pid"] for t in done(trials)}) == 2  # the command and the worker it spawned
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert results["trials"]["logged"] == 6 and results["study"]["storage"] == storage


def test_a_search_killed_mid_trial_resumes_to_the_uninterrupted_trials(tiny, tmp_path, capsys, one_torch_thread):
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    # The uninterrupted search runs in this process, on one thread as the launched ones: a process start here
    # costs about 13 s, most of it importing transformers.
    assert run_cli(capsys, *search_argv(tiny, whole, 6)[3:])[0] == 0
    with open(tmp_path / "parts.log", "w") as log:
        search = start(search_argv(tiny, parts, 6), log)
        killed = pause_mid_trial(search, parts / "study.journal", after=2)
        search.send_signal(signal.SIGKILL)
        search.wait(30)
        left = {t.number: t for t in trials_of(parts / "study.journal")}[killed]
        assert left.state.name == "RUNNING"  # killed mid-trial: nothing recorded a result
        finish(start(search_argv(tiny, parts, 6, "--resume"), log), log)
    trials = trials_of(parts / "study.journal")
    check_each_slot_once(trials, 6)
    lost = {t.number: t for t in trials}[killed]
    assert lost.state.name == "FAIL" and "state" not in lost.user_attrs
    retry = next(t for t in trials if t.user_attrs.get("retry_of") == killed)
    assert (
        retry.user_attrs["slot"] == lost.user_attrs["slot"] and "ended without finishing" in retry.user_attrs["reason"]
    )
    assert retry.user_attrs["params"] == lost.user_attrs["params"]  # the lost trial is scored again, as it was
    read = lambda out: [
        (t["params"], t["value"]) for t in map(json.loads, (out / "trials.jsonl").read_text().splitlines())
    ]
    assert read(parts) == read(whole)  # the same 6 trials an uninterrupted search has
