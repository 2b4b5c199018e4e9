"""The report of a compare: results.json (every row's numbers, from `ctxext.compare.numbers`, the ranking and the
recommendation per serving target) and its renderings, report.md, results.csv and comparison.png. The --page layout
of the same numbers is `ctxext.compare.page`."""

from __future__ import annotations

import csv
import io
import math
import re
import time
from pathlib import Path

import yaml

from ..outputs import atomic_write_text, new_figure, save_figure, write_json
from .numbers import (
    baseline_accuracy,
    by_depth,
    cost_numbers,
    describe_params,
    document_ratios,
    effective_length_of,
    effective_lengths,
    effective_rule,
    passkey_result,
    passkey_text,
    pruning_rule_for,
    row_numbers,
    serving_table,
    spread_text,
    table_numbers,
    task_column,
    task_scores_of,
)
from .ranking import (
    RANKING_RULE,
    TIERS,
    decision_note,
    mean_ratio,
    needle_tier,
    note_line,
    rank_rows,
    recommend,
    tie_note,
    tied_rows,
    wilson_interval,
)
from .serving import TARGET_NAMES, TARGETS, serve_commands

RESULTS_FILE = "results.json"
REPORT_FILE = "report.md"
CSV_FILE = "results.csv"
PLOT_FILE = "comparison.png"
METHODS_DIR = "methods"


def tasks_record(session) -> dict | None:
    """What --tasks ran (None without it): the tasks, the columns the rows carry, the samples and the protocol."""
    request = session.request
    if not request.tasks:
        return None
    columns = list(
        dict.fromkeys(task_column(s["task"], s["metric"]) for scores in session.measured.tasks.values() for s in scores)
    )
    return {
        "tasks": list(request.tasks),
        "columns": columns,
        "limit": request.task_limit,
        "protocol": "each row's configuration at each length through `ctxext tasks`' cells (lm_eval.simple_evaluate "
        "on HFLM over the patched model, the task's length in its metadata, the model's tokenizer; lm-eval's own "
        "values, RULER: the fraction of answers found); reported, not ranked",
    }


def slug(label: str) -> str:
    return re.sub(r"[^a-z0-9_]+", "-", label.lower()).strip("-")


# ---------------------------------------------------------------------------------------------- writing
def write_report(session, rows, written: Path | None = None, final: bool = True) -> dict:
    """Write report.md, results.json, results.csv (and, when `final`, the plot) from the cells so far."""
    plan = session.plan
    out = Path(session.request.output)
    results = report_results(session, rows, written)
    by_label = {r.label: r for r in rows}
    for pick in results["recommendations"].values():
        if pick is not None:
            write_method_file(Path(pick["method_file"]), by_label[pick["label"]].configs[max(plan.lengths)])
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / RESULTS_FILE, results, allow_nan=True)
    atomic_write_text(out / CSV_FILE, results_csv(results))
    atomic_write_text(out / REPORT_FILE, markdown(results, plan))
    if final:
        plot(results, out / PLOT_FILE)
    return results


def recommendation_record(session, target: str, row, pick, serving: dict, baseline, tied: list) -> dict:
    """results.json's record of the row chosen for one serving target: its numbers, method file and commands."""
    lengths = session.plan.lengths
    longest = max(lengths)
    method_file = Path(session.request.output or ".") / METHODS_DIR / f"{slug(pick.label)}-{longest}.yaml"
    written_name = f"{Path(session.request.model.rstrip('/')).name}-{pick.label.split()[0]}-{_k(longest)}"
    return {
        "label": pick.label,
        "config": row.configs[longest],
        "ratios": {str(n): pick.ratios[n] for n in lengths},
        "passkey": {str(n): list(result) for n, result in pick.passkey.items()},
        "tier": TIERS[needle_tier(pick.passkey, baseline)],
        "mean_ratio": mean_ratio(pick.ratios),
        "tied_with": [r.label for r in tied if r is not pick],
        "tie_note": tie_note(pick, tied),
        "decided": session.decisions.get(target),
        "decision_note": decision_note(session.decisions.get(target), pick, tied),
        "serving": serving[pick.label].get(target, {}),
        "method_file": str(method_file),
        "commands": serve_commands(target, session.request.model, str(method_file), longest, written_name),
    }


