"""Results as a table (stdout), results.csv and PNG plots (in ctxext.outputs' one plot style); results.json is
written by ctxext.outputs.write_json."""

from __future__ import annotations

import csv
import math
from pathlib import Path

from matplotlib.ticker import LogLocator, NullFormatter, ScalarFormatter

from ..outputs import atomic_file, new_figure, save_figure


def format_perplexity(value: float) -> str:
    if not math.isfinite(value):
        return "n/a"
    return f"{value:.2f}" if value < 1e4 else f"{value:.3g}"


def perplexity_table(rows: list[dict], methods: list[str], lengths: list[int]) -> str:
    """Methods x lengths, then per length: tokens scored (the same for every method) and documents skipped."""
    by_key = {(r["method"], r["length"]): r for r in rows}
    label_width = max([len("method")] + [len(m) for m in methods] + [len("documents skipped")])
    width = max(10, *(len(str(n)) + 2 for n in lengths))
    lines = ["perplexity".ljust(label_width) + "".join(f"{n:>{width}}" for n in lengths)]
    lines.append("-" * len(lines[0]))
    for method in methods:
        cells = [
            format_perplexity(by_key[(method, n)]["perplexity"]) if (method, n) in by_key else "-" for n in lengths
        ]
        lines.append(method.ljust(label_width) + "".join(f"{c:>{width}}" for c in cells))
    lines.append("-" * len(lines[0]))
    first = methods[0]
    for key, title in (
        ("tokens_scored", "tokens scored"),
        ("windows", "windows"),
        ("documents", "documents"),
        ("documents_skipped", "documents skipped"),
    ):
        cells = [str(by_key[(first, n)][key]) if (first, n) in by_key else "-" for n in lengths]
        lines.append(title.ljust(label_width) + "".join(f"{c:>{width}}" for c in cells))
    return "\n".join(lines)


def passkey_table(rows: list[dict], methods: list[str], lengths: list[int]) -> str:
    """Methods x lengths: accuracy (correct/trials) per cell."""
    by_key = {(r["method"], r["length"]): r for r in rows}
    label_width = max(len("passkey accuracy"), *(len(m) for m in methods))
    width = max(12, *(len(str(n)) + 2 for n in lengths))
    lines = ["passkey accuracy".ljust(label_width) + "".join(f"{n:>{width}}" for n in lengths)]
    lines.append("-" * len(lines[0]))
    for method in methods:
        cells = []
        for n in lengths:
            r = by_key.get((method, n))
            cells.append(f"{r['accuracy']:.0%} ({r['correct']}/{r['trials']})" if r else "-")
        lines.append(method.ljust(label_width) + "".join(f"{c:>{width}}" for c in cells))
    return "\n".join(lines)


def write_csv(path: Path, rows: list[dict], columns: list[str]) -> None:
    with atomic_file(path) as staging, open(staging, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=columns, extrasaction="ignore")
        writer.writeheader()
        for row in rows:
            writer.writerow({k: (";".join(v) if isinstance(v, list) else v) for k, v in row.items()})


def trained_context_in(model: dict) -> int | None:
    """C, the trained context, from a results.json `model` block: its `trained_context`, or, in a file written
    before that key, `original_max_position_embeddings` (which held C there)."""
    return model.get("trained_context", model.get("original_max_position_embeddings"))


def plot_perplexity(
    rows: list[dict], methods: list[str], path: Path, title: str, trained_context: int | None = None
) -> None:
    """Perplexity against evaluated length, one line per method (log y: unscaled RoPE blows up past L)."""
    fig = new_figure(figsize=(7.5, 4.8))
    ax = fig.subplots()
    for method in methods:
        points = sorted(
            (r["length"], r["perplexity"]) for r in rows if r["method"] == method and math.isfinite(r["perplexity"])
        )
        if points:
            ax.plot(*zip(*points), marker="o", label=method)
    if trained_context:
        ax.axvline(trained_context, color="grey", lw=0.8, ls="--")
        ax.text(
            trained_context,
            ax.get_ylim()[1],
            f" trained context C = {trained_context}",
            va="top",
            fontsize=8,
            color="grey",
        )
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")

    # Plain numbers on the log axis: perplexities rarely span a decade, so decade ticks alone would say little.
    ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 1.5, 2.0, 3.0, 4.0, 5.0, 6.0, 8.0)))
    ax.yaxis.set_major_formatter(ScalarFormatter())
    ax.yaxis.set_minor_formatter(NullFormatter())
    lengths = sorted({r["length"] for r in rows})
    ax.set_xticks(lengths, [f"{n // 1024}k" if n % 1024 == 0 else str(n) for n in lengths])
    ax.set_xlabel("evaluated context (tokens)")
    ax.set_ylabel("perplexity (lower is better)")
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, path)


def plot_passkey_heatmap(
    rows: list[dict], methods: list[str], lengths: list[int], depths: list[float], path: Path, title: str
) -> None:
    """One panel per method: accuracy by depth (rows) and length (columns)."""
    fig = new_figure(figsize=(1.6 + 1.3 * len(lengths) * len(methods), 3.8), layout="constrained")
    axes = fig.subplots(1, len(methods), squeeze=False, sharey=True)
    by_key = {(r["method"], r["length"], r["depth"]): r["accuracy"] for r in rows}
    image = None
    for ax, method in zip(axes[0], methods):
        grid = [[by_key.get((method, n, d), float("nan")) for n in lengths] for d in depths]
        image = ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
        for i, row in enumerate(grid):
            for j, value in enumerate(row):
                if math.isfinite(value):
                    ax.text(j, i, f"{value:.0%}", ha="center", va="center", fontsize=8)
        ax.set_xticks(range(len(lengths)), [f"{n // 1024}k" if n % 1024 == 0 else str(n) for n in lengths])
        ax.set_yticks(range(len(depths)), [f"{d:.0%}" for d in depths])
        ax.tick_params(axis="y", labelleft=ax is axes[0][0])
        ax.set_xlabel("prompt length")
        ax.set_title(method, fontsize=9)
    axes[0][0].set_ylabel("passkey depth")
    fig.colorbar(image, ax=axes[0].tolist(), label="accuracy")
    fig.suptitle(title, fontsize=10)
    save_figure(fig, path)
