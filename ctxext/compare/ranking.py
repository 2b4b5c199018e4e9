"""How compared rows are ranked and which one is recommended per serving target: pure functions on numbers.

The rule (written into every report, `RANKING_RULE`):

1. **Needle tier first.** At each compared length a row *keeps* the needle when its passkey accuracy is at least
   `KEEP_FRACTION` of the unpatched model's accuracy inside its trained window (1.0 when that was not measured),
   *finds it sometimes* when it is right at least once, and *loses* it otherwise; a row's tier is its worst
   length's. A row in a better tier ranks above every row in a worse one, whatever their perplexities.
2. **Then held-out perplexity**: the geometric mean over the lengths of perplexity / native (lower first).
3. **Then cost**: prefill time relative to the unpatched model at the largest length (lower first; unknown last),
   then the label (a stable order).

Only rows with every number (each length's perplexity and passkey) are ranked. The recommendation for a target is
the best-ranked row that target serves exactly (`ctxext.compare.serving`); the unpatched model ('none') is
ranked, as the reference, but never recommended.

**Ties.** A few passkey trials and held-out documents rarely separate two rows: 2/3 against 3/3 is one trial, and
the 95% Wilson interval of 2/3 runs from 0.21 to 0.94. Two rows are *separated* when at some passkey length their
Wilson intervals do not overlap, or at some length the spreads of their per-document perplexity ratios do not
overlap (with one held-out document a spread is a point). The rows a target serves that are not separated from its
best-ranked one are tied with it; among them the recommendation prefers the better retrieval (all lengths'
correct answers over all trials), then fewer searched parameters (a row at its defaults first), then the rank, and
it says which rows it was tied with.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

KEEP_FRACTION = 0.9
TIERS = {2: "keeps the needle", 1: "finds it sometimes", 0: "loses the needle"}
RANKING_RULE = (
    "Rows are ranked by needle tier first: at each length a row keeps the needle when its passkey accuracy is at "
    f"least {KEEP_FRACTION:.0%} of the unpatched model's inside its trained window, finds it sometimes when it is "
    "right at least once, and loses it otherwise; its tier is its worst length's, and a row in a better tier ranks "
    "above every row in a worse one. Within a tier, by the geometric mean over the lengths of held-out perplexity / "
    "native (lower first), then by prefill time relative to the unpatched model at the largest length. Only rows "
    "with every number are ranked; the recommendation for a serving target is the best-ranked row it serves exactly "
    "(the unpatched model, 'none', is ranked as the reference but never recommended)."
)


@dataclass
class RowNumbers:
    """What ranking reads of one row: its ratios to native and passkey results per length, which engines serve it
    exactly, and its cost."""

    label: str
    ratios: dict[int, float | None]  # length -> perplexity / native
    passkey: dict[int, tuple[int, int] | None]  # length -> (correct, trials)
    serving: dict[str, bool] = field(default_factory=dict)  # target -> served exactly
    prefill_ratio: float | None = None
    candidate: bool = True  # False for the unpatched model: ranked, as the reference, but never recommended
    spreads: dict[int, tuple[float, float]] = field(default_factory=dict)  # length -> per-document ratio range
    searched: int = 0  # how many parameters were searched (0: the method's defaults)

    @property
    def retrieval(self) -> float:
        """Correct passkey answers over all trials, every length together."""
        results = [p for p in self.passkey.values() if p is not None]
        return sum(c for c, _ in results) / max(1, sum(t for _, t in results))

    @property
    def complete(self) -> bool:
        return (
            bool(self.ratios)
            and all(v is not None for v in self.ratios.values())
            and all(p is not None and p[1] > 0 for p in self.passkey.values())
        )


def needle_tier(passkey: dict[int, tuple[int, int] | None], baseline_accuracy: float | None) -> int:
    """2 keeps, 1 finds it sometimes, 0 loses (see the module docstring); the worst length's."""
    reference = 1.0 if baseline_accuracy is None or baseline_accuracy <= 0 else baseline_accuracy
    tiers = []
    for result in passkey.values():
        correct, trials = result
        accuracy = correct / trials
        tiers.append(2 if accuracy >= KEEP_FRACTION * reference - 1e-12 else 1 if correct > 0 else 0)
    return min(tiers) if tiers else 0


def mean_ratio(ratios: dict[int, float]) -> float:
    """The geometric mean of the ratios to native over the lengths."""
    return math.exp(math.fsum(math.log(r) for r in ratios.values()) / len(ratios))


def rank_key(row: RowNumbers, baseline_accuracy: float | None) -> tuple:
    cost = row.prefill_ratio if row.prefill_ratio is not None else math.inf
    return (-needle_tier(row.passkey, baseline_accuracy), mean_ratio(row.ratios), cost, row.label)


def rank_rows(rows: list[RowNumbers], baseline_accuracy: float | None) -> list[RowNumbers]:
    """The complete rows, best first (the rule above)."""
    return sorted((r for r in rows if r.complete), key=lambda r: rank_key(r, baseline_accuracy))