def report_results(session, rows, written: Path | None = None) -> dict:
    """results.json's record of the rows from the cells so far (pure: nothing written)."""
    plan, measured = session.plan, session.measured
    docs = [d.name for d in plan.held_out]
    lengths, longest = plan.lengths, max(plan.lengths)
    table = table_numbers(rows, measured, docs, lengths)
    serving = serving_table(plan, rows)
    costs = cost_numbers(rows, measured, docs, longest)
    numbers = row_numbers(rows, table, measured, lengths, serving, costs, plan.passkey_lengths)
    baseline = baseline_accuracy(measured, plan.L)
    ranked = rank_rows(numbers, baseline)
    chosen = recommend(numbers, baseline, TARGETS)
    by_label = {r.label: r for r in rows}
    recommendations = {
        target: None
        if pick is None
        else recommendation_record(
            session, target, by_label[pick.label], pick, serving, baseline, tied_rows(numbers, baseline, target)
        )
        for target, pick in chosen.items()
    }
    effective = effective_lengths(measured, [r.label for r in rows], plan.passkey_lengths)
    results = {
        "protocol": protocol(session),
        "model": {
            "name": session.request.model,
            "display_name": session.request.display_name,
            "L": plan.L,
            "trained_context": plan.L,  # C, the length compare's rows extend from (L kept for older readers)
            "fingerprint": plan.fingerprint,
        },
        "machine": session.machine,
        "processes": session.processes.world_size,  # `accelerate launch` shares the cells among them
        "lengths": lengths,
        "documents": {"calibration": plan.data["calibration"], "held_out": docs},
        "methods": plan.methods,
        "excluded": plan.excluded,
        "failed": measured.failed,
        "native": {str(n): table[n]["native"] for n in lengths},
        "rows": [
            {
                **row_record(r, table, measured, serving, costs, lengths, plan.L, baseline),
                "effective_length": effective_length_of(effective, r.label),
                "tasks": task_scores_of(measured, r.label, lengths),
            }
            for r in rows
        ],
        "ranking": [r.label for r in ranked],
        "ranking_rule": RANKING_RULE,
        "recommendations": recommendations,
        "effective_length": effective,
        "effective_length_rule": effective_rule(effective, plan.L),
        "tasks": tasks_record(session),
        "searches": {str(n): v for n, v in session.halving.items()},
        "pruning_rule": pruning_rule(session),
        "budget": budget_record(session),
        "written": str(written) if written else None,
        "missing": list(dict.fromkeys(measured.missing)),
    }
    return results


def write_method_file(path: Path, config: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, "# Written by `ctxext compare`: the recommended row's method.\n" + yaml.safe_dump(config))


def row_record(row, table, measured, serving, costs, lengths, L, baseline) -> dict:
    passkey = {n: measured.passkey.get((row.label, n)) for n in [L, *lengths]}
    numbers = {
        "label": row.label,
        "method": row.method,
        "kind": row.kind,
        "note": row.note,
        "configs": {str(n): row.configs.get(n) for n in lengths},
        "search": {str(n): v for n, v in row.search.items()},
        "perplexity": {str(n): table[n]["perplexity"].get(row.label) for n in lengths},
        "ratio": {
            str(n): table[n]["perplexity"][row.label] / table[n]["native"]
            if row.label in table[n]["perplexity"] and table[n]["native"]
            else None
            for n in lengths
        },
        "rank": {str(n): table[n]["rank"].get(row.label) for n in lengths},
        "document_ratios": {str(n): document_ratios(measured, row.label, n) for n in lengths},
        "passkey": {
            str(n): {
                "correct": c["correct"],
                "trials": c["trials"],
                "interval": list(wilson_interval(c["correct"], c["trials"])),
                "by_depth": by_depth(c),
            }
            for n, c in passkey.items()
            if c is not None
        },
        "serving": serving.get(row.label, {}),
        "cost": costs.get(row.label),
        "failed": measured.failed.get(row.label),
    }
    results = {n: passkey_result(passkey[n]) for n in lengths}
    numbers["tier"] = TIERS[needle_tier(results, baseline)] if all(results.values()) else None
    return numbers


