"""The decide stage of a compare: more passkey trials where they decide the recommendation.

After the ordinary cells, the *candidates* of a serving target are the rows tied with its best-ranked row
(`ranking.tied_rows`: their Wilson intervals and per-document spreads all overlap). While a target's leader is not
separated from every other candidate, each round doubles the candidates' passkey trials at the lengths where their
intervals overlap the leader's (3 -> 6 -> 12 with three depths and one key each), in *blocks* of the table's size:
block b (b >= 1) is the same depths and number of keys, seeded by 100 + b, the same keys for every row, each block a
cell (`Cells.passkey_block`) kept as soon as it is computed, so the same command resumes them. A target stops when

- its leader is **separated** from every other row it serves (the ranking with every trial so far decides it),
- its candidates reach the **trial cap** (--max-passkey-trials, rounded up to whole blocks), or
- the next round does not fit the **budget** left (--budget): its blocks not yet kept, at the planner's estimate
  (`plan.passkey_seconds`: one forward pass per trial, from the model's FLOPs and the measured matmul rate),
  against the recorded seconds spent so far;

report-only (nothing computed) stops where a block is not kept: **cells missing**. `decide` is the loop, on any
`TrialSource`; `SessionTrials` is the source of a compare's session. Every decision reads only kept cells and their
recorded seconds, so a resumed run decides the same.
"""

from __future__ import annotations

import math
from typing import Protocol

from .numbers import baseline_accuracy, cost_numbers, row_numbers, serving_table, table_numbers
from .plan import passkey_seconds
from .ranking import RowNumbers, tied_rows, wilson_interval

SEPARATED, TRIAL_CAP, BUDGET, MISSING = "separated", "trial cap", "budget", "cells missing"


class TrialSource(Protocol):
    """What the decide loop reads and asks for."""

    def numbers(self) -> list[RowNumbers]: ...  # every row as ranking reads it, all trials so far
    def baseline(self) -> float | None: ...  # the unpatched model's passkey accuracy inside its window
    def blocks(self, label: str, length: int) -> int: ...  # blocks of trials the row has at `length`
    def cost(self, label: str, length: int, upto: int) -> float: ...  # seconds to bring it to `upto` blocks
    def add(self, label: str, length: int, upto: int) -> bool: ...  # bring it there (False: a block is missing)
    def seconds_left(self) -> float | None: ...  # None: no budget


def overlapping_lengths(leader: RowNumbers, other: RowNumbers) -> list[int]:
    """The passkey lengths where the two rows' Wilson intervals overlap (where more trials could separate them)."""
    out = []
    for n in sorted(leader.passkey.keys() & other.passkey.keys()):
        a, b = leader.passkey[n], other.passkey[n]
        if a and b:
            (lo_a, hi_a), (lo_b, hi_b) = wilson_interval(*a), wilson_interval(*b)
            if not (hi_a < lo_b or hi_b < lo_a):
                out.append(n)
    return out


def wanted_blocks(ties: dict[str, list[RowNumbers]], upto: int) -> dict[tuple[str, int], int]:
    """(label, length) -> `upto` for every candidate of an undecided target at the lengths where it overlaps the
    target's leader (the leader itself wherever it overlaps any of them)."""
    wanted = {}
    for tied in ties.values():
        leader = tied[0]
        for other in tied[1:]:
            for n in overlapping_lengths(leader, other):
                wanted[(leader.label, n)] = wanted[(other.label, n)] = upto
    return wanted


def decide(source: TrialSource, targets, block_size: int, max_trials: int, log=lambda line: None) -> dict:
    """target -> {"decided": separated | trial cap | budget | cells missing, "trials": the trials a length its
    candidates reached, "cap", "candidates": every row that was one, "added": trials added for it, ...}."""
    cap = max(1, math.ceil(max_trials / block_size))
    records = {t: {"candidates": [], "added": 0, "cap": cap * block_size} for t in targets}
    level, open_targets = 1, list(targets)
    while open_targets:
        numbers, baseline = source.numbers(), source.baseline()
        ties = {t: tied_rows(numbers, baseline, t) for t in open_targets}
        for target, tied in ties.items():
            seen = records[target]["candidates"]
            seen += [r.label for r in tied if len(tied) > 1 and r.label not in seen]
            if len(tied) <= 1:
                records[target].update(decided=SEPARATED, trials=level * block_size)
        ties = {t: tied for t, tied in ties.items() if len(tied) > 1}
        open_targets = list(ties)
        upto = min(2 * level, cap)
        wanted = wanted_blocks(ties, upto)
        needed = {k: v for k, v in wanted.items() if source.blocks(*k) < v}
        if level < cap and not needed:  # every candidate already holds the next round's trials
            level = upto
            continue
        stop = next_round_stop(source, needed, level, cap)
        if stop is not None:
            for target in open_targets:
                records[target].update(decided=stop[0], trials=level * block_size, **stop[1])
            break
        for target, tied in ties.items():
            records[target]["added"] += sum(upto - source.blocks(*k) for k in needed if k[0] in {r.label for r in tied})
        log(f"decide: {len(needed)} row lengths to {upto * block_size} passkey trials ({', '.join(open_targets)})")
        complete = [source.add(label, n, v) for (label, n), v in needed.items()]
        if not all(complete):
            pending = {"next_trials": upto * block_size, "pending": complete.count(False), "of": len(complete)}
            for target in open_targets:
                records[target].update(decided=MISSING, trials=level * block_size, **pending)
            break
        level = upto
    for record in records.values():
        record["added"] *= block_size
    return records


