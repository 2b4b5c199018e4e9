"""Task scores side by side: one table per (task, metric) with methods as rows and lengths as columns, and a
heat map with one panel per (task, metric). results.json, results.csv and the JSON/CSV writers are
ctxext.eval.report's."""

from __future__ import annotations

import math
from pathlib import Path

CSV_COLUMNS = ["method", "task", "length", "metric", "value", "samples", "seconds", "cached"]


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
            cells = [format_score(by_key[(method, n)]["value"]) if (method, n) in by_key else "-"
                     for n in lengths_here]
            lines.append(method.ljust(label_width) + "".join(f"{c:>9}" for c in cells))
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)


def plot_task_heatmap(rows: list[dict], methods: list[str], path: Path, title: str) -> None:
    """One panel per (task, metric): methods (rows) x lengths (columns), coloured 0-1 (or the panel's range when
    its values leave 0-1)."""
    from matplotlib.figure import Figure

    panels = _panels(rows)
    widths = [len({r["length"] for r in rows if (r["task"], r["metric"]) == p}) for p in panels]
    fig = Figure(figsize=(2.2 + sum(1.1 * w + 0.6 for w in widths), 1.8 + 0.45 * len(methods)), layout="constrained")
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
                ax.text(j, i, format_score(value) if math.isfinite(value) else "-", ha="center", va="center",
                        fontsize=8)
        ax.set_xticks(range(len(lengths)), [_length_label(n) for n in lengths])
        ax.set_yticks(range(len(methods)), methods)
        ax.tick_params(axis="y", labelleft=ax is axes[0][0])
        ax.set_xlabel("length")
        ax.set_title(task if metric == "score" else f"{task}\n{metric}", fontsize=9)
    if image is not None:
        fig.colorbar(image, ax=axes[0].tolist(), label="score")
    fig.suptitle(title, fontsize=10)
    fig.savefig(path, dpi=120, bbox_inches="tight")
