"""The one-page layout of a compare (`--page PAGE.md`): the layout of docs/comparison.md, the SmolLM2 page that
`scripts/compare_methods.py` wrote before `ctxext compare` existed. One table of every row (each method at its
defaults, then its searched rows), perplexity / native and rank per length, passkey, effective length and the
held-out change a search made; the searched parameters; perplexity per document; the run time; the missing cells.
PAGE, PAGE.json (the numbers) and PAGE.png (ratio to native per row and length) are written from the cells so far.

The numbers are report.md's (`ctxext.compare.numbers`) and what is missing (`page_missing`), pure functions of the
cells; `page_state` gathers them and `page_markdown` only formats them.
"""

from __future__ import annotations

import math
import os
import time
from collections import Counter
from pathlib import Path

from ..outputs import atomic_write_text, new_figure, save_figure, write_json
from ..tasks.report import EFFECTIVE_RULE
from .numbers import (
    baseline_accuracy,
    cost_numbers,
    describe_params,
    document_ratios,
    effective_lengths,
    passkey_text,
    pruning_rule_for,
    row_numbers,
    serving_table,
    spread_text,
    table_numbers,
)
from .ranking import recommend, recommendation_notes, tied_rows
from .searches import read_history
from .serving import TARGET_NAMES, TARGETS

NATIVE = "native"
BASELINE = "none"
ROW_COLORS = {"defaults": "C0", "first": "C1", "other": "C2"}  # defaults, the first searched kind, the others


# ---------------------------------------------------------------------------------------------- numbers
def page_rows(rows: list, methods: list[str]) -> list:
    """The rows in the page's order: method by method (as compared), each at its defaults, then its searched rows."""
    order = {m: i for i, m in enumerate(methods)}
    return sorted(rows, key=lambda r: order.get(r.method, len(order)))  # stable: defaults, then searched kinds


def page_missing(rows: list, measured, docs: list[str], lengths: list[int], passkey_lengths: list[int], L: int):
    """What the page still lacks, in its order: native cells, the baseline passkey, then row by row and length by
    length its search (a full search not done), its perplexity cells and its passkey cell."""
    missing = [
        f"perplexity: {NATIVE} at {n} on {doc}" for n in lengths for doc in docs if (doc, n) not in measured.native
    ]
    baseline = L in passkey_lengths and any(r.method == BASELINE for r in rows)
    if baseline and (BASELINE, L) not in measured.passkey and f"{BASELINE} at {L}" not in measured.failed:
        missing.append(f"passkey: {BASELINE} at {L}")
    for row in rows:
        if row.label in measured.failed:  # listed with why, not as missing
            continue
        for n in lengths:
            if row.configs.get(n) is None:
                if row.kind != "defaults":
                    missing.append(f"search: {row.label} at {n} ({row.pending.get(n, 'not searched')})")
                continue
            missing += [
                f"perplexity: {row.label} at {n} on {doc}"
                for doc in docs
                if (row.label, doc, n) not in measured.perplexity
            ]
            if n in passkey_lengths and (row.label, n) not in measured.passkey:
                missing.append(f"passkey: {row.label} at {n}")
    return missing


def machines(measured) -> str:
    """Which machines computed the cells, with how many each ('not recorded' for cells older than the record)."""
    cells = [*measured.native.values(), *measured.perplexity.values(), *measured.passkey.values()]
    cells += [block for cell in measured.passkey.values() for block in cell.get("added", [])]  # the decide stage's
    counts = Counter(c.get("machine", "not recorded") for c in cells)
    return "; ".join(f"{name} ({n} cells)" for name, n in counts.most_common()) or "none yet"


def search_totals(searches: Path) -> tuple[float, int]:
    """(seconds, trials) recorded by every search kept under `searches`."""
    seconds, count = 0.0, 0
    for folder in sorted(searches.iterdir()) if searches.is_dir() else []:
        if folder.is_dir():
            history = read_history(folder)
            seconds += math.fsum(t.get("seconds") or 0.0 for t in history)
            count += len(history)
    return seconds, count


