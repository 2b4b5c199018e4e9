"""The method comparison report: every ctxext method on SmolLM2, at its defaults and at searched parameters.

Writes docs/comparison.md (the page a user reads to choose a method), docs/comparison.png and
docs/comparison.json. SmolLM2-135M (L = 8192) at 16k (s = 2) and 32k (s = 4):

- **Perplexity** on held-out plays (Othello, King Lear, Coriolanus by default): one window over each document's
  first N tokens, every token scored (`sliding_window_nll` with window = stride = N).
- **Native**, the reference of the project's goal: the unpatched model over the same tokens in 8192-token windows
  with stride 4096.
- **Passkey** accuracy at 16k (`ctxext.eval.passkey`, seeded keys at a few depths).
- **Searched parameters**: `ctxext search` at the same length on calibration text the report never scores
  (Hamlet followed by Richard III), resumable, `--search-trials` trials per method; the best trial so far is used.
  The methods of `--needle-methods` are searched again with the objective needle-ppl (`--needle-trials` trials):
  the answer tokens of seeded passkey prompts at the target length, to show what each objective costs.

Every (method, document, length) cell is written as soon as it is computed to docs/comparison_cells/ (--cells),
one small JSON file keyed by the model, dtype, method settings, tokens and protocol, and each search's trials.jsonl
sits beside them. That folder is committed: the report builds up over several runs, on several machines and in
fresh checkouts, and never recomputes a cell. The report is rewritten after every cell; a partial one lists the
cells still missing, and every cell names the machine that computed it. At 32k on a 2-core CPU this is hours:
run it again (or with --max-minutes) until nothing is missing, and commit the new cells.
--methods and --lengths narrow what is computed, not the page: the report always shows every method at every
default length (and any other length asked for) from the cached cells.

    nice -n 10 env OMP_NUM_THREADS=1 .venv/bin/python scripts/compare_methods.py \\
        --lengths 16384 --search-trials 12 --max-minutes 120
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

CALIBRATION = "hamlet_gut+richard_iii_gut"
HELD_OUT = ("othello_gut", "lear_gut", "coriolanus_gut")
DEFAULT_LENGTHS = (16384, 32768)  # the page's columns: 2x and 4x L
NATIVE = "native"
BASELINE = "none"
PASSKEY_DEPTHS = (0.1, 0.5, 0.9)
# The objective of each kind of searched row. 'needle' rows search on the answer tokens of passkey prompts
# (keys seeded by NEEDLE_SEED, so the report's passkey column, seed 0, asks other keys than the search saw).
OBJECTIVES = {"searched": "ppl", "needle": "needle-ppl"}
NEEDLE_SEED = 1
NEEDLE_METHODS = ("dpe", "rerope", "leaky_rerope", "dual_chunk")
PPL_SEARCH_SKIP = ("dpe",)  # searched with needle-ppl only: eight scales, and a perplexity search costs retrieval


@dataclass
class Variant:
    """A row of the report: a method at its defaults or at searched parameters."""

    method: str
    kind: str  # "defaults" | "searched" (objective ppl) | "needle" (objective needle-ppl)
    config: dict | None  # the method config (None: not available yet, see note)
    note: str = ""

    @property
    def label(self) -> str:
        return {"defaults": self.method, "searched": f"{self.method} (searched)"}.get(
            self.kind, f"{self.method} (searched, needle-ppl)"
        )


def methods_to_compare() -> list[str]:
    from ctxext.methods import METHODS

    return list(METHODS)


def searchable(method: str) -> bool:
    from ctxext.compare.plan import is_searchable

    return is_searchable(method)


def default_variant(method: str, factor: float) -> Variant:
    if method == "theta":
        return Variant(method, "defaults", None, "no default: 'new_base' is required (see the searched row)")
    if method == "none":
        return Variant(method, "defaults", {"method": "none"})
    return Variant(method, "defaults", {"method": method, "factor": factor})


# -------------------------------------------------------------------------------------------- the searches
def model_file(search_folder: Path) -> Path:
    from ctxext.compare.searches import model_file as beside

    return beside(search_folder)


def adopt_search(folder: Path, checkpoint: Path, fingerprint: str) -> None:
    """`ctxext.compare.searches.adopt_search`: a kept search resumes where the model sits at another path."""
    from ctxext.compare.searches import adopt_search as adopt
    from ctxext.errors import CtxextError

    try:
        adopt(folder, checkpoint, fingerprint)
    except CtxextError as error:
        raise SystemExit(str(error)) from None


# ------------------------------------------------------------------------------------------- the report
def overall(cells: list[dict | None]) -> float | None:
    if not cells or any(c is None for c in cells):
        return None
    return math.exp(math.fsum(c["nll_sum"] for c in cells) / sum(c["tokens"] for c in cells))


def describe_params(config: dict | None, factor: float) -> str:
    from ctxext.compare.report import describe_params as describe

    return describe(config)


def machines(state: dict) -> str:
    """Which machines computed the cells, with how many each ("not recorded" for cells older than the record)."""
    from collections import Counter

    counts = Counter(c.get("machine", "not recorded") for c in [*state["cells"].values(), *state["passkey"].values()])
    return "; ".join(f"{name} ({n} cells)" for name, n in counts.most_common()) or "none yet"


def effective_passkey_lengths(passkey: dict, labels: list[str], lengths: list[int]) -> dict | None:
    """Per row, the effective length by the rule of `ctxext tasks` on passkey accuracy (None without a baseline
    length: the unpatched model at a passkey length within its window). 'pending': rows with cells missing."""
    from ctxext.tasks.report import effective_lengths

    shortest = min(lengths)
    if len(lengths) < 2 or (BASELINE, shortest) not in passkey:
        return None
    rows = [
        {"task": "passkey", "metric": "acc", "method": label, "length": n, "value": cell["correct"] / cell["trials"]}
        for (label, n), cell in passkey.items()
    ]
    (panel,) = effective_lengths(rows, labels)
    pending = [label for label in labels if label != BASELINE and any((label, n) not in passkey for n in lengths[1:])]
    return {**panel, "pending": pending}


def build_report(state: dict, out_dir: Path) -> None:
    """docs/comparison.md, .json and .png from the cells computed so far."""
    from ctxext.outputs import atomic_write_text, write_json

    lengths, docs, rows = state["lengths"], state["documents"], state["rows"]
    out_dir.mkdir(parents=True, exist_ok=True)
    table = {}
    for length in lengths:
        native = overall([state["cells"].get((NATIVE, doc, length)) for doc in docs])
        scored = {}
        for row in rows:
            label = row["label"]
            if row["configs"].get(length) is None:
                continue
            value = overall([state["cells"].get((label, doc, length)) for doc in docs])
            if value is not None:
                scored[label] = value
        ranked = sorted(scored, key=scored.get)
        table[length] = {"native": native, "perplexity": scored, "rank": {k: i + 1 for i, k in enumerate(ranked)}}

    missing = state["missing"]
    searched_methods = {row["method"] for row in rows if row["kind"] != "defaults"}
    unsearched = [m for m in dict.fromkeys(row["method"] for row in rows) if m not in searched_methods | {"none"}]
    lines = [
        "# Choosing a method: every ctxext method on SmolLM2-135M, at its defaults and searched",
        "",
        "Written by `scripts/compare_methods.py` (cells cached; run it again to fill what is missing). "
        f"Model: SmolLM2-135M-Instruct (L = 8192), {state['dtype']}, SDPA. Cells computed on: {machines(state)}"
        + (
            " (bf16 kernels differ between CPUs: BENCHMARKS.md, 'Comparison report', says by how much)."
            if ";" in machines(state)
            else "."
        ),
        "",
        f"- **Perplexity**: one window over the first N tokens of each held-out play ({', '.join(docs)}), every token "
        "scored; the column is exp(token-weighted mean NLL) over the plays. Lower is better; rank 1 is the best "
        "method at that length.",
        "- **vs native**: the ratio to the unpatched model in 8192-token windows with stride 4096 over the same "
        "tokens (the model's own quality on that text, the project's reference).",
        f"- **Passkey**: accuracy at {', '.join(str(n) for n in state['passkey_lengths'])} tokens, "
        f"{len(PASSKEY_DEPTHS)} seeded keys at depths "
        f"{', '.join(f'{d:g}' for d in PASSKEY_DEPTHS)} (the Landmark/YaRN format).",
        f"- **Searched**: the best of `ctxext search` ({state['search_trials']} trials per method and length; "
        f"TPE, LongRoPE by CMA-ES from YaRN's factors) on calibration text the table never scores "
        f"({CALIBRATION.replace('+', ' + ')}, first N tokens). 'search vs defaults' is the held-out change. "
        f"**Searched, needle-ppl**: the same, {state['needle_trials']} trials, with the objective `needle-ppl`: the "
        f"mean NLL of the answer tokens of {len(PASSKEY_DEPTHS)} passkey prompts at N (the passkey column's depths, "
        f"keys seeded by {NEEDLE_SEED}, not its keys), meant to keep the retrieval a perplexity search can lose. "
        f"{', '.join(PPL_SEARCH_SKIP)}: searched with needle-ppl only."
        + (
            f" {', '.join(unsearched)}: no parameter to search but the factor, so no searched row."
            if unsearched and state["search_trials"]
            else ""
        ),
        "",
    ]
    header = "| method | parameters |"
    rule = "|---|---|"
    for length in lengths:
        header += f" {length // 1024}k ppl | rank | vs native |"
        rule += "---:|---:|---:|"
    passkey_lengths = state["passkey_lengths"]
    effective = effective_passkey_lengths(state["passkey"], [row["label"] for row in rows], passkey_lengths)
    header += "".join(f" passkey {n // 1024}k |" for n in passkey_lengths)
    header += " effective length |" if effective else ""
    header += " search vs defaults |"
    rule += "---:|" * len(passkey_lengths) + ("---:|" if effective else "") + "---|"
    lines += [header, rule]
    native_line = "| **native** (unpatched, 8k windows) | - |"
    for length in lengths:
        value = table[length]["native"]
        native_line += f" {value:.2f} | - | 1.00 |" if value else " ... | - | - |"
    lines.append(native_line + " - |" * len(passkey_lengths) + (" - |" if effective else "") + " - |")
    by_label = {row["label"]: row for row in rows}
    for row in rows:
        line = f"| {row['label']} | {'searched (below)' if row['kind'] != 'defaults' else row['note'] or 'defaults'} |"
        changes = []
        for length in lengths:
            value = table[length]["perplexity"].get(row["label"])
            native = table[length]["native"]
            if row["configs"].get(length) is None:
                line += " ... | | |" if row["kind"] != "defaults" else " n/a | | |"
                continue
            rank = table[length]["rank"].get(row["label"])
            line += (
                f" {value:.2f} | {rank} | {value / native:.3f} |"
                if value and native
                else f" {value:.2f} | {rank} | ... |"
                if value
                else " ... | | |"
            )
            if row["kind"] != "defaults" and value:
                default = table[length]["perplexity"].get(row["method"])
                if default:
                    changes.append(f"{length // 1024}k {100 * (value - default) / default:+.1f}%")
        for n in passkey_lengths:
            passkey = state["passkey"].get((row["label"], n))
            within = n <= state["original_length"] and row["label"] != BASELINE  # only the baseline runs there
            line += f" {passkey['correct']}/{passkey['trials']} |" if passkey else " - |" if within else " ... |"
        if effective:
            length = effective["effective_length"].get(row["label"])
            shortest_patched = min(n for n in passkey_lengths if n > state["original_length"])
            below = f" < {shortest_patched // 1024}k |"  # no length tested passes
            line += f" {length // 1024}k |" if length else " ... |" if row["label"] in effective["pending"] else below
        line += f" {', '.join(changes) or '-'} |"
        lines.append(line)
    if effective:
        from ctxext.tasks.report import EFFECTIVE_RULE

        lines += [
            "",
            f"{EFFECTIVE_RULE[0].upper()}{EFFECTIVE_RULE[1:]}, here passkey accuracy "
            f"(threshold {effective['threshold']:.2f}, {BASELINE} at {effective['baseline_length']}).",
        ]
    lines += ["", "Searched parameters per length:", ""]
    for row in rows:
        if row["kind"] == "defaults":
            continue
        for length in lengths:
            info = row["search"].get(length)
            if info:
                objective = "needle NLL" if row["kind"] == "needle" else "calibration"
                lines.append(
                    f"- {row['label']} at {length // 1024}k: {describe_params(row['configs'].get(length), 0)}"
                    f" (best of {info['trials']} trials, trial {info['best']}; {objective} "
                    f"{info['calibration_defaults']:.2f} -> {info['calibration_best']:.2f})"
                )
    lines += ["", "Per document (perplexity):", ""]
    for length in lengths:
        lines += [f"**{length // 1024}k**", "", f"| method | {' | '.join(docs)} |"]
        lines.append("|---|" + "---:|" * len(docs))
        for label in [NATIVE] + [r["label"] for r in rows]:
            cells = [state["cells"].get((label, doc, length)) for doc in docs]
            if any(cells):
                lines.append(
                    f"| {label} | "
                    + " | ".join(f"{math.exp(c['nll_sum'] / c['tokens']):.2f}" if c else "..." for c in cells)
                    + " |"
                )
        lines.append("")
    seconds = (
        sum(c.get("seconds", 0.0) for c in state["cells"].values())
        + sum(p.get("seconds", 0.0) for p in state["passkey"].values())
        + state["search_seconds"]
    )
    lines += [
        f"**Run time**: {seconds / 3600:.1f} h of computation in the cells and searches so far "
        f"(cells {len(state['cells'])}, passkey cells {len(state['passkey'])}, search trials "
        f"{state['search_trial_count']}); this run {state['run_seconds'] / 60:.0f} min on {state['machine']}. "
        "Cell times depend on the machine, its threads and its load (BENCHMARKS.md, 'Comparison report').",
        "",
    ]
    if missing:
        lines += [f"**Partial report: {len(missing)} cells are missing** (run the script again to compute them):", ""]
        lines += [f"- {m}" for m in missing[:60]] + (
            [f"- ... and {len(missing) - 60} more"] if len(missing) > 60 else []
        )
    else:
        lines.append("Every cell is computed.")
    atomic_write_text(out_dir / "comparison.md", "\n".join(lines) + "\n")
    write_json(
        out_dir / "comparison.json",
        {
            "lengths": lengths,
            "documents": docs,
            "table": {str(k): v for k, v in table.items()},
            "rows": [
                {k: v for k, v in row.items() if k != "configs"}
                | {"configs": {str(k): v for k, v in row["configs"].items()}}
                for row in rows
            ],
            "passkey": [{"label": k[0], "length": k[1], **v} for k, v in state["passkey"].items()],
            "effective_length": effective,
            "missing": missing,
            "machine": state["machine"],
            "dtype": state["dtype"],
            "cells": [
                {
                    "label": k[0],
                    "document": k[1],
                    "length": k[2],
                    "machine": v.get("machine"),
                    **{f: v[f] for f in ("nll_sum", "tokens", "seconds")},
                }
                for k, v in state["cells"].items()
            ],
        },
    )
    plot(table, rows, lengths, out_dir / "comparison.png", by_label)


def plot(table: dict, rows: list[dict], lengths: list[int], path: Path, by_label: dict) -> None:
    """Held-out perplexity over native per method and length, on a log axis with each value written out: the
    methods worth choosing are within a few percent of native, which a linear bar chart cannot tell apart."""
    from ctxext.outputs import new_figure, save_figure

    labels = [r["label"] for r in rows if any(r["label"] in table[n]["perplexity"] for n in lengths)]
    if not labels:
        return
    fig = new_figure(figsize=(9, 0.3 * len(labels) + 1.6))
    axes = fig.subplots(1, len(lengths), squeeze=False, sharey=True)
    for ax, length in zip(axes[0], lengths):
        native = table[length]["native"]
        ax.set_title(
            f"{length // 1024}k (s = {length / 8192:g})" + (f", native {native:.2f}" if native else ""), fontsize=9
        )
        ax.set_xscale("log")
        ax.axvline(1.0, color="k", lw=1, ls="--")
        ax.set_xlabel("held-out perplexity / native (log; lower is better)", fontsize=8)
        ratios = {label: value / native for label, value in table[length]["perplexity"].items()} if native else {}
        for y, label in enumerate(labels):
            if label not in ratios:
                continue
            ratio, value = ratios[label], table[length]["perplexity"][label]
            color = {"defaults": "C0", "searched": "C1"}.get(by_label[label]["kind"], "C2")
            ax.hlines(y, 1.0, ratio, color=color, lw=2)
            ax.plot([ratio], [y], "o", color=color, ms=4)
            ax.annotate(f" {ratio:.3f} ({value:.1f})", (ratio, y), fontsize=6.5, va="center")
        right = max([2.0, *ratios.values()]) * 1.6
        ax.set_xlim(0.9, right)
        ticks = [t for t in ((1, 1.1, 1.25, 1.5, 2, 3) if right < 4 else (1, 1.5, 2, 3, 5, 10, 20, 50)) if t < right]
        ax.set_xticks(ticks, [f"{t:g}" for t in ticks], fontsize=7)
        ax.minorticks_off()
    axes[0][0].set_yticks(range(len(labels)), labels, fontsize=7)
    axes[0][0].set_ylim(len(labels) - 0.5, -0.5)
    fig.tight_layout()
    save_figure(fig, path)


# ---------------------------------------------------------------------------------------------- running
def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--lengths",
        default=",".join(str(n) for n in DEFAULT_LENGTHS),
        help="comma-separated N to compute (default %(default)s); the report also shows every default length",
    )
    parser.add_argument(
        "--methods",
        default=None,
        help="comma-separated methods to compute (default: every method); the report still shows every method, "
        "from the cached cells, so a narrowed run never drops rows from the page",
    )
    parser.add_argument("--held-out", default=",".join(HELD_OUT), help="Shakespeare texts scored (default %(default)s)")
    parser.add_argument(
        "--passkey-lengths",
        default="8192,16384",
        help="comma-separated passkey lengths (default %(default)s); a length within L (8192) runs only the unpatched "
        "model, the baseline of the effective length",
    )
    parser.add_argument("--search-trials", type=int, default=12, help="trials per search (default 12; 0: no searches)")
    parser.add_argument(
        "--needle-methods",
        default=",".join(NEEDLE_METHODS),
        help="methods also searched with the needle-ppl objective (default %(default)s; empty: none)",
    )
    parser.add_argument("--needle-trials", type=int, default=8, help="trials per needle-ppl search (default 8)")
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    parser.add_argument(
        "--device",
        default="auto",
        help="where the cells and searches run: auto (cuda > mps > cpu), cpu, cuda, cuda:N (default %(default)s); "
        "a cell's key holds no device, so cells computed anywhere fill one page, each naming its machine",
    )
    parser.add_argument("--max-minutes", type=float, default=None, help="start no new cell after this many minutes")
    parser.add_argument("--report-only", action="store_true", help="write the report from the cached cells only")
    parser.add_argument("--output", default=str(REPO / "docs"), help="where comparison.md/.png/.json go")
    parser.add_argument(
        "--cells",
        default=str(REPO / "docs" / "comparison_cells"),
        help="where the computed cells and searches are kept (default %(default)s, committed)",
    )
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    import torch

    from ctxext import assets
    from ctxext.config import MethodConfig
    from ctxext.errors import CtxextError
    from ctxext.eval.data import tokenizer_adds_bos, tokens_fingerprint
    from ctxext.eval.passkey import plan_trials, run_passkey
    from ctxext.eval.perplexity import sliding_window_nll, text_tokens_per_window
    from ctxext.loading import load_model, load_tokenizer
    from ctxext.outputs import CellCache, content_fingerprint, write_json
    from ctxext.runtime import machine_description, resolve_device
    from ctxext.search.loop import best_trial
    from ctxext.search.objective import checked_method, score_perplexity
    from ctxext.search.space import collapse_elements
    from ctxext.search.store import read_trials

    try:
        device = resolve_device(args.device)
    except CtxextError as error:
        print(f"compare_methods: {error}", file=sys.stderr)
        return 2
    started = time.perf_counter()
    lengths = [int(x) for x in args.lengths.split(",")]
    docs = [d.strip() for d in args.held_out.split(",")]
    methods = args.methods.split(",") if args.methods else methods_to_compare()
    report_methods = list(dict.fromkeys([*methods_to_compare(), *methods]))
    report_lengths = sorted({*DEFAULT_LENGTHS, *lengths})
    root = Path(args.cells)
    checkpoint = assets.smollm2_checkpoint()
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    tokenizer = load_tokenizer(str(checkpoint))
    bos = tokenizer.bos_token_id if tokenizer_adds_bos(tokenizer) else None
    cache = CellCache(root / "cells", {"model": content_fingerprint(checkpoint), "dtype": args.dtype, "bos": bos})
    texts = {
        doc: torch.tensor(tokenizer(assets.shakespeare_text([doc]), add_special_tokens=False).input_ids) for doc in docs
    }
    L = 8192
    model = None
    machine = machine_description()

    def get_model():
        nonlocal model
        if model is None:
            model = load_model(str(checkpoint), dtype=dtype, device=device, attn_implementation="sdpa")
        return model

    def out_of_time() -> bool:
        return args.report_only or (
            args.max_minutes is not None and time.perf_counter() - started > 60 * args.max_minutes
        )

    needle_methods = [m for m in args.needle_methods.split(",") if m]

    def search_dir(method: str, length: int, kind: str) -> Path:
        return root / "searches" / (f"{method}-{length}" + ("-needle-ppl" if kind == "needle" else ""))

    def trials_wanted(kind: str) -> int:
        return args.needle_trials if kind == "needle" else args.search_trials

    def has_search(method: str, kind: str) -> bool:
        if kind == "needle":
            return method in needle_methods and args.needle_trials > 0
        return bool(args.search_trials) and searchable(method) and method not in ("none", *PPL_SEARCH_SKIP)

    def searched_variant(method: str, length: int, kind: str) -> tuple[Variant, dict | None]:
        folder = search_dir(method, length, kind)
        trials_file = folder / "trials.jsonl"
        if not trials_file.exists():
            return Variant(method, kind, None, "not started"), None
        history = read_trials(trials_file)
        best = best_trial(history)
        settings = json.loads((folder / "search.json").read_text())
        if len(history) < trials_wanted(kind):  # a partial search's best would be scored, then superseded
            return Variant(method, kind, None, f"{len(history)} of {trials_wanted(kind)} trials done"), None
        if best is None:
            return Variant(method, kind, None, "no valid trial"), None
        base = {
            "method": settings["method"],
            "factor": settings["factor"],
            "original_max_position_embeddings": settings["original_max_position_embeddings"],
            **settings["fixed"],
            **({"selected_pairs": settings["selected_pairs"]} if settings.get("selected_pairs") is not None else {}),
            # per-element parameters ('group_scales[0]', ...) back into the lists the method takes
            **collapse_elements(best["params"]),
        }
        info = {
            "trials": len(history),
            "best": best["number"],
            "calibration_defaults": history[0]["value"],
            "calibration_best": best["value"],
        }
        return Variant(method, kind, base), info

    def run_search(method: str, length: int, kind: str) -> None:
        from ctxext.cli import main as ctxext_main

        folder = search_dir(method, length, kind)
        argv = [
            "search",
            str(checkpoint),
            "--method",
            method,
            "--factor",
            str(length / L),
            "--length",
            str(length),
            "--dataset",
            f"shakespeare:{CALIBRATION}",
            "--held-out",
            "0",
            "--trials",
            str(trials_wanted(kind)),
            "--objective",
            OBJECTIVES[kind],
            "--no-checkpoint",
            "--no-progress",
            "--dtype",
            args.dtype,
            "--device",
            str(device),
            "-o",
            str(folder),
        ]
        if (folder / "search.json").exists():
            adopt_search(folder, checkpoint, cache.context["model"])
            argv.append("--resume")
        elif not model_file(folder).exists():
            folder.parent.mkdir(parents=True, exist_ok=True)
            write_json(model_file(folder), {"model_fingerprint": cache.context["model"]})
        if kind == "needle":
            argv += ["--seed", str(NEEDLE_SEED), "--passkey-trials", "1"]
            argv += ["--passkey-depths", ",".join(f"{d:g}" for d in PASSKEY_DEPTHS)]
        if method == "theta":  # no default base: start where NTK-aware puts it, b * s^(d/(d-2)) (d = 64)
            argv += ["--new-base", str(1e5 * (length / L) ** (64 / 62))]
        print(f"search: {method} at {length} ({OBJECTIVES[kind]})", flush=True)
        code = ctxext_main(argv)
        if code != 0:
            print(f"  search of {method} at {length} failed (exit {code})", flush=True)

    def search_finished(method: str, length: int, kind: str) -> bool:
        trials_file = search_dir(method, length, kind) / "trials.jsonl"
        return trials_file.exists() and len(read_trials(trials_file)) >= trials_wanted(kind)

    cells, passkey, missing = {}, {}, []

    def perplexity_cell(label: str, config: dict | None, doc: str, length: int, compute: bool) -> None:
        span = text_tokens_per_window(length, bos)
        ids = texts[doc][:span]
        fields = {
            "kind": "perplexity",
            "config": config,
            "document": doc,
            "length": length,
            "tokens": tokens_fingerprint([ids]),
            "protocol": "one window" if label != NATIVE else "8192/4096",
        }
        found = cache.get(fields)
        if found is None and compute and not out_of_time():
            began = time.perf_counter()
            if label == NATIVE:
                nll, tokens = sliding_window_nll(get_model(), ids, 8192, 4096, bos)
            else:
                scored = score_perplexity(
                    get_model(), MethodConfig.from_mapping(config), [_Doc(doc, ids)], length, None, bos
                )
                nll, tokens = scored["nll_sum"], scored["tokens"]
            found = cache.put(
                fields, {"nll_sum": nll, "tokens": tokens, "seconds": time.perf_counter() - began, "machine": machine}
            )
            print(f"  {label} @ {length} on {doc}: {math.exp(nll / tokens):.3f} ({found['seconds']:.0f} s)", flush=True)
        if found is None:
            missing.append(f"perplexity: {label} at {length} on {doc}")
        else:
            cells[(label, doc, length)] = found

    passkey_lengths = [int(x) for x in args.passkey_lengths.split(",")]

    def passkey_cell(label: str, config: dict | None, length: int, compute: bool) -> None:
        trials = plan_trials([length], list(PASSKEY_DEPTHS), 1, seed=0)
        fields = {
            "kind": "passkey",
            "config": config,
            "length": length,
            "keys": [(t.depth, t.key) for t in trials],
        }
        found = cache.get(fields)
        if found is None and compute and not out_of_time():
            began = time.perf_counter()
            method = checked_method(label, MethodConfig.from_mapping(config) if config else None)
            records = run_passkey(get_model(), tokenizer, trials, [method], bos)
            found = cache.put(
                fields,
                {
                    "correct": sum(r["correct"] for r in records),
                    "trials": len(records),
                    "records": records,
                    "seconds": time.perf_counter() - began,
                    "machine": machine,
                },
            )
            print(f"  passkey {label}: {found['correct']}/{found['trials']} ({found['seconds']:.0f} s)", flush=True)
        if found is None:
            missing.append(f"passkey: {label} at {length}")
        else:
            passkey[(label, length)] = found

    def collect(compute_defaults: bool, compute_searched: bool) -> list[dict]:
        """Every row of the page from the cached cells, computing missing ones only for --methods at --lengths."""
        cells.clear(), passkey.clear(), missing.clear()
        rows = {}
        for length in report_lengths:
            for doc in docs:
                perplexity_cell(NATIVE, None, doc, length, compute_defaults and length in lengths)
        for length in passkey_lengths:
            if length <= L and BASELINE in report_methods:  # within the window: the baseline of the effective length
                passkey_cell(BASELINE, {"method": BASELINE}, length, compute_defaults and BASELINE in methods)
        for method in report_methods:
            for kind in ("defaults", "searched", "needle"):
                if kind != "defaults" and not has_search(method, kind):
                    continue
                for length in report_lengths:
                    if kind == "defaults":
                        variant, info = default_variant(method, length / L), None
                    else:
                        variant, info = searched_variant(method, length, kind)
                    row = rows.setdefault(
                        variant.label,
                        {
                            "label": variant.label,
                            "method": method,
                            "kind": kind,
                            "note": variant.note,
                            "configs": {},
                            "search": {},
                        },
                    )
                    row["configs"][length] = variant.config
                    if info:
                        row["search"][length] = info
                    if variant.config is None:
                        if kind != "defaults":
                            missing.append(f"search: {method} at {length} ({variant.note})")
                        continue
                    compute = (compute_defaults if kind == "defaults" else compute_searched) and (
                        method in methods and length in lengths
                    )
                    for doc in docs:
                        perplexity_cell(variant.label, variant.config, doc, length, compute)
                    if length in passkey_lengths:
                        passkey_cell(variant.label, variant.config, length, compute)
        return list(rows.values())

    def report(rows: list[dict]) -> None:
        search_seconds, search_trials = 0.0, 0
        for folder in (root / "searches").glob("*") if (root / "searches").exists() else []:
            for trial in read_trials(folder / "trials.jsonl") if (folder / "trials.jsonl").exists() else []:
                search_seconds += trial.get("seconds", 0.0)
                search_trials += 1
        build_report(
            {
                "lengths": report_lengths,
                "documents": docs,
                "rows": rows,
                "cells": cells,
                "passkey": passkey,
                "missing": missing,
                "dtype": args.dtype,
                "machine": machine,
                "passkey_lengths": passkey_lengths,
                "original_length": L,
                "search_trials": args.search_trials,
                "needle_trials": args.needle_trials,
                "search_seconds": search_seconds,
                "search_trial_count": search_trials,
                "run_seconds": time.perf_counter() - started,
            },
            Path(args.output),
        )

    # 1. defaults (and native) everywhere, 2. searches, 3. the searched rows; the report after each stage.
    report(collect(compute_defaults=True, compute_searched=False))
    if not args.report_only:
        for length in lengths:
            for kind in ("needle", "searched"):
                for method in methods:
                    if not has_search(method, kind) or search_finished(method, length, kind) or out_of_time():
                        continue
                    run_search(method, length, kind)
                    report(collect(compute_defaults=False, compute_searched=True))
    report(collect(compute_defaults=False, compute_searched=True))
    print(f"\n{Path(args.output) / 'comparison.md'}: {len(missing)} cells missing", flush=True)
    return 0


@dataclass
class _Doc:
    name: str
    ids: object

    def __len__(self):
        return len(self.ids)


if __name__ == "__main__":
    sys.exit(main())