def protocol(session) -> dict:
    plan, request = session.plan, session.request
    return {
        "perplexity": "one window over the first N tokens of each held-out document (BOS + N - 1 text tokens where "
        "the tokenizer adds BOS), every token scored; exp(token-weighted mean NLL) over the documents",
        "native": f"the unpatched model in {plan.L}-token windows with stride {plan.L // 2} over the same tokens",
        "passkey": {
            "lengths": plan.passkey_lengths,
            "depths": request.passkey_depths,
            "keys_per_depth": request.passkey_trials,
            "seed": 0,
            "max_trials": request.max_passkey_trials,
            "added": "the rows tied with a recommendation get further blocks of the same size (block b seeded by "
            "100 + b), doubling a round, until the leader is separated, the cap or the budget (ctxext.compare.decide)",
            "note": f"at L = {plan.L} only the unpatched model (the baseline of the needle tiers)",
        },
        "split": {
            "calibration": plan.data["calibration"],
            "held_out": plan.data["held_out"],
            "rule": "calibration documents are scored only by the searches, held-out ones only by the table",
        },
        "data": {k: v for k, v in plan.data.items() if k not in ("calibration", "held_out")},
        "objective": request.objective,
        "full_searches": [
            {"objective": k.objective, "trials": k.trials, "methods": k.methods, "skip": k.skip}
            for k in request.full_searches or []
        ],
        "needle_objective_seed": 1,
        "dtype": plan.dtype_label,
        "device": str(plan.runtime["device"]),
        "attn_implementation": plan.runtime["attn_implementation"],
        "bos_token_id": plan.bos_id,
        "cells": str(request.cache_dir / "cells"),
        "searches": str(request.cache_dir / "searches"),
    }


def pruning_rule(session) -> str:
    return pruning_rule_for(session.request)


def budget_record(session) -> dict:
    spent = session.spent_seconds()
    return {
        "budget_seconds": session.request.budget,
        "spent_seconds": spent,
        "screen_estimate_seconds": session.plan.estimate.get("screen_seconds"),
        "estimate_how": session.plan.estimate.get("how"),
        "this_run_seconds": time.perf_counter() - session.started,
    }


# -------------------------------------------------------------------------------------------- formats
def results_csv(results: dict) -> str:
    """One line per row and length; the effective length (the row's, on each of its lines) and the --tasks scores
    (a column each) after the cost."""
    columns = (results["tasks"] or {}).get("columns", [])
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(
        [
            "label",
            "method",
            "kind",
            "length",
            "perplexity",
            "ratio_to_native",
            "rank",
            "passkey_correct",
            "passkey_trials",
            "tier",
            "vllm",
            "sglang",
            "llama.cpp",
            "prefill_ratio",
            "memory_ratio",
            "effective_length",
            *columns,
        ]
    )
    for row in results["rows"]:
        for n in results["lengths"]:
            passkey = row["passkey"].get(str(n)) or {}
            cost = row["cost"] or {}
            scores = row["tasks"].get(str(n), {})
            writer.writerow([
                row["label"], row["method"], row["kind"], n, row["perplexity"][str(n)], row["ratio"][str(n)],
                row["rank"][str(n)], passkey.get("correct"), passkey.get("trials"), row["tier"],
                *[row["serving"].get(e, {}).get("level") for e in ("vllm", "sglang", "llama.cpp")],
                cost.get("prefill_ratio"), cost.get("memory_ratio"), row["effective_length"],
                *[scores.get(c) for c in columns],
            ])  # fmt: skip
    return buffer.getvalue()


def _k(n: int) -> str:
    return f"{n // 1024}k" if n % 1024 == 0 else str(n)


def _ratio(value) -> str:
    return "..." if value is None else f"{value:.3f}"