def row_color(row) -> str:
    if row.kind == "defaults":
        return ROW_COLORS["defaults"]
    return ROW_COLORS["first"] if row.label.endswith("(searched)") else ROW_COLORS["other"]


def objective_word(objective: str | None) -> str:
    return {"ppl": "calibration", "needle-ppl": "needle NLL"}.get(objective, objective or "objective")


# --------------------------------------------------------------------------------------------- the page
def page_state(session, rows: list, path: Path) -> dict:
    """Everything the page at `path` shows, from the session's plan, cells and searches."""
    plan, request, measured = session.plan, session.request, session.measured
    docs = [d.name for d in plan.held_out]
    ordered = page_rows(rows, plan.methods)
    passkey_lengths = plan.passkey_lengths
    seconds, trials = search_totals(request.cache_dir / "searches")
    table = table_numbers(ordered, measured, docs, plan.lengths)
    serving = serving_table(plan, ordered)
    costs = cost_numbers(ordered, measured, docs, max(plan.lengths))
    numbers = row_numbers(ordered, table, measured, plan.lengths, serving, costs, passkey_lengths)
    return {
        "plan": plan,
        "request": request,
        "measured": measured,
        "rows": ordered,
        "docs": docs,
        "lengths": plan.lengths,
        "passkey_lengths": passkey_lengths,
        "table": table,
        "serving": serving,
        "recommendations": recommend(numbers, baseline_accuracy(measured, plan.L), TARGETS),
        "ties": {t: tied_rows(numbers, baseline_accuracy(measured, plan.L), t) for t in TARGETS},
        "effective": effective_lengths(measured, [r.label for r in ordered], passkey_lengths),
        "missing": page_missing(ordered, measured, docs, plan.lengths, passkey_lengths, plan.L)
        + [m for m in measured.missing if m.startswith("passkey trials: ")],
        "decisions": session.decisions,
        "machine": session.machine,
        "search_seconds": seconds,
        "search_trials": trials,
        "run_seconds": time.perf_counter() - session.started,
        "cache": Path(os.path.relpath(request.cache_dir.resolve(), path.parent.resolve())).as_posix(),
        "notes": Path(request.page_notes).read_text() if request.page_notes else None,
    }


def protocol_lines(state: dict) -> list[str]:
    plan, request, L = state["plan"], state["request"], state["plan"].L
    depths = request.passkey_depths
    name = request.display_name
    cells = machines(state["measured"])
    lines = [
        f"# Choosing a method: every ctxext method on {name}, at its defaults and searched",
        "",
        f"Written by `ctxext compare --page` (cells cached in `{state['cache']}/`; the same command computes what "
        f"is missing, with `--report-only` nothing). Model: {name} (L = {L}), {plan.dtype_label}, "
        f"{str(plan.runtime['attn_implementation']).upper()}. Cells computed on: {cells}"
        + (
            " (bf16 kernels differ between CPUs: BENCHMARKS.md, 'Comparison report', says by how much)."
            if ";" in cells
            else "."
        ),
        "",
        f"- **Perplexity**: one window over the first N tokens of each held-out document ({', '.join(state['docs'])}), "
        "every token scored; the column is exp(token-weighted mean NLL) over the documents. Lower is better; rank 1 "
        "is the best method at that length.",
        f"- **vs native**: the ratio to the unpatched model in {L}-token windows with stride {L // 2} over the same "
        "tokens (the model's own quality on that text, the project's reference).",
        f"- **Passkey**: accuracy at {', '.join(str(n) for n in state['passkey_lengths'])} tokens, "
        f"{len(depths) * request.passkey_trials} seeded keys at depths {', '.join(f'{d:g}' for d in depths)} "
        "(the Landmark/YaRN format)" + added_trials_text(request) + ".",
        searched_line(state),
        "",
    ]
    return lines


