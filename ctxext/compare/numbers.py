"""The numbers of a compare's rows, pure functions of the cells (`ctxext.compare.cells`): perplexity and rank per
length, the ratio to native and its spread over the documents, passkey, cost, effective length, the engines that
serve each row, the --tasks scores; and the few texts of them both renderers write alike. Read by the report
(report.md, results.json: `ctxext.compare.report`), the --page layout (`ctxext.compare.page`) and the decide stage
(`ctxext.compare.decide`); none of them computes a number of its own."""

from __future__ import annotations

import math

from ..tasks.report import EFFECTIVE_RULE, EFFECTIVE_SHARE
from ..tasks.report import effective_lengths as task_effective_lengths
from .ranking import RowNumbers, wilson_interval
from .searches import rung_trials
from .serving import TARGETS, engine_support

PRUNING_RULE = (
    "Screen: every searchable method at its defaults (trial 0 of a `ctxext search` study) on the first calibration "
    "document, objective {objective}. Successive halving: the better half (rounded up) by that value is searched to "
    "the first rung's trials on all calibration documents; after each rung the better half of those still in the "
    "race, by the best value of their search so far, goes on to the next rung (trials {rungs}). {budget}A method "
    "pruned at one length keeps its defaults there in its searched row."
)


# ---------------------------------------------------------------------------------------------- numbers
def overall(cells: list) -> float | None:
    """exp(token-weighted mean NLL) over the documents; None while a cell is missing."""
    if not cells or any(c is None for c in cells):
        return None
    return math.exp(math.fsum(c["nll_sum"] for c in cells) / sum(c["tokens"] for c in cells))


def table_numbers(rows, measured, docs: list[str], lengths: list[int]) -> dict:
    """length -> {native, perplexity {label: value}, rank {label: 1..}}."""
    table = {}
    for length in lengths:
        native = overall([measured.native.get((doc, length)) for doc in docs])
        scored = {}
        for row in rows:
            if row.configs.get(length) is None:
                continue
            value = overall([measured.perplexity.get((row.label, doc, length)) for doc in docs])
            if value is not None:
                scored[row.label] = value
        ranked = sorted(scored, key=scored.get)
        table[length] = {"native": native, "perplexity": scored, "rank": {k: i + 1 for i, k in enumerate(ranked)}}
    return table


def passkey_result(cell: dict | None) -> tuple[int, int] | None:
    return None if cell is None else (cell["correct"], cell["trials"])


def by_depth(cell: dict | None) -> dict[float, float]:
    if cell is None:
        return {}
    depths: dict[float, list] = {}
    for record in cell["records"]:
        depths.setdefault(record["depth"], []).append(bool(record["correct"]))
    return {d: sum(v) / len(v) for d, v in sorted(depths.items())}


def baseline_accuracy(measured, L: int) -> float | None:
    cell = measured.passkey.get(("none", L))
    return None if cell is None else cell["correct"] / cell["trials"]


def cost_numbers(rows, measured, docs: list[str], longest: int) -> dict[str, dict]:
    """label -> prefill seconds and peak memory of its cell on the first held-out document at the longest length,
    and their ratios to the unpatched model's (the 'none' row) where both cells come from the same machine."""
    reference = measured.perplexity.get(("none", docs[0], longest))
    costs = {}
    for row in rows:
        cell = measured.perplexity.get((row.label, docs[0], longest))
        if cell is None:
            continue
        same = reference is not None and reference.get("machine") == cell.get("machine")
        memory, ref_memory = cell.get("peak_memory_bytes"), (reference or {}).get("peak_memory_bytes")
        costs[row.label] = {
            "prefill_seconds": cell.get("seconds"),
            "peak_memory_bytes": memory,
            "memory_kind": cell.get("memory_kind"),
            "prefill_ratio": cell["seconds"] / reference["seconds"] if same and reference.get("seconds") else None,
            "memory_ratio": memory / ref_memory if same and memory is not None and ref_memory else None,
            "machine": cell.get("machine"),
        }
    return costs


def row_numbers(rows, table, measured, lengths, serving, costs, passkey_lengths=None) -> list[RowNumbers]:
    """What ranking reads of each row with every configuration; passkey at the `passkey_lengths` among `lengths`."""
    passkey_at = [n for n in lengths if passkey_lengths is None or n in passkey_lengths]
    out = []
    for row in rows:
        if row.label in measured.failed or any(row.configs.get(n) is None for n in lengths):
            continue
        ratios = {}
        for n in lengths:
            value, native = table[n]["perplexity"].get(row.label), table[n]["native"]
            ratios[n] = value / native if value is not None and native else None
        passkey = {n: passkey_result(measured.passkey.get((row.label, n))) for n in passkey_at}
        support = serving.get(row.label, {})
        out.append(
            RowNumbers(
                row.label,
                ratios,
                passkey,
                {t: support.get(t, {}).get("level") == "exact" for t in TARGETS},
                costs.get(row.label, {}).get("prefill_ratio"),
                candidate=row.method != "none",
                spreads={n: spread for n in lengths if (spread := ratio_spread(measured, row.label, n))},
                searched=searched_parameters(row, lengths),
            )
        )
    return out