def markdown(results: dict, plan) -> str:
    """report.md: the recommendation per serving target first, then the table, the protocol and what is missing."""
    lengths = results["lengths"]
    model = results["model"]
    lines = [f"# ctxext compare: {model['display_name']} (L = {model['L']}) at {', '.join(_k(n) for n in lengths)}"]
    lines += recommendation_lines(results)
    if results["written"]:
        lines += [f"`--write-best` wrote the checkpoint to `{results['written']}`.", ""]
    lines += [f"Ranking: {results['ranking_rule']}", ""]
    lines += table_lines(results)
    lines += protocol_lines(results)
    if results["excluded"]:
        lines += ["", "Methods not compared:", ""]
        lines += [f"- {m}: {why}" for m, why in results["excluded"].items()]
    if results["failed"]:
        lines += ["", "Rows that failed here:", ""] + [f"- {m}: {why}" for m, why in results["failed"].items()]
    lines += search_lines(results)
    lines += time_and_missing_lines(results)
    return "\n".join(lines) + "\n"


def recommendation_lines(results: dict) -> list[str]:
    """The table of the row each serving target is recommended, then the commands that serve it."""
    lengths = results["lengths"]
    lines = [
        "",
        "## Recommendation",
        "",
        "| serve with | row | " + " | ".join(f"{_k(n)} vs native" for n in lengths) + " | passkey | needle |",
        "|---|---|" + "---:|" * len(lengths) + "---|---|",
    ]
    for target in TARGETS:
        pick = results["recommendations"].get(target)
        if pick is None:
            lines.append(
                f"| {TARGET_NAMES[target]} | none served exactly with every number | "
                + " - |" * len(lengths)
                + " - | - |"
            )
            continue
        passkey = ", ".join(passkey_text(c, t) for c, t in pick["passkey"].values())
        lines.append(
            f"| {TARGET_NAMES[target]} | {pick['label']} | "
            + " | ".join(_ratio(pick["ratios"][str(n)]) for n in lengths)
            + f" | {passkey} | {pick['tier']} |"
        )
    lines += [""]
    picks = [p for p in results["recommendations"].values() if p]
    notes = sorted({note_line(p.get("tie_note") or "", p.get("decision_note") or "") for p in picks} - {None})
    lines += sorted(notes) + ([""] if notes else [])
    for target in TARGETS:
        pick = results["recommendations"].get(target)
        if pick is None:
            continue
        lines += [f"**{TARGET_NAMES[target]}**: {pick['label']} ({pick['serving'].get('how', '')}):", "", "```bash"]
        lines += pick["commands"] + ["```", ""]
    return lines


def protocol_lines(results: dict) -> list[str]:
    """How every number of the report was made: data, perplexity, native, passkey, searches, cost, runtime."""
    p, lengths = results["protocol"], results["lengths"]
    return [
        "",
        "## Protocol",
        "",
        f"- **Data**: calibration (searches only): {', '.join(p['split']['calibration']) or 'none'}; held out (the "
        f"table only): {', '.join(p['split']['held_out'])}. The two are never mixed.",
        f"- **Perplexity**: {p['perplexity']}.",
        f"- **Native**: {p['native']}.",
        f"- **Passkey**: {p['passkey']['keys_per_depth']} key(s) per depth at depths "
        f"{', '.join(f'{d:g}' for d in p['passkey']['depths'])}, seeded by 0, at "
        f"{', '.join(str(n) for n in p['passkey']['lengths'])} tokens ({p['passkey']['note']}); up to "
        f"{p['passkey']['max_trials']} trials a length for the rows tied with a recommendation: "
        f"{p['passkey']['added']}.",
        f"- **Searches**: `ctxext search` studies, objective `{p['objective']}` (needle keys seeded by 1, not the "
        f"table's). {results['pruning_rule']}",
        f"- **Cost**: prefill time and peak memory of each row's cell on the first held-out document at "
        f"{_k(max(lengths))}, relative to the unpatched model's (the `none` row) on the same machine.",
        f"- **Runtime**: {p['dtype']} on {p['device']}, {p['attn_implementation']}; machine: {results['machine']}"
        + (f" ({results['processes']} processes sharing the cells)." if results.get("processes", 1) > 1 else "."),
        f"- **Cells**: {p['cells']}; searches: {p['searches']} (the same command resumes; nothing is recomputed).",
    ]