def added_trials_text(request) -> str:
    """What the passkey line says of the decide stage's further trials ('' when none are added)."""
    size = len(request.passkey_depths) * request.passkey_trials
    if request.max_passkey_trials <= size:
        return ""
    return (
        f"; the rows tied with a recommendation get further blocks of {size} keys (seeded by 100 + block), doubling "
        f"a round, until its leader is separated or {request.max_passkey_trials} a length (`ctxext.compare.decide`)"
    )


def searched_line(state: dict) -> str:
    plan, request, rows = state["plan"], state["request"], state["rows"]
    calibration = ", ".join(plan.data["calibration"]).replace("+", " + ")
    kinds = request.full_searches or []
    if not kinds:
        return (
            f"- **Searched**: the screen and successive halving of `ctxext search` studies on calibration text the "
            f"table never scores ({calibration}, first N tokens), objective `{request.objective}`. "
            f"{pruning_rule_for(request)} 'search vs defaults' is the held-out change."
        )
    first, others = kinds[0], kinds[1:]
    text = (
        f"- **Searched**: the best of `ctxext search` ({first.trials} trials per method and length; TPE, LongRoPE by "
        f"CMA-ES from YaRN's factors"
        + ("" if first.objective == "ppl" else f"; objective `{first.objective}`")
        + f") on calibration text the table never scores ({calibration}, first N tokens). 'search vs defaults' is "
        "the held-out change."
    )
    for kind in others:
        text += (
            f" **Searched, {kind.objective}**: the same, {kind.trials} trials, with the objective `{kind.objective}`"
        )
        if kind.objective == "needle-ppl":
            text += (
                f": the mean NLL of the answer tokens of {len(request.passkey_depths)} passkey prompts at N (the "
                "passkey column's depths, keys seeded by 1, not its keys), meant to keep the retrieval a perplexity "
                "search can lose."
            )
        else:
            text += "."
    searched = {r.method for r in rows if r.label.endswith("(searched)")}
    only_others = [m for m in dict.fromkeys(r.method for r in rows if r.kind != "defaults") if m not in searched]
    if only_others and others:
        text += f" {', '.join(only_others)}: searched with {' and '.join(k.objective for k in others)} only."
    unsearched = [
        m
        for m in dict.fromkeys(r.method for r in rows)
        if m != BASELINE and not any(r.method == m and r.kind != "defaults" for r in rows)
    ]
    if unsearched:
        text += f" {', '.join(unsearched)}: no parameter to search but the factor, so no searched row."
    return text


