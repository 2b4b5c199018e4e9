"""The decide stage of `ctxext compare` (ctxext.compare.decide): more passkey trials for the rows tied with a
recommendation, until its leader is separated, the trial cap or the budget. The loop on a fake trial source drawn
from fixed true accuracies, checked against Wilson intervals written out here; then a tiny model's report and page
from cached cells where two rows stay tied, saying the tie and why the trials stopped."""

import json
import math
import random
from dataclasses import replace

import pytest

from ctxext.compare import CompareRequest, RowNumbers, run_compare
from ctxext.compare.decide import decide
from ctxext.run_options import DataOptions, RuntimeOptions
from tests.helpers import save_tiny_checkpoint, tiny_model

N = 16384
BLOCK = 3  # three depths, one key each: the table's passkey cell


def wilson(correct: int, trials: int) -> tuple[float, float]:
    """The 95% Wilson score interval, written out (Wilson 1927): the test's own, not ctxext's."""
    z, n = 1.96, trials
    centre, spread = correct + z * z / 2, z * math.sqrt(correct * (n - correct) / n + z * z / 4)
    return (centre - spread) / (n + z * z), (centre + spread) / (n + z * z)


def overlap(a: tuple[int, int], b: tuple[int, int]) -> bool:
    (lo_a, hi_a), (lo_b, hi_b) = wilson(*a), wilson(*b)
    return not (hi_a < lo_b or hi_b < lo_a)


class Fake:
    """A trial source: each row has a true passkey accuracy; trial i of a row is right when its own seeded draw
    falls under it. Ratios and spreads are fixed; `cost_per_block` seconds each, against a budget (None: none)."""

    def __init__(self, rows: dict, budget: float | None = None, cost_per_block: float = 10.0):
        self.rows = rows  # label -> (true accuracy, ratio, spread, served by vllm)
        self.held = {label: 1 for label in rows}  # blocks of trials each row has
        self.added: list[tuple[str, int, int]] = []
        self.budget, self.cost_per_block, self.spent = budget, cost_per_block, 0.0

    def outcomes(self, label: str) -> tuple[int, int]:
        accuracy = self.rows[label][0]
        trials = self.held[label] * BLOCK
        return sum(random.Random(f"{label}-{i}").random() < accuracy for i in range(trials)), trials

    def numbers(self) -> list[RowNumbers]:
        return [
            RowNumbers(
                label, {N: ratio}, {N: self.outcomes(label)}, {"ctxext": True, "vllm": vllm}, spreads={N: spread}
            )
            for label, (_, ratio, spread, vllm) in self.rows.items()
        ]

    def baseline(self):
        return None

    def blocks(self, label, length):
        return self.held[label]

    def cost(self, label, length, upto):
        return (upto - self.held[label]) * self.cost_per_block

    def add(self, label, length, upto):
        self.added.append((label, length, upto))
        self.spent += self.cost(label, length, upto)
        self.held[label] = upto
        return True

    def seconds_left(self):
        return None if self.budget is None else self.budget - self.spent


TIGHT = (0.99, 1.01)  # per-document ratio ranges that overlap: only the passkey can separate these rows


def test_trials_go_to_the_candidates_only_and_stop_once_the_leader_is_separated():
    fake = Fake(
        {
            "lead": (1.0, 0.99, TIGHT, True),  # always right, best ratio: the leader
            "miss": (0.0, 1.00, TIGHT, False),  # never right: 0/3 overlaps 3/3, 0/6 does not overlap 6/6
            "far": (0.5, 1.50, (1.45, 1.55), True),  # its spread is apart from the leader's: never a candidate
        }
    )
    assert overlap((3, 3), (0, 3)) and not overlap((6, 6), (0, 6))  # the oracle's reason for 6 trials
    records = decide(fake, ["ctxext", "vllm"], BLOCK, 12)
    assert fake.added == [("lead", N, 2), ("miss", N, 2)]  # one round, to 6 trials, only the two tied rows
    assert records["ctxext"] == {
        "decided": "separated", "trials": 6, "cap": 12, "candidates": ["lead", "miss"], "added": 6
    }  # fmt: skip
    assert records["vllm"]["decided"] == "separated" and records["vllm"]["added"] == 0  # vllm serves no rival


