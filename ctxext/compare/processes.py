"""A compare under `accelerate launch` (or torchrun) with N processes: the cells are shared, the rest runs once.

- **Cells**: every process walks the same order of a stage's cells and computes those whose index in it is congruent
  to its rank modulo N (`my_share`), each writing its own cell files into the cache (which must be one folder all
  the processes see). Then, once every process has finished its share (each says so with a file, `MainOnly`), the
  main process runs the stage as a single process would: it finds every cell (it computes again only one that
  failed, to record why), and its measurements reach the other processes. The split is a function of the cells'
  order alone, never of timing: before the main process waited for the others' shares, a main process that finished
  first computed the cells a slower process had not written yet, both computed them, and the split (9 cells against
  5 under load) depended on which was faster.
- **Once, on the main process**: the searches (an Optuna study's trials depend on which trials have finished when
  the next is sampled, so a study shared among processes would not give a single process's trials), the report
  and --write-best. The other processes wait for it by polling a file the main process writes when it is done
  (`MainOnly`), not inside a collective: torch.distributed's collectives give up after 30 minutes (gloo's default)
  and a search can run for hours; the main process waits for the others' arrival files the same way (a share of
  cells can run for hours too). Then the main process's result reaches them in one broadcast.
- **Alone**: what one process computes by itself (its cells, the main process's searches) must not join the
  others' collectives, yet ctxext.eval's passkey (also the searches' passkey objectives) shards its trials among
  the processes `ctxext.runtime.Processes()` finds in the environment. `alone()` says WORLD_SIZE=1 meanwhile, so
  what asks how many processes were launched hears one (accelerate's state, already set up, is left as it is).
"""

from __future__ import annotations

import contextlib
import shutil
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from ..runtime import alone, on_main_first  # noqa: F401  (alone: this module's word for it)

SYNC_DIR = ".processes"  # under the cache folder: one folder per launched compare, removed when it finishes
POLL_SECONDS = 0.2


def my_share(items: list, rank: int, world_size: int) -> list:
    """The items whose index is congruent to `rank` modulo `world_size`: each item on exactly one process."""
    return [item for index, item in enumerate(items) if index % world_size == rank]


def wait_for_file(path: Path, poll_seconds: float = POLL_SECONDS) -> None:
    """Until `path` exists (if the main process dies first, torchrun ends this process)."""
    while not path.exists():
        time.sleep(poll_seconds)


class MainOnly:
    """Runs steps on the main process, once every process has arrived at the step, while the others wait for it;
    `folder` holds the files that say a process has arrived and that a step is done (one folder per launched compare,
    named by the main process's random token)."""

    def __init__(self, processes, cache_dir: Path):
        self.processes = processes
        self.folder = Path(cache_dir) / SYNC_DIR / processes.from_main(uuid.uuid4().hex)
        self.steps = 0

    def run(self, fn: Callable):
        """fn() on the main process once every other process has arrived here (what they did before, e.g. their
        share of a stage's cells, is written); its value on every process. An exception there stops every process
        (`ctxext.runtime.on_main_first`: the main process raises it, the others a CtxextError with its message)."""
        if self.processes.world_size == 1:
            return fn()
        self.steps += 1
        done = self.folder / f"{self.steps}.done"
        self.arrive()
        value = [None]

        def on_main():
            try:
                with alone():
                    value[0] = fn()
            finally:
                done.parent.mkdir(parents=True, exist_ok=True)
                done.touch()

        if not self.processes.is_main:
            wait_for_file(done)
        on_main_first(self.processes, on_main)
        result = self.processes.from_main(value[0])
        self.processes.state.wait_for_everyone()  # every process has seen `done`: it can go
        if self.processes.is_main:
            done.unlink(missing_ok=True)
            for path in self.arrivals():
                path.unlink(missing_ok=True)
        return result

    def arrivals(self) -> list[Path]:
        """The files by which the other processes say they have reached this step."""
        return [self.folder / f"{self.steps}.arrived.{rank}" for rank in range(1, self.processes.world_size)]

    def arrive(self) -> None:
        """Another process: say it has reached this step. The main process: wait until every other one has."""
        if not self.processes.is_main:
            arrived = self.folder / f"{self.steps}.arrived.{self.processes.rank}"
            arrived.parent.mkdir(parents=True, exist_ok=True)
            arrived.touch()
            return
        for path in self.arrivals():
            wait_for_file(path)

    def close(self) -> None:
        if self.processes.is_main and self.folder.is_dir():
            shutil.rmtree(self.folder, ignore_errors=True)
            with contextlib.suppress(OSError):  # other compares on the same cache may be running
                self.folder.parent.rmdir()