def table_lines(state: dict) -> list[str]:
    lengths, passkey_lengths, table = state["lengths"], state["passkey_lengths"], state["table"]
    rows, effective, measured, L = state["rows"], state["effective"], state["measured"], state["plan"].L
    header = "| method | parameters |" + "".join(f" {n // 1024}k ppl | rank | vs native |" for n in lengths)
    rule = "|---|---|" + "---:|---:|---:|" * len(lengths)
    header += "".join(f" passkey {n // 1024}k |" for n in passkey_lengths)
    header += (" effective length |" if effective else "") + " search vs defaults | served exactly by |"
    rule += "---:|" * len(passkey_lengths) + ("---:|" if effective else "") + "---|---|"
    native_line = f"| **native** (unpatched, {L // 1024}k windows) | - |"
    for n in lengths:
        value = table[n]["native"]
        native_line += f" {value:.2f} | - | 1.00 |" if value else " ... | - | - |"
    native_line += " - |" * len(passkey_lengths) + (" - |" if effective else "") + " - | - |"
    lines = [header, rule, native_line]
    for row in rows:
        params = "searched (below)" if row.kind != "defaults" else row.note or "defaults"
        line = f"| {row.label} | {params} |"
        changes = []
        for n in lengths:
            value, native = table[n]["perplexity"].get(row.label), table[n]["native"]
            if row.configs.get(n) is None:
                line += " ... | | |" if row.kind != "defaults" else " n/a | | |"
                continue
            rank = table[n]["rank"].get(row.label)
            if value and native:
                spread = spread_text(document_ratios(measured, row.label, n))
                line += f" {value:.2f} | {rank} | {value / native:.3f}{spread} |"
            else:
                line += f" {value:.2f} | {rank} | ... |" if value else " ... | | |"
            default = table[n]["perplexity"].get(row.method)
            if row.kind != "defaults" and value and default:
                changes.append(f"{n // 1024}k {100 * (value - default) / default:+.1f}%")
        for n in passkey_lengths:
            cell = measured.passkey.get((row.label, n))
            within = n <= L and row.label != BASELINE  # only the baseline runs there
            line += f" {passkey_text(cell['correct'], cell['trials'])} |" if cell else " - |" if within else " ... |"
        if effective:
            found = effective["effective_length"].get(row.label)
            shortest_patched = min(n for n in passkey_lengths if n > L)
            below = f" < {shortest_patched // 1024}k |"  # no length tested passes
            line += f" {found // 1024}k |" if found else " ... |" if row.label in effective["pending"] else below
        lines.append(line + f" {', '.join(changes) or '-'} | {served_exactly_by(state['serving'], row.label)} |")
    return lines


def served_exactly_by(serving: dict, label: str) -> str:
    """The serving targets that run the row's checkpoint exactly, or '...' before its configuration exists."""
    support = serving.get(label)
    if support is None:
        return "..."
    return ", ".join(TARGET_NAMES[t] for t in TARGETS if support.get(t, {}).get("level") == "exact") or "none"


def recommendation_lines(state: dict) -> list[str]:
    """The page's choice per serving target: the best-ranked row each serves exactly, and how to get it."""
    lengths = state["lengths"]
    lines = [
        "## Which method to use",
        "",
        "Per way of serving, the best-ranked row it serves exactly (every number computed; the ranking is the table's "
        "below), or among the rows the evidence does not separate from it the one with the better retrieval, then "
        "fewer searched parameters; passkey counts carry their 95% Wilson interval. Write its checkpoint from the cached cells with the page's command plus `--report-only "
        "--write-best TARGET:DIR` (llama.cpp: the report's GGUF steps), then serve it as shown.",
        "",
        "| serve with | method | " + " | ".join(f"{n // 1024}k vs native" for n in lengths) + " | passkey | then |",
        "|---|---|" + "---:|" * len(lengths) + "---|---|",
    ]
    for target in TARGETS:
        pick = state["recommendations"].get(target)
        if pick is None:
            lines.append(
                f"| {TARGET_NAMES[target]} | none served exactly with every number |" + " - |" * (len(lengths) + 2)
            )
            continue
        passkey = ", ".join(passkey_text(*result) for result in pick.passkey.values() if result) or "-"
        ratios = " | ".join(f"{pick.ratios[n]:.3f}" for n in lengths)
        lines.append(f"| {TARGET_NAMES[target]} | {pick.label} | {ratios} | {passkey} | `{SERVE_LINES[target]}` |")
    decisions = state["decisions"]
    notes = recommendation_notes(
        [(state["recommendations"].get(t), state["ties"][t], decisions.get(t)) for t in TARGETS]
    )
    lines += ["", *notes] if notes else []
    return [*lines, ""]


SERVE_LINES = {
    "ctxext": "ctxext serve DIR",
    "vllm": "vllm serve DIR",
    "sglang": "python -m sglang.launch_server --model-path DIR",
    "llama.cpp": "llama-server -m DIR.gguf",
}