def time_and_missing_lines(results: dict) -> list[str]:
    """The computation spent against the budget, and the cells still missing (or that none is)."""
    b = results["budget"]
    budget = "none" if b["budget_seconds"] is None else f"{b['budget_seconds'] / 60:.1f} min"
    lines = [
        "",
        f"**Time**: {b['spent_seconds'] / 60:.1f} min of computation recorded in the cells and trials "
        f"(budget: {budget}); this run {b['this_run_seconds'] / 60:.1f} min.",
        "",
    ]
    missing = results["missing"]
    if missing:
        lines += [f"**Partial report: {len(missing)} cells are missing** (run the same command again):", ""]
        lines += [f"- {m}" for m in missing[:40]] + (
            [f"- ... and {len(missing) - 40} more"] if len(missing) > 40 else []
        )
    else:
        lines.append("Every cell is computed.")
    return lines


def table_lines(results: dict) -> list[str]:
    lengths = results["lengths"]
    header = "| method | parameters |" + "".join(f" {_k(n)} ppl | rank | vs native |" for n in lengths)
    columns = (results["tasks"] or {}).get("columns", [])
    tasks = [(c, n) for c in columns for n in lengths]
    header += "".join(f" passkey {_k(n)} |" for n in lengths) + " effective length |"
    header += "".join(f" {c} {_k(n)} |" for c, n in tasks)
    header += " needle | vLLM | SGLang | llama.cpp | prefill | memory |"
    rule = "|---|---|" + "---:|---:|---:|" * len(lengths) + "---:|" * (len(lengths) + 1 + len(tasks))
    rule += "---|---|---|---|---:|---:|"
    lines = ["## Table", "", header, rule]
    native = "| **native** (unpatched, L-token windows) | - |"
    for n in lengths:
        value = results["native"][str(n)]
        native += f" {value:.2f} | - | 1.00 |" if value else " ... | - | - |"
    lines.append(native + " - |" * (len(lengths) + 1 + len(tasks)) + " - |" * 6)
    shortest_passkey = min((n for n in results["protocol"]["passkey"]["lengths"] if n in lengths), default=None)
    for row in results["rows"]:
        params = row["note"] or ("searched (below)" if row["kind"] == "searched" else "defaults")
        line = f"| {row['label']} | {params} |"
        for n in lengths:
            value, rank, ratio = row["perplexity"][str(n)], row["rank"][str(n)], row["ratio"][str(n)]
            if row["configs"][str(n)] is None:
                line += " n/a | | |" if row["kind"] == "defaults" else " ... | | |"
            else:
                spread = spread_text(row["document_ratios"][str(n)])
                line += f" {value:.2f} | {rank} | {_ratio(ratio)}{spread} |" if value else " ... | | |"
        for n in lengths:
            cell = row["passkey"].get(str(n))
            asked = n in results["protocol"]["passkey"]["lengths"]
            line += f" {passkey_text(cell['correct'], cell['trials'])} |" if cell else " ... |" if asked else " - |"
        line += f" {effective_cell(row['effective_length'], results['effective_length'], shortest_passkey)} |"
        for column, n in tasks:
            value = row["tasks"].get(str(n), {}).get(column)
            line += f" {value:.3f} |" if value is not None else " ... |" if row["configs"][str(n)] else " - |"
        serving = row["serving"]
        cost = row["cost"] or {}
        prefill = f"{cost['prefill_ratio']:.2f}x" if cost.get("prefill_ratio") else "-"
        memory = f"{cost['memory_ratio']:.2f}x" if cost.get("memory_ratio") else "-"
        line += f" {row['tier'] or '...'} |" + "".join(
            f" {serving.get(e, {}).get('level', '-')} |" for e in ("vllm", "sglang", "llama.cpp")
        )
        lines.append(line + f" {prefill} | {memory} |")
    lines += ["", results["effective_length_rule"]]
    if results["tasks"]:
        record = results["tasks"]
        samples = "all samples" if record["limit"] is None else f"the first {record['limit']} samples"
        lines += ["", f"Tasks (--tasks {','.join(record['tasks'])}, {samples} per cell): {record['protocol']}."]
    lines += ["", "Searched parameters (at each length):", ""]
    for row in results["rows"]:
        for n, info in row["search"].items():
            if "pruned" in info:
                lines.append(f"- {row['label']} at {_k(int(n))}: {info['pruned']}")
            else:
                lines.append(
                    f"- {row['label']} at {_k(int(n))}: {describe_params(row['configs'][n])} (best of {info['trials']} "
                    f"trials, trial {info['best']}; {info['objective']} {info['calibration_defaults']:.3f} -> "
                    f"{info['calibration_best']:.3f})"
                )
    return lines