def next_round_stop(source: TrialSource, needed: dict, level: int, cap: int) -> tuple[str, dict] | None:
    """Why the next round does not start (the cap, the budget), with what the record says of it; None: it starts."""
    if level >= cap:
        return TRIAL_CAP, {}
    left = source.seconds_left()
    if left is None:
        return None
    cost = math.fsum(source.cost(label, n, upto) for (label, n), upto in needed.items())
    if cost > left:
        return BUDGET, {"needed_seconds": cost, "seconds_left": max(0.0, left)}
    return None


# ------------------------------------------------------------------------------------------ a session
def merged_passkey(base: dict, blocks: list[dict]) -> dict:
    """A row's passkey cell with its further blocks: counts, records and seconds together; `added` keeps each
    block's key, counts, seconds and machine (the base cell's own fields stay as they are)."""
    if not blocks:
        return base
    return {
        **base,
        "correct": base["correct"] + sum(b["correct"] for b in blocks),
        "trials": base["trials"] + sum(b["trials"] for b in blocks),
        "records": [*base["records"], *(r for b in blocks for r in b["records"])],
        "seconds": base.get("seconds", 0.0) + math.fsum(b.get("seconds", 0.0) for b in blocks),
        "blocks": 1 + len(blocks),
        "added": [{k: b.get(k) for k in ("key", "correct", "trials", "seconds", "machine")} for b in blocks],
    }


class SessionTrials:
    """The decide loop's source on a compare session: its rows' numbers from the cells, further blocks as cells
    (found, or computed unless report-only), merged into the session's passkey measurements."""

    def __init__(self, session, rows: list):
        self.session, self.rows = session, rows
        self.by_label = {r.label: r for r in rows}
        self.serving = serving_table(session.plan, rows)
        self.blocks_of: dict[tuple[str, int], list[dict]] = {}
        self.bases: dict[tuple[str, int], dict] = {}  # the table's own cells, before any block was merged
        self.missing: list[str] = []

    def numbers(self) -> list[RowNumbers]:
        plan, measured = self.session.plan, self.session.measured
        docs = [d.name for d in plan.held_out]
        table = table_numbers(self.rows, measured, docs, plan.lengths)
        costs = cost_numbers(self.rows, measured, docs, max(plan.lengths))
        return row_numbers(self.rows, table, measured, plan.lengths, self.serving, costs, plan.passkey_lengths)

    def baseline(self) -> float | None:
        return baseline_accuracy(self.session.measured, self.session.plan.L)

    def blocks(self, label: str, length: int) -> int:
        return 1 + len(self.blocks_of.get((label, length), []))

    def block(self, label: str, length: int, block: int, find_only: bool = False) -> dict | None:
        request, config = self.session.request, self.by_label[label].configs[length]
        cells = self.session.cells
        depths, keys = request.passkey_depths, request.passkey_trials
        return cells.passkey_block(label, config, length, depths, keys, block, find_only=find_only)

    def cost(self, label: str, length: int, upto: int) -> float:
        """The planner's estimate for the blocks up to `upto` not kept yet (kept ones cost nothing more)."""
        plan, request = self.session.plan, self.session.request
        size = len(request.passkey_depths) * request.passkey_trials
        absent = [b for b in range(self.blocks(label, length), upto) if self.block(label, length, b, True) is None]
        return passkey_seconds(plan, length, size * len(absent))

    def add(self, label: str, length: int, upto: int) -> bool:
        measured = self.session.measured
        for block in range(self.blocks(label, length), upto):
            found = self.block(label, length, block)
            if found is None:
                self.missing += [f"passkey trials: {label} at {length}, block {b}" for b in range(block, upto)]
                return False
            self.blocks_of.setdefault((label, length), []).append(found)
        base = self.bases.setdefault((label, length), measured.passkey[(label, length)])
        measured.passkey[(label, length)] = merged_passkey(base, self.blocks_of.get((label, length), []))
        return True

    def seconds_left(self) -> float | None:
        return None if self.session.request.budget is None else self.session.seconds_left()