def effective_lines(state: dict) -> list[str]:
    effective = state["effective"]
    if not effective:
        return []
    if effective["threshold"] is None:  # the unpatched model found no key inside its window
        return ["", f"{EFFECTIVE_RULE[0].upper()}{EFFECTIVE_RULE[1:]}: not measured ({effective['note']})."]
    return [
        "",
        f"{EFFECTIVE_RULE[0].upper()}{EFFECTIVE_RULE[1:]}, here passkey accuracy "
        f"(threshold {effective['threshold']:.2f}, {BASELINE} at {effective['baseline_length']}).",
    ]


def parameter_lines(state: dict) -> list[str]:
    lines = ["", "Searched parameters per length:", ""]
    for row in state["rows"]:
        if row.kind == "defaults":
            continue
        for n in state["lengths"]:
            info = row.search.get(n)
            if info and "pruned" in info:
                lines.append(f"- {row.label} at {n // 1024}k: {info['pruned']}")
            elif info:
                lines.append(
                    f"- {row.label} at {n // 1024}k: {describe_params(row.configs.get(n))}"
                    f" (best of {info['trials']} trials, trial {info['best']}; {objective_word(row.objective)} "
                    f"{info['calibration_defaults']:.2f} -> {info['calibration_best']:.2f})"
                )
    return lines


def document_lines(state: dict) -> list[str]:
    docs, measured = state["docs"], state["measured"]
    lines = ["", "Per document (perplexity):", ""]
    for n in state["lengths"]:
        lines += [f"**{n // 1024}k**", "", f"| method | {' | '.join(docs)} |", "|---|" + "---:|" * len(docs)]
        rows = [(NATIVE, [measured.native.get((doc, n)) for doc in docs])]
        rows += [(r.label, [measured.perplexity.get((r.label, doc, n)) for doc in docs]) for r in state["rows"]]
        for label, cells in rows:
            if any(cells):
                shown = [f"{math.exp(c['nll_sum'] / c['tokens']):.2f}" if c else "..." for c in cells]
                lines.append(f"| {label} | " + " | ".join(shown) + " |")
        lines.append("")
    return lines


def closing_lines(state: dict) -> list[str]:
    measured = state["measured"]
    cells = [*measured.native.values(), *measured.perplexity.values()]
    seconds = (
        math.fsum(c.get("seconds", 0.0) for c in cells)
        + math.fsum(p.get("seconds", 0.0) for p in measured.passkey.values())
        + state["search_seconds"]
    )
    lines = [
        f"**Run time**: {seconds / 3600:.1f} h of computation in the cells and searches so far "
        f"(cells {len(cells)}, passkey cells {len(measured.passkey)}, search trials {state['search_trials']}); "
        f"this run {state['run_seconds'] / 60:.0f} min on {state['machine']}. "
        "Cell times depend on the machine, its threads and its load (BENCHMARKS.md, 'Comparison report').",
        "",
    ]
    failed = measured.failed
    if failed:
        lines += ["Failed here (not missing: they cannot run):", ""]
        lines += [f"- {what}: {why}" for what, why in failed.items()] + [""]
    missing = state["missing"]
    if not missing:
        return lines + ["Every cell is computed."]
    lines += [f"**Partial report: {len(missing)} cells are missing** (run the same command to compute them):", ""]
    lines += [f"- {m}" for m in missing[:60]]
    return lines + ([f"- ... and {len(missing) - 60} more"] if len(missing) > 60 else [])


def notes_lines(state: dict) -> list[str]:
    """--page-notes as given, under its own heading (nothing without it)."""
    notes = state["notes"]
    return ["", "## Notes on rows", "", notes.strip()] if notes else []  # the table ends without a blank line


def page_markdown(state: dict) -> str:
    protocol = protocol_lines(state)
    lines = protocol[:2] + recommendation_lines(state) + protocol[2:]
    lines += table_lines(state) + notes_lines(state) + effective_lines(state) + parameter_lines(state)
    lines += document_lines(state) + closing_lines(state)
    return "\n".join(lines) + "\n"