def effective_cell(found, effective: dict | None, shortest_passkey: int | None) -> str:
    """The effective-length column of a row: its length, '...' while pending, '<' the shortest patched passkey
    length where none passes, '-' where it is not measured (no baseline)."""
    if found == "pending":
        return "..."
    if found is not None:
        return _k(found)
    if effective is None or effective["threshold"] is None or shortest_passkey is None:
        return "-"
    return f"< {_k(shortest_passkey)}"


def search_lines(results: dict) -> list[str]:
    if not results["searches"]:
        return []
    lines = ["", "## Screen and successive halving", ""]
    for n, record in results["searches"].items():
        screen = ", ".join(f"{m} {v:.3f}" for m, v in sorted(record["screen"].items(), key=lambda kv: kv[1]))
        lines.append(f"- {_k(int(n))}: screen {screen or 'none'}")
        for i, rung in enumerate(record["rungs"], 1):
            values = ", ".join(f"{m} {rung['values'][m]:.3f}" for m in rung["methods"])
            lines.append(f"  - rung {i} ({rung['trials']} trials): {values}")
        if record["stopped"]:
            lines.append(f"  - stopped: {record['stopped']}")
    return lines


def plot(results: dict, path: Path) -> None:
    """Left: held-out perplexity / native per length for every row with numbers; right: passkey accuracy by depth
    and length per row."""
    rows = [r for r in results["rows"] if any(v is not None for v in r["ratio"].values())]
    if not rows:
        return
    lengths = results["lengths"]
    fig = new_figure(figsize=(12, 0.25 * len(rows) + 3))
    left, right = fig.subplots(1, 2, gridspec_kw={"width_ratios": [1, 1.2]})
    for i, row in enumerate(rows):
        points = [(n, row["ratio"][str(n)]) for n in lengths if row["ratio"][str(n)] is not None]
        style = "-" if row["kind"] == "defaults" else "--"
        left.plot(
            [p[0] for p in points],
            [p[1] for p in points],
            style,
            marker="o",
            ms=3,
            label=row["label"],
            color=f"C{i % 10}",
        )
    left.axhline(1.0, color="k", lw=1, ls=":")
    left.set_xscale("log", base=2)
    left.set_yscale("log")
    left.set_xticks(lengths, [_k(n) for n in lengths])
    left.set_xlabel("length")
    left.set_ylabel("held-out perplexity / native (log)")
    left.legend(fontsize=6, ncol=2)
    columns = [(n, d) for n in lengths for d in results["protocol"]["passkey"]["depths"]]
    grid = [[row["passkey"].get(str(n), {}).get("by_depth", {}).get(d, math.nan) for n, d in columns] for row in rows]
    grid = [[math.nan if v is None else v for v in line] for line in grid]
    image = right.imshow(grid, vmin=0, vmax=1, cmap="viridis", aspect="auto")
    right.set_xticks(range(len(columns)), [f"{_k(n)}\n{d:g}" for n, d in columns], fontsize=7)
    right.set_yticks(range(len(rows)), [r["label"] for r in rows], fontsize=7)
    right.set_title("passkey accuracy by length and depth", fontsize=9)
    fig.colorbar(image, ax=right, fraction=0.04)
    fig.tight_layout()
    save_figure(fig, path)
