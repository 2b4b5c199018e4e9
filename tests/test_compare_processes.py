"""A compare under several processes: the main process measures a stage only after every other process has
written its share of the cells, so the split between processes is a function of the cells' order, never of timing
(it was 9 cells against 5 under load when the main process went on as soon as its own share was done)."""

from types import SimpleNamespace

import ctxext.compare.processes as processes_module
from ctxext.compare.processes import MainOnly, my_share


def one_of_two(rank: int) -> SimpleNamespace:
    """Process `rank` of 2, as MainOnly sees it; no collective runs (launched=1: on_main_first broadcasts nothing)."""
    state = SimpleNamespace(wait_for_everyone=lambda: None)
    return SimpleNamespace(
        rank=rank, world_size=2, is_main=rank == 0, launched=1, state=state, from_main=lambda value: value
    )


def test_the_main_process_runs_a_step_only_after_the_other_process_has_arrived(tmp_path, monkeypatch):
    events = []

    def waited(path, poll_seconds=None):
        events.append(("waited for", path.name))
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch()  # the other process arrives

    monkeypatch.setattr(processes_module, "wait_for_file", waited)
    main = MainOnly(one_of_two(0), tmp_path)
    assert main.run(lambda: events.append("measured") or 42) == 42
    assert events == [("waited for", "1.arrived.1"), "measured"]  # before: ["measured"], not waiting
    assert main.run(lambda: events.append("searched")) is None  # each step has its own arrival file
    assert events[2:] == [("waited for", "2.arrived.1"), "searched"]
    assert list(main.folder.iterdir()) == []  # arrivals and done files are removed once every process has gone


def test_the_other_process_says_it_has_arrived_before_it_waits_for_the_main_process(tmp_path, monkeypatch):
    seen = []

    def waited(path, poll_seconds=None):
        seen.append((path.name, sorted(p.name for p in path.parent.iterdir())))

    monkeypatch.setattr(processes_module, "wait_for_file", waited)
    other = MainOnly(one_of_two(1), tmp_path)
    other.run(lambda: seen.append("never on this process"))
    assert seen == [("1.done", ["1.arrived.1"])]


def test_each_cell_is_on_exactly_one_process_by_its_index():
    cells = list(range(7))
    shares = [my_share(cells, rank, 2) for rank in (0, 1)]
    assert shares == [[0, 2, 4, 6], [1, 3, 5]]