def page_json(state: dict) -> dict:
    measured = state["measured"]
    cells = {(NATIVE, doc, n): c for (doc, n), c in measured.native.items()} | measured.perplexity
    return {
        "lengths": state["lengths"],
        "documents": state["docs"],
        "table": {str(n): v for n, v in state["table"].items()},
        "rows": [
            {
                "label": r.label,
                "method": r.method,
                "kind": r.kind,
                "objective": r.objective,
                "note": r.note,
                "search": {str(n): v for n, v in r.search.items()},
                "pending": {str(n): v for n, v in r.pending.items()},
                "configs": {str(n): v for n, v in r.configs.items()},
            }
            for r in state["rows"]
        ],
        "passkey": [{"label": k[0], "length": k[1], **v} for k, v in measured.passkey.items()],
        "effective_length": state["effective"],
        "missing": state["missing"],
        "notes": state["notes"],
        "machine": state["machine"],
        "dtype": state["plan"].dtype_label,
        "cells": [
            {
                "label": label,
                "document": doc,
                "length": n,
                "machine": v.get("machine"),
                **{f: v[f] for f in ("nll_sum", "tokens", "seconds")},
            }
            for (label, doc, n), v in cells.items()
        ],
    }


def write_page(session, rows: list, path: Path, final: bool = True) -> dict:
    """PAGE (markdown), PAGE.json and, when `final`, PAGE.png from the cells so far; returns the JSON record."""
    state = page_state(session, rows, path)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, page_markdown(state))
    record = page_json(state)
    write_json(path.with_suffix(".json"), record)
    if final:
        plot(state, path.with_suffix(".png"))
    return record


def plot(state: dict, path: Path) -> None:
    """Held-out perplexity over native per row and length, on a log axis with each value written out: the methods
    worth choosing are within a few percent of native, which a linear bar chart cannot tell apart."""
    table, lengths, L = state["table"], state["lengths"], state["plan"].L
    rows = [r for r in state["rows"] if any(r.label in table[n]["perplexity"] for n in lengths)]
    if not rows:
        return
    fig = new_figure(figsize=(9, 0.3 * len(rows) + 1.6))
    axes = fig.subplots(1, len(lengths), squeeze=False, sharey=True)
    for ax, length in zip(axes[0], lengths):
        native = table[length]["native"]
        ax.set_title(
            f"{length // 1024}k (s = {length / L:g})" + (f", native {native:.2f}" if native else ""), fontsize=9
        )
        ax.set_xscale("log")
        ax.axvline(1.0, color="k", lw=1, ls="--")
        ax.set_xlabel("held-out perplexity / native (log; lower is better)", fontsize=8)
        ratios = {label: value / native for label, value in table[length]["perplexity"].items()} if native else {}
        for y, row in enumerate(rows):
            if row.label not in ratios:
                continue
            ratio, value = ratios[row.label], table[length]["perplexity"][row.label]
            color = row_color(row)
            ax.hlines(y, 1.0, ratio, color=color, lw=2)
            ax.plot([ratio], [y], "o", color=color, ms=4)
            ax.annotate(f" {ratio:.3f} ({value:.1f})", (ratio, y), fontsize=6.5, va="center")
        right = max([2.0, *ratios.values()]) * 1.6
        ax.set_xlim(0.9, right)
        ticks = [t for t in ((1, 1.1, 1.25, 1.5, 2, 3) if right < 4 else (1, 1.5, 2, 3, 5, 10, 20, 50)) if t < right]
        ax.set_xticks(ticks, [f"{t:g}" for t in ticks], fontsize=7)
        ax.minorticks_off()
    axes[0][0].set_yticks(range(len(rows)), [r.label for r in rows], fontsize=7)
    axes[0][0].set_ylim(len(rows) - 0.5, -0.5)
    fig.tight_layout()
    save_figure(fig, path)