@pytest.mark.parametrize("seed", range(6))
def test_the_loop_stops_exactly_when_the_wilson_intervals_part_or_at_the_cap(seed):
    rng = random.Random(seed)
    rival = f"rival{seed}"
    fake = Fake({"lead": (1.0, 0.99, TIGHT, True), rival: (rng.uniform(0.2, 0.9), 1.0, TIGHT, True)})
    records = decide(fake, ["ctxext"], BLOCK, 12)["ctxext"]
    trials = records["trials"]
    lead, other = fake.outcomes("lead"), fake.outcomes(rival)
    assert lead[1] == other[1] == trials and trials in (3, 6, 12)
    # the oracle: separated where the intervals are apart at the trials reached, and not one round earlier
    earlier = [(t, t) for t in (3, 6, 12) if t < trials]
    for t, _ in earlier:
        right = sum(random.Random(f"{rival}-{i}").random() < fake.rows[rival][0] for i in range(t))
        assert overlap((t, t), (right, t)), t  # the loop went on only while they overlapped
    assert records["decided"] == ("trial cap" if overlap(lead, other) else "separated")
    if records["decided"] == "trial cap":
        assert trials == 12


def test_two_rows_that_always_agree_reach_the_cap_and_say_so():
    fake = Fake({"a": (1.0, 0.99, TIGHT, True), "b": (1.0, 1.00, TIGHT, True)})
    records = decide(fake, ["ctxext"], BLOCK, 10)  # 10 rounds up to whole blocks: 12
    assert fake.added == [("a", N, 2), ("b", N, 2), ("a", N, 4), ("b", N, 4)]  # 3 -> 6 -> 12, doubling
    assert records["ctxext"]["decided"] == "trial cap" and records["ctxext"]["trials"] == 12
    assert records["ctxext"]["added"] == 18


def test_a_round_the_budget_left_cannot_fit_is_not_started():
    fake = Fake({"a": (1.0, 0.99, TIGHT, True), "b": (1.0, 1.00, TIGHT, True)}, budget=25.0, cost_per_block=10.0)
    records = decide(fake, ["ctxext"], BLOCK, 12)["ctxext"]
    # round 1: 2 rows x 1 block x 10 s = 20 s of 25; round 2: 2 rows x 2 blocks x 10 s = 40 s, 5 s left
    assert fake.added == [("a", N, 2), ("b", N, 2)]
    assert records["decided"] == "budget" and records["trials"] == 6
    assert records["needed_seconds"] == pytest.approx(40.0) and records["seconds_left"] == pytest.approx(5.0)


# ------------------------------------------------------------------------------------------ tiny model
def again_report(tmp_path) -> str:
    return (tmp_path / "out" / "report.md").read_text()


def cell_files(cells):
    return {p.name: json.loads(p.read_text()) for p in cells.glob("*.json")}


