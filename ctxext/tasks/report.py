"""Task scores side by side: one table per (task, metric) with methods as rows and lengths as columns, and a
heat map with one panel per (task, metric). results.csv is written by ctxext.eval.report.write_csv, results.json
by ctxext.outputs.write_json."""

from __future__ import annotations

import math
from pathlib import Path

from matplotlib.patches import Rectangle

from ..outputs import new_figure, save_figure

CSV_COLUMNS = ["method", "task", "length", "metric", "value", "samples", "seconds", "cached"]
BASELINE = "none"  # the unpatched model's row
EFFECTIVE_SHARE = 0.85
EFFECTIVE_RULE = (
    "effective length: the longest length tested at which the score is at least 85% of the "
    "unpatched model's score at the shortest length tested (RULER-style)"
)


def effective_lengths(rows: list[dict], methods: list[str]) -> list[dict]:
    """Per (task, metric) that has lengths: the threshold (85% of `none` at the shortest length) and, per method,
    the longest length whose score reaches it (None: no length does, or no baseline to measure against)."""
    out = []
    for task, metric in _panels(rows):
        panel = [r for r in rows if r["task"] == task and r["metric"] == metric and r["length"] is not None]
        if not panel:
            continue
        shortest = min(r["length"] for r in panel)
        baseline = next((r["value"] for r in panel if r["method"] == BASELINE and r["length"] == shortest), None)
        usable = baseline is not None and math.isfinite(baseline) and baseline > 0
        threshold = EFFECTIVE_SHARE * baseline if usable else None
        by_method = {}
        for method in methods:
            passed = [
                r["length"]
                for r in panel
                if r["method"] == method
                and threshold is not None
                and r["value"] is not None
                and math.isfinite(r["value"])
                and r["value"] >= threshold
            ]
            by_method[method] = max(passed) if passed else None
        out.append(
            {
                "task": task,
                "metric": metric,
                "baseline_length": shortest,
                "baseline": baseline,
                "threshold": threshold,
                "effective_length": by_method,
                "note": None if usable else f"no positive score of '{BASELINE}' at {shortest} to measure against",
            }
        )
    return out


def _panels(rows: list[dict]) -> list[tuple[str, str]]:
    """(task, metric) pairs in the order they first appear."""
    seen = []
    for row in rows:
        if (row["task"], row["metric"]) not in seen:
            seen.append((row["task"], row["metric"]))
    return seen


def _length_label(length: int | None) -> str:
    if length is None:
        return "all"
    return f"{length // 1024}k" if length % 1024 == 0 else str(length)


def format_score(value: float | None) -> str:
    return "-" if value is None or not math.isfinite(value) else f"{value:.3f}"


def score_tables(rows: list[dict], methods: list[str], lengths: list[int] = ()) -> str:
    """Per (task, metric): methods x lengths (those of the rows, and `lengths` for tasks that take one); '-'
    where a cell has not run. lm-eval's own values (RULER: the fraction of answers found, 0-1)."""
    blocks = []
    for task, metric in _panels(rows):
        panel = [r for r in rows if r["task"] == task and r["metric"] == metric]
        columns = {r["length"] for r in panel}
        if None not in columns:
            columns |= set(lengths)
        lengths_here = sorted(columns, key=lambda n: -1 if n is None else n)
        by_key = {(r["method"], r["length"]): r for r in panel}
        samples = sorted({r["samples"] for r in panel if r["samples"] is not None})
        title = f"{task} ({metric}; {'/'.join(str(s) for s in samples) or '?'} samples per cell)"
        label_width = max(len(title), *(len(m) for m in methods)) + 2
        lines = [title.ljust(label_width) + "".join(f"{_length_label(n):>9}" for n in lengths_here)]
        lines.append("-" * len(lines[0]))
        for method in methods:
            cells = [format_score(by_key[(method, n)]["value"]) if (method, n) in by_key else "-" for n in lengths_here]
            lines.append(method.ljust(label_width) + "".join(f"{c:>9}" for c in cells))
        effective = next(iter(effective_lengths(panel, methods)), None)
        if effective is not None:
            lines.append(_effective_line(effective))
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)


def _effective_line(effective: dict) -> str:
    if effective["threshold"] is None:
        return f"effective length: - ({effective['note']})"
    found = ", ".join(f"{m} {_length_label(n) if n else '-'}" for m, n in effective["effective_length"].items())
    return (
        f"effective length (score >= {EFFECTIVE_SHARE:.0%} of {BASELINE} at "
        f"{_length_label(effective['baseline_length'])} = {effective['threshold']:.3f}): {found}"
    )


def plot_task_heatmap(rows: list[dict], methods: list[str], path: Path, title: str) -> None:
    """One panel per (task, metric): methods (rows) x lengths (columns), coloured 0-1 (or the panel's range when
    its values leave 0-1)."""
    panels = _panels(rows)
    widths = [len({r["length"] for r in rows if (r["task"], r["metric"]) == p}) for p in panels]
    fig = new_figure(
        figsize=(2.2 + sum(1.1 * w + 0.6 for w in widths), 1.8 + 0.45 * len(methods)), layout="constrained"
    )
    axes = fig.subplots(1, len(panels), squeeze=False, sharey=True, gridspec_kw={"width_ratios": widths})
    image = None
    for ax, (task, metric) in zip(axes[0], panels):
        panel = [r for r in rows if r["task"] == task and r["metric"] == metric]
        lengths = sorted({r["length"] for r in panel}, key=lambda n: -1 if n is None else n)
        by_key = {(r["method"], r["length"]): r["value"] for r in panel}
        grid = [[by_key.get((m, n), float("nan")) for n in lengths] for m in methods]
        values = [v for row in grid for v in row if math.isfinite(v)]
        low, high = (0.0, 1.0) if all(0 <= v <= 1 for v in values) else (min(values), max(values))
        image = ax.imshow(grid, vmin=low, vmax=high, cmap="RdYlGn", aspect="auto")
        for i, row in enumerate(grid):
            for j, value in enumerate(row):
                ax.text(
                    j, i, format_score(value) if math.isfinite(value) else "-", ha="center", va="center", fontsize=8
                )
        effective = next(iter(effective_lengths(panel, methods)), None)
        for i, method in enumerate(methods):  # a frame around each method's effective length
            n = effective["effective_length"].get(method) if effective else None
            if n is not None:
                ax.add_patch(Rectangle((lengths.index(n) - 0.5, i - 0.5), 1, 1, fill=False, linewidth=2))
        ax.set_xticks(range(len(lengths)), [_length_label(n) for n in lengths])
        ax.set_yticks(range(len(methods)), methods)
        ax.tick_params(axis="y", labelleft=ax is axes[0][0])
        ax.set_xlabel("length")
        ax.set_title(task if metric == "score" else f"{task}\n{metric}", fontsize=9)
    if image is not None:
        fig.colorbar(image, ax=axes[0].tolist(), label="score")
    fig.suptitle(
        f"{title}\nframed: each method's effective length (>= {EFFECTIVE_SHARE:.0%} of {BASELINE} at the "
        f"shortest length)",
        fontsize=10,
    )
    save_figure(fig, path)