def wilson_interval(correct: int, trials: int, z: float = 1.96) -> tuple[float, float]:
    """The 95% Wilson score interval of `correct` successes in `trials` (Wilson 1927), as (low, high)."""
    if trials <= 0:
        return 0.0, 1.0
    p, z2 = correct / trials, z * z
    centre = (p + z2 / (2 * trials)) / (1 + z2 / trials)
    half = z * math.sqrt(p * (1 - p) / trials + z2 / (4 * trials * trials)) / (1 + z2 / trials)
    return max(0.0, centre - half), min(1.0, centre + half)


def _disjoint(a: tuple[float, float], b: tuple[float, float]) -> bool:
    return a[1] < b[0] or b[1] < a[0]


def separated(a: RowNumbers, b: RowNumbers) -> bool:
    """Whether the evidence tells the two rows apart (see the module docstring: Wilson intervals, spreads)."""
    for length in a.passkey.keys() & b.passkey.keys():
        found_a, found_b = a.passkey[length], b.passkey[length]
        if found_a and found_b and _disjoint(wilson_interval(*found_a), wilson_interval(*found_b)):
            return True
    for length in a.ratios.keys() & b.ratios.keys():
        spread_a = a.spreads.get(length) or (a.ratios[length], a.ratios[length])
        spread_b = b.spreads.get(length) or (b.ratios[length], b.ratios[length])
        if _disjoint(spread_a, spread_b):
            return True
    return False


def served_ranked(rows: list[RowNumbers], baseline_accuracy: float | None, target: str) -> list[RowNumbers]:
    """The complete candidate rows `target` serves exactly, best-ranked first."""
    ranked = rank_rows(rows, baseline_accuracy)
    return [r for r in ranked if r.candidate and (target == "ctxext" or r.serving.get(target))]


def tied_rows(rows: list[RowNumbers], baseline_accuracy: float | None, target: str) -> list[RowNumbers]:
    """The best-ranked row `target` serves and every row it serves that the evidence does not separate from it,
    in rank order (empty where it serves none)."""
    served = served_ranked(rows, baseline_accuracy, target)
    return [r for r in served if r is served[0] or not separated(served[0], r)]


def recommend(rows: list[RowNumbers], baseline_accuracy: float | None, targets) -> dict[str, RowNumbers | None]:
    """target -> the row to use: among the rows tied with the best-ranked one it serves, the better retrieval,
    then fewer searched parameters, then the rank (None: no complete row it serves)."""
    picks = {}
    for target in targets:
        tied = tied_rows(rows, baseline_accuracy, target)
        order = {id(r): i for i, r in enumerate(tied)}
        picks[target] = min(tied, key=lambda r: (-r.retrieval, r.searched, order[id(r)])) if tied else None
    return picks


def tie_note(pick: RowNumbers, tied: list[RowNumbers]) -> str:
    """What the recommendation says of the rows it was tied with ('' where none was)."""
    others = [r.label for r in tied if r is not pick]
    if not others:
        return ""
    trials = sorted({p[1] for r in tied for p in r.passkey.values() if p})
    found = ", ".join(f"{p[0]}/{p[1]}" for p in pick.passkey.values() if p)
    return (
        f"{pick.label} and {', '.join(others)} are not separated by {'/'.join(map(str, trials))} passkey trials a "
        f"length and the held-out documents' spread; {pick.label} found {found}"
    )


def decision_note(decided: dict | None, pick: RowNumbers, tied: list[RowNumbers]) -> str:
    """What the recommendation says of how the decide stage ended ('' where it added no trials and left no tie)."""
    if not decided:
        return ""
    reason, trials = decided["decided"], decided["trials"]
    if reason == "separated":
        others = [label for label in decided["candidates"] if label != pick.label]
        return (
            f"{pick.label} is separated from {', '.join(others)} after {trials} passkey trials a length"
            if others
            else ""
        )
    if reason == "trial cap":
        return f"more passkey trials stopped at the cap, {decided['cap']} a length (--max-passkey-trials)"
    if reason == "budget":
        return (
            f"more passkey trials stopped at {trials} a length by the budget: the next round needs about "
            f"{decided['needed_seconds']:.0f} s, {decided['seconds_left']:.0f} s are left"
        )
    return (
        f"more passkey trials are under way: {decided['pending']} of the {decided['of']} row lengths going from "
        f"{trials} to {decided['next_trials']} trials lack kept cells (the same command computes them)"
    )


def note_line(tie: str, why: str) -> str | None:
    """The line under a recommendation table for its tie note and decision note (None: nothing to say)."""
    if not tie and not why:
        return None
    return (f"- **Not separated:** {tie}" + (f"; {why}" if why else "") if tie else f"- **Separated:** {why}") + "."


def recommendation_notes(picks) -> list[str]:
    """The lines under a recommendation table, for (pick, tied, decided) per target: each tie with why the added
    trials stopped, and each tie the added trials broke; one line for what several targets share."""
    lines = [note_line(tie_note(p, tied), decision_note(d, p, tied)) for p, tied, d in picks if p is not None]
    return sorted(set(lines) - {None})