def document_ratios(measured, label: str, length: int) -> list[float]:
    """Each held-out document's perplexity / native at `length` (where both cells exist)."""
    ratios = []
    for (row_label, doc, n), cell in measured.perplexity.items():
        if row_label == label and n == length and measured.native.get((doc, n)) is not None:
            ratios.append(overall([cell]) / overall([measured.native[(doc, n)]]))
    return ratios


def ratio_spread(measured, label: str, length: int) -> tuple[float, float] | None:
    """(lowest, highest) per-document ratio to native at `length`, or None without a document."""
    ratios = document_ratios(measured, label, length)
    return (min(ratios), max(ratios)) if ratios else None


def searched_parameters(row, lengths) -> int:
    """How many parameters a searched row's configuration sets beyond the method and its factor (0 at defaults)."""
    if row.kind == "defaults":
        return 0
    keys = {k for n in lengths for k in (row.configs.get(n) or {}) if k not in ("method", "factor")}
    return max(1, len(keys))


def serving_table(plan, rows) -> dict[str, dict]:
    """label -> engine -> {level, how}, for the row's configuration at the longest length."""
    longest = max(plan.lengths)
    table = {}
    for row in rows:
        config = row.configs.get(longest)
        if config is not None:
            try:
                table[row.label] = engine_support(config, plan.model_config, plan.L)
            except Exception as error:  # noqa: BLE001 - a row the engine table cannot read is served by none
                table[row.label] = {"ctxext": {"level": "exact", "how": str(error)}}
    return table


def effective_lengths(measured, labels: list[str], lengths: list[int]) -> dict | None:
    """Per row, the effective length by `ctxext tasks`' rule on passkey accuracy (None without the baseline)."""
    shortest = min(lengths)
    if len(lengths) < 2 or ("none", shortest) not in measured.passkey:
        return None
    rows = [
        {"task": "passkey", "metric": "acc", "method": label, "length": n, "value": c["correct"] / c["trials"]}
        for (label, n), c in measured.passkey.items()
        if label in labels
    ]
    (panel,) = task_effective_lengths(rows, labels)
    pending = [lb for lb in labels if lb != "none" and any((lb, n) not in measured.passkey for n in lengths[1:])]
    return {**panel, "pending": pending}


def effective_length_of(effective: dict | None, label: str) -> int | str | None:
    """A row's effective length: a number of tokens, 'pending' while a passkey cell it needs is missing, or None
    (no length tested passes, or no baseline to measure against)."""
    if effective is None:
        return None
    if label in effective["pending"]:
        return "pending"
    return effective["effective_length"].get(label)


def effective_rule(effective: dict | None, L: int) -> str:
    """The rule of the effective-length column, as `ctxext.tasks.report.effective_lengths` computes it, with what
    it was measured against here."""
    rule = f"{EFFECTIVE_RULE[0].upper()}{EFFECTIVE_RULE[1:]}, here passkey accuracy at the passkey lengths"
    if effective is None:
        return rule + (
            ": not measured (it needs passkey at two lengths or more, and the unpatched model's at the shortest; "
            f"by default L = {L} and every length)."
        )
    if effective["threshold"] is None:
        return rule + f": not measured ({effective['note']})."
    return rule + (
        f" (threshold {effective['threshold']:.2f}: {EFFECTIVE_SHARE:.0%} of the unpatched model's "
        f"{effective['baseline']:.2f} at {effective['baseline_length']}); '<' where no length tested passes, '...' "
        "while a passkey cell is missing."
    )


def task_column(task: str, metric: str) -> str:
    """A task score's column name: the task for RULER's score (and any metric named 'score'), else task metric."""
    return task if metric == "score" else f"{task} {metric}"


def task_scores_of(measured, label: str, lengths: list[int]) -> dict:
    """length -> {column: lm-eval's value} of a row's task cells (--tasks); empty without them."""
    scores = {}
    for n in lengths:
        for score in measured.tasks.get((label, n), []):
            scores.setdefault(str(n), {})[task_column(score["task"], score["metric"])] = score["value"]
    return scores


# ------------------------------------------------------------------------- texts both renderers write alike
def pruning_rule_for(request) -> str:
    final = request.trials or (8 if request.budget is None else 32)
    budget = (
        f"Under --budget ({request.budget:.0f} s of recorded computation, cells and trials) a rung's trials are cut "
        "to what the time left allows, after setting aside each survivor's held-out scoring. "
        if request.budget is not None
        else ""
    )
    return PRUNING_RULE.format(
        objective=request.objective, rungs=", ".join(str(t) for t in rung_trials(final)), budget=budget
    )


def passkey_text(correct: int, trials: int) -> str:
    """'2/3 [0.21, 0.94]': the count and its 95% Wilson interval."""
    low, high = wilson_interval(correct, trials)
    return f"{correct}/{trials} [{low:.2f}, {high:.2f}]"


def spread_text(ratios: list[float]) -> str:
    """' (1.001-1.007)': the held-out documents' range of ratios to native, where there are two or more."""
    return f" ({min(ratios):.3f}-{max(ratios):.3f})" if len(ratios) > 1 else ""


def describe_params(config: dict | None) -> str:
    if config is None:
        return "-"
    shown = {k: v for k, v in config.items() if k not in ("method", "factor", "original_max_position_embeddings")}
    if "long_factor" in shown:
        factors = shown.pop("long_factor")
        shown["long_factor"] = f"{len(factors)} pairs, {min(factors):.2f}..{max(factors):.2f}"
    if not shown:
        return "defaults"
    return ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in shown.items())
