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


def recommend(rows: list[RowNumbers], baseline_accuracy: float | None, targets) -> dict[str, RowNumbers | None]:
    """target -> the best-ranked row it serves exactly (None: no complete row it serves)."""
    ranked = rank_rows(rows, baseline_accuracy)
    candidates = [r for r in ranked if r.candidate]
    return {t: next((r for r in candidates if t == "ctxext" or r.serving.get(t)), None) for t in targets}