def test_a_tie_more_trials_cannot_break_is_reported_with_why_they_stopped(tmp_path, one_torch_thread):
    """yarn and rerope on a tiny model, their perplexity cells made equal and their table passkey cells 3/3 (what a
    model that finds the key gives; a random one never does): the added blocks (computed, 0/3 here) leave them tied
    at 6 trials, the cap; report.md, results.json and the page say so; report-only with a higher cap stops where
    the cells end, and computes nothing."""
    model = save_tiny_checkpoint(tmp_path / "m", tiny_model("llama", seed=1, max_position_embeddings=128))
    docs = tmp_path / "docs"
    docs.mkdir()
    for name in "abc":
        (docs / f"{name}.txt").write_text(" ".join(f"w{(i * 7 + ord(name)) % 256}" for i in range(400)))
    asked = CompareRequest(
        model=str(model),
        lengths=[256],
        output=tmp_path / "out",
        data=DataOptions(text_files=[str(docs)]),
        methods=["yarn", "rerope"],
        held_out_docs=2,
        search=False,
        max_passkey_trials=0,  # the table's cells only
        runtime=RuntimeOptions(device="cpu", dtype="fp32", progress=False),
    )
    run_compare(asked)
    cells = tmp_path / "out" / "cells"
    files = cell_files(cells)
    yarn = {r["key"]["document"]: r for r in files.values() if r["key"]["kind"] == "perplexity"
            and (r["key"]["config"] or {}).get("method") == "yarn"}  # fmt: skip
    for name, record in files.items():
        key = record["key"]
        method = (key["config"] or {}).get("method")
        if key["kind"] == "perplexity" and method == "rerope":
            record.update(nll_sum=yarn[key["document"]]["nll_sum"], tokens=yarn[key["document"]]["tokens"])
        elif key["kind"] == "passkey" and method in ("yarn", "rerope") and key["length"] == 256:
            record["correct"] = 3
            for trial in record["records"]:
                trial["correct"] = True
        (cells / name).write_text(json.dumps(record))

    page = tmp_path / "page" / "comparison.md"
    results = run_compare(replace(asked, max_passkey_trials=6, page=page)).results
    added = [r for r in cell_files(cells).values() if r["key"].get("block")]
    assert sorted((r["key"]["config"]["method"], r["key"]["block"], r["trials"]) for r in added) == [
        ("rerope", 1, 3), ("yarn", 1, 3)
    ]  # fmt: skip
    found = {r["key"]["config"]["method"]: 3 + r["correct"] for r in added}  # the planted 3/3, then the block
    assert all([t["trial"] for t in r["records"]] == [3, 4, 5] for r in added)  # numbered after the table's 0-2
    rows = {r["label"]: r for r in results["rows"]}
    for method in ("yarn", "rerope"):
        assert rows[method]["passkey"]["256"]["correct"] == found[method]
        assert rows[method]["passkey"]["256"]["trials"] == 6
    assert overlap((found["yarn"], 6), (found["rerope"], 6))  # the oracle: still tied at the cap

    pick = results["recommendations"]["ctxext"]
    assert pick["decided"]["decided"] == "trial cap" and pick["decided"]["trials"] == 6
    assert set(pick["decided"]["candidates"]) == {"yarn", "rerope"} and pick["tied_with"]
    line = f"- **Not separated:** {pick['label']} and {pick['tied_with'][0]} are not separated by 6 passkey trials"
    why = "; more passkey trials stopped at the cap, 6 a length (--max-passkey-trials)."
    report = (tmp_path / "out" / "report.md").read_text()
    assert line in report and why in report
    assert line in page.read_text() and why in page.read_text()
    assert results["recommendations"]["vllm"]["decided"]["decided"] == "separated"  # yarn is all vLLM serves
    assert results["recommendations"]["vllm"]["decided"]["added"] == 0

    before = cell_files(cells)
    resumed = run_compare(replace(asked, max_passkey_trials=6, page=page)).results
    assert cell_files(cells) == before  # the same command finds its blocks: nothing computed again
    assert resumed["recommendations"]["ctxext"]["decided"] == pick["decided"]
    again = run_compare(replace(asked, max_passkey_trials=12, report_only=True)).results
    assert cell_files(cells) == before  # report-only computed nothing
    decided = again["recommendations"]["ctxext"]["decided"]
    assert decided["decided"] == "cells missing" and decided["trials"] == 6
    assert (decided["next_trials"], decided["pending"], decided["of"]) == (12, 2, 2)
    assert "more passkey trials are under way: 2 of the 2 row lengths going from 6 to 12" in again_report(tmp_path)
    assert {f"passkey trials: {m} at 256, block {b}" for m in ("yarn", "rerope") for b in (2, 3)} <= set(
        again["missing"]
    )
