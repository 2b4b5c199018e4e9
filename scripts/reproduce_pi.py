"""The Position Interpolation experiment in miniature, end to end on a CPU (PI paper, Table 3).

    python scripts/reproduce_pi.py --preset tiny-cpu

1. Pretrain a tiny LLaMA at context 256 on Shakespeare, Othello and Macbeth held out (cached, deterministic).
2. Score the held-out plays before any fine-tuning: the base at 256, and at 1024 and 2048 with no scaling
   and with PI x4 / x8.
3. LoRA fine-tune with PI x4 at 1024 for 1000 steps (`ctxext finetune`, configs/recipes/tiny-cpu.yaml),
   scoring at steps 0, 200, ..., 1000.
4. Write the table (the shape of PI Table 3) and the plot to docs/pi_reproduction.{md,png,json,csv}.

    python scripts/reproduce_pi.py --preset tiny-cpu --mixed-window [--short-fraction 0.5]

fine-tunes the same pretrained model with mixed-window LoRA instead (LongRoPE2: a fraction of the micro-batches
cut at 256 tokens and trained with the original rotary, the rest at 1024 with PI x4), scored every 200 steps at
1024 (PI x4) and at 256 (the original rotary, and the patched one too), and adds it to docs/pi_reproduction.md
beside the plain LoRA run already in docs/pi_reproduction.json (whose recipe must be the same, mixed_window aside).

Every perplexity is the docs/METHODS.md sliding-window protocol (ctxext.eval), stride 256, on the same held-out
tokens, under the same precision as the fine-tuning (bf16 autocast on a CPU with native bf16).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import resource
import shlex
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

PRESETS = {"tiny-cpu": "configs/recipes/tiny-cpu.yaml"}


def comparisons(original: int, target: int, with_yarn: bool) -> list[tuple[str, dict | None, list[int]]]:
    """(label, method mapping or None for the model as pretrained, lengths) scored before fine-tuning:
    the base at L, T and 2T; PI at T (x T/L) and at 2T (x 2T/L); optionally YaRN at the same scales."""
    s1, s2 = target / original, 2 * target / original
    rows = [
        ("none (base)", None, [original, target, 2 * target]),
        (f"PI x{s1:g}", {"method": "linear", "factor": s1}, [target]),
        (f"PI x{s2:g}", {"method": "linear", "factor": s2}, [2 * target]),
    ]
    if with_yarn:
        rows += [
            (f"YaRN x{s1:g}", {"method": "yarn", "factor": s1}, [target]),
            (f"YaRN x{s2:g}", {"method": "yarn", "factor": s2}, [2 * target]),
        ]
    return rows


def load_average() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "n/a"


def evaluate_before(recipe, with_yarn: bool, progress: bool) -> list[dict]:
    """Perplexity of the pretrained model under each scaling, before any fine-tuning."""
    import torch

    from ctxext.config import MethodConfig
    from ctxext.eval.runner import EvalMethod, run_perplexity
    from ctxext.loading import load_model, load_tokenizer
    from ctxext.runtime import training_precision
    from ctxext.train.evaluation import load_eval_documents, plan_length
    from ctxext.train.pretrain_tiny import resolve_model_name

    path = resolve_model_name(recipe.model)
    tokenizer = load_tokenizer(path)
    model = load_model(path, dtype=torch.float32, device="cpu", attn_implementation="sdpa")
    original = model.config.max_position_embeddings
    documents, _, bos = load_eval_documents(recipe, tokenizer, original, [])
    precision = training_precision(recipe.train.precision, torch.device("cpu"), sharded=False)
    rows = []
    for label, mapping, lengths in comparisons(original, recipe.seq_len, with_yarn):
        method = EvalMethod(label, MethodConfig.from_mapping(mapping) if mapping else None)
        plans = [plan_length(documents, n, recipe.eval.stride, bos) for n in lengths]
        started = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision != "fp32"):
            scores = run_perplexity(model, documents, plans, [method], bos)
        for score in scores:
            rows.append(
                {
                    "method": label,
                    "length": score.length,
                    "perplexity": score.perplexity,
                    "tokens_scored": score.tokens,
                    "windows": score.windows,
                    "seconds": score.seconds,
                }
            )
            if progress:
                print(
                    f"  {label:<12} @ {score.length:>5}: perplexity {score.perplexity:9.2f}  "
                    f"({score.tokens} tokens, {time.perf_counter() - started:.0f} s)",
                    flush=True,
                )
    return rows


def model_description(settings, record, checkpoint: Path) -> str:
    if settings is None or record is None:
        return str(checkpoint)
    return (
        f"LLaMA, {settings.num_layers} layers, hidden {settings.hidden_size}, {settings.num_heads} heads of "
        f"{settings.hidden_size // settings.num_heads}, vocabulary {settings.vocab_size} (its own byte-level BPE), "
        f"context {settings.context}, RoPE base {settings.rope_theta:g}; pretrained for {settings.steps} steps "
        f"of {settings.batch_size} x {settings.context} tokens (lr {settings.lr:g}, cosine to "
        f"{settings.min_lr:g}) on {record['training_tokens']} tokens of {len(record['training_texts'])} texts, "
        f"in {record['seconds'] / 60:.1f} min"
    )


def choose_threads(setting: str) -> int:
    cores = os.cpu_count() or 1
    if setting != "auto":
        return max(1, int(setting))
    busy = os.getloadavg()[0]  # runnable processes, averaged over the last minute
    return cores if busy < 0.5 else max(1, cores - round(busy))


def cpu_minutes() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return (usage.ru_utime + usage.ru_stime) / 60


def fmt(value: float) -> str:
    return f"{value:.2f}" if value < 1e4 else f"{value:.3g}"


def shape_checks(
    base: float, curve: dict[int, float], before: dict, original: int, target: int
) -> list[tuple[str, bool, str]]:
    """The expected shape (the issue's 'Must show'), each with what was measured."""
    steps = sorted(curve)
    at200 = curve.get(200)
    last = curve[steps[-1]]
    none_long = before.get(("none (base)", target))
    checks = [
        (f"at step 0, PI is worse than the base at {original}", curve[0] > base, f"{fmt(curve[0])} vs {fmt(base)}"),
    ]
    if at200 is not None:
        checks.append(
            (
                f"by step 200, within 10% of the base at {original}",
                at200 <= 1.10 * base,
                f"{fmt(at200)} = {at200 / base:.3f} x base",
            )
        )
        checks.append((f"step {steps[-1]} is no worse than step 200", last <= at200, f"{fmt(last)} vs {fmt(at200)}"))
    if none_long is not None:
        checks.append(
            (
                f"direct extrapolation (no scaling) at {target} is far worse than the base",
                none_long > 1.5 * base,
                f"{fmt(none_long)} = {none_long / base:.1f} x base",
            )
        )
    return checks


def stride_note(stride: int | None, lengths: list[int]) -> str:
    """Which windows slid by less than the stated stride (ctxext.eval.perplexity.stride_at: a window not longer
    than the stride slides by half its length), so the set-up line says what each column used."""
    from ctxext.eval.perplexity import stride_at

    halved = [f"{n} by {stride_at(n, stride)}" for n in lengths if stride_at(n, stride) != stride]
    return f" Windows not longer than the stride slide by half their length: {', '.join(halved)}." if halved else ""


def write_report(docs: Path, result: dict) -> None:
    docs.mkdir(parents=True, exist_ok=True)
    (docs / "pi_reproduction.json").write_text(json.dumps(result, indent=2) + "\n")
    with open(docs / "pi_reproduction.csv", "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["stage", "method", "window", "step", "perplexity"])
        for row in result["before_fine_tuning"]:
            writer.writerow(["before", row["method"], row["length"], "", row["perplexity"]])
        for window, curve in result["fine_tuning"]["perplexity"].items():
            for step, value in curve.items():
                writer.writerow(["fine-tuning", result["fine_tuning"]["label"], window, step, value])
    plot(docs / "pi_reproduction.png", result)
    (docs / "pi_reproduction.md").write_text(markdown(result))


def plot(path: Path, result: dict) -> None:
    from matplotlib.figure import Figure  # no pyplot: no global state, no GUI backend

    from ctxext.train.records import save_step_plot

    ft = result["fine_tuning"]
    fig = Figure(figsize=(7.5, 4.8))
    ax = fig.subplots()
    for window, curve in ft["perplexity"].items():
        steps = sorted(int(s) for s in curve)
        style = "-o" if int(window) == ft["target"] else ":s"
        ax.plot(steps, [curve[str(s)] for s in steps], style, label=f"{ft['label']} + LoRA, scored at {window}")
    ax.axhline(
        result["base_at_original"],
        color="black",
        ls="--",
        lw=1,
        label=f"base model at {ft['original']} (no fine-tuning): {fmt(result['base_at_original'])}",
    )
    none_long = [
        r for r in result["before_fine_tuning"] if r["method"] == "none (base)" and r["length"] == ft["target"]
    ]
    if none_long:
        ax.axhline(
            none_long[0]["perplexity"],
            color="tab:red",
            ls=":",
            lw=1,
            label=f"no scaling at {ft['target']} (direct extrapolation): {fmt(none_long[0]['perplexity'])}",
        )
    save_step_plot(
        fig,
        ax,
        path,
        "held-out perplexity (Othello + Macbeth)",
        f"Position Interpolation in miniature: tiny LLaMA, {ft['original']} -> {ft['target']}",
    )


def markdown(result: dict) -> str:
    ft = result["fine_tuning"]
    target, original = ft["target"], ft["original"]
    curve = ft["perplexity"][str(target)]
    steps = sorted(int(s) for s in curve)
    lines = [
        "# Position Interpolation, reproduced in miniature on a CPU",
        "",
        "The shape of PI Table 3 (Chen et al. 2023; docs/METHODS.md) on a tiny LLaMA pretrained at 256 tokens:",
        "fine-tuning with PI recovers the perplexity at 4x the context within a few hundred steps.",
        "",
        "Made by:",
        "",
        "```",
        result["command"],
        "```",
        "",
        f"Machine: {result['machine']}. Date: {result['date_utc']}. Wall time of this run: "
        f"**{result['timing']['total_minutes']:.1f} min** ({timing_text(result['timing'])}; "
        f"{result['timing']['cpu_minutes']:.1f} CPU-minutes on {result['timing']['torch_threads']} torch thread(s)). "
        f"Load average at start / end: {result['load_average']['start']} / {result['load_average']['end']} "
        "(the 2 cores were shared with other work; see the note below).",
        "",
        *end_to_end_lines(result["timing"]),
        "## Fine-tuning (the shape of PI Table 3)",
        "",
        f"Held-out perplexity while LoRA-fine-tuning with {ft['label']} at {target} tokens. "
        f"Base model at its own context ({original}): **{fmt(result['base_at_original'])}**.",
        "",
        "| window | " + " | ".join("0 steps" if s == 0 else str(s) for s in steps) + " |",
        "|---|" + "---|" * len(steps),
    ]
    for window in sorted((int(w) for w in ft["perplexity"]), reverse=True):
        values = ft["perplexity"][str(window)]
        name = f"{window} ({ft['label']})" if window == target else f"{window} (same model, original window)"
        lines.append(f"| {name} | " + " | ".join(fmt(values[str(s)]) for s in steps) + " |")
    lines += [
        "",
        "For comparison, PI's LLaMA-7B at 8192 (x4): 16.10 at 0 steps, 7.12 at 200, 6.95 at 1000, base at 2048: 7.20.",
        "",
        "## Before fine-tuning",
        "",
        "| method | " + " | ".join(str(n) for n in result["lengths"]) + " |",
        "|---|" + "---|" * len(result["lengths"]),
    ]
    by = {(r["method"], r["length"]): r["perplexity"] for r in result["before_fine_tuning"]}
    for method in dict.fromkeys(r["method"] for r in result["before_fine_tuning"]):
        lines.append(
            f"| {method} | "
            + " | ".join(fmt(by[(method, n)]) if (method, n) in by else "-" for n in result["lengths"])
            + " |"
        )
    lines += ["", "## The expected shape", ""]
    for text, ok, measured in result["checks"]:
        lines.append(f"- [{'x' if ok else ' '}] {text}: {measured}")
    lines += [
        "",
        "![perplexity against step](pi_reproduction.png)",
        "",
        *mixed_window_markdown(result),
        "## Set-up",
        "",
        f"- Model: {result['model']['description']}.",
        f"- Held-out text: {', '.join(result['held_out']['documents'])} ({result['held_out']['tokens']} tokens after "
        f"cutting each play to its first {result['held_out']['max_tokens_per_doc']} tokens); never trained on, "
        "neither by the tokenizer, nor in pretraining, nor in fine-tuning.",
        f"- Perplexity: the docs/METHODS.md sliding-window protocol, stride {result['stride']}, via ctxext.eval; "
        f"precision {result['precision']}.{stride_note(result['stride'], result['lengths'])}",
        f"- Fine-tuning: {result['recipe_summary']}.",
        f"- Data: {result['data']}.",
        "",
        "Files: pi_reproduction.json (every number, with timings), pi_reproduction.csv, pi_reproduction.png.",
        "",
    ]
    if result.get("notes"):
        lines += ["## Notes", ""] + [f"- {n}" for n in result["notes"]] + [""]
    return "\n".join(lines)


def end_to_end_lines(timing: dict) -> list[str]:
    """When the pretrained model came from the cache: the whole experiment's time, pretraining included."""
    if "total_minutes_with_pretraining" not in timing:
        return []
    lines = [
        f"With the pretraining (built earlier by the same code, {timing['pretrain_minutes_when_built']:.1f} min "
        f"wall): **{timing['total_minutes_with_pretraining']:.1f} min** wall, end to end."
    ]
    if "pretrain_cpu_minutes" in timing:
        cpu = timing["pretrain_cpu_minutes"] + timing["cpu_minutes"]
        lines[0] += (
            f" CPU time, end to end: **{cpu:.1f} CPU-minutes** ({timing['pretrain_cpu_minutes']:.1f} "
            f"pretraining + {timing['cpu_minutes']:.1f} the rest), all on one thread: on an idle machine "
            f"the wall time on one thread is about the CPU time, and less on two"
        )
        if timing.get("pretrain_cpu_minutes_source"):
            lines[0] += f" ({timing['pretrain_cpu_minutes_source']})"
        lines[0] += "."
    return lines + [""]


def timing_text(timing: dict) -> str:
    parts = []
    keys = [("pretrain_minutes", "pretraining")] if not timing.get("pretrain_cached") else []
    for key, label in keys + [
        ("before_minutes", "evaluation before fine-tuning"),
        ("finetune_minutes", "fine-tuning with evaluations"),
    ]:
        if key in timing:
            parts.append(f"{label} {timing[key]:.1f} min")
    if timing.get("pretrain_cached"):
        parts.append("the pretrained model came from the cache")
    return ", ".join(parts)


def run_curves(setup, records) -> dict:
    """One fine-tuning run's evaluations (perplexity by window, then by step) and its speed."""
    evals = [r for r in records if r["kind"] == "eval"]
    windows = sorted({k for r in evals for k in r["perplexity"]}, key=int, reverse=True)
    speeds = sorted(r["tokens_per_second"] for r in records if r["kind"] == "train")
    curves = {
        "perplexity": {w: {str(r["step"]): r["perplexity"][w] for r in evals} for w in windows},
        "median_tokens_per_second": speeds[len(speeds) // 2] if speeds else None,
        "output_dir": str(setup.output),
    }
    if evals and "rotary" in evals[0]:  # a mixed-window run: which rotary scored each window, and the patched one
        curves["rotary"] = evals[0]["rotary"]
        curves["perplexity_patched_rotary"] = {
            w: {str(r["step"]): r["perplexity_patched_rotary"][w] for r in evals}
            for w in evals[0]["perplexity_patched_rotary"]
        }
    return curves


def recipe_summary(recipe, run: dict, recipe_path: str) -> str:
    return (
        f"{recipe_path}: LoRA r={recipe.lora.r} (alpha {recipe.lora.alpha:g}, dropout "
        f"{recipe.lora.dropout:g}) on {', '.join(recipe.lora.target_modules)}, embeddings and "
        f"norms trained; AdamW {tuple(recipe.optim.betas)}, lr {recipe.optim.lr:g}, "
        f"{recipe.optim.warmup_steps} warm-up steps from {recipe.optim.warmup_start_factor:g} "
        f"of lr, {recipe.train.max_steps} steps of {recipe.train.global_batch_size} x "
        f"{recipe.seq_len} tokens; {run['parameters']['trainable']} trainable parameters"
    )


def mixed_window_markdown(result: dict) -> list[str]:
    """The section comparing mixed-window with plain LoRA, from pi_reproduction.json's `mixed_window` entry."""
    section = result.get("mixed_window")
    if not section:
        return []
    if "status" in section:  # not measured yet: what will be, and how
        return [
            "## Mixed-window fine-tuning (LongRoPE2)",
            "",
            "Mixed-window training (LongRoPE2, arXiv 2502.20082) against plain LoRA on this miniature: "
            + section["status"],
            "",
            "```",
            section["command"],
            "```",
            "",
        ]
    plain, mixed = section["plain"], section["mixed"]
    original, target, label = section["original"], section["target"], section["label"]
    short, long = str(original), str(target)
    steps = sorted({int(s) for run in (plain, mixed) for s in run["perplexity"].get(long, {})})
    timing = section["timing"]

    def row(name: str, values: dict) -> str:
        return f"| {name} | " + " | ".join(fmt(values[str(s)]) if str(s) in values else "-" for s in steps) + " |"

    lines = [
        "## Mixed-window fine-tuning (LongRoPE2)",
        "",
        "Mixed-window training (LongRoPE2, arXiv 2502.20082) against plain LoRA, from the same pretrained model "
        f"with the same recipe: in the mixed-window run, {section['short_fraction']:g} of the micro-batches (spread "
        f"evenly by index) hold the same packed tokens cut into sequences of {section['short_length']} tokens and "
        f"train with the original rotary; the others train at {target} with {label}. The claim to check: "
        "short-context quality is kept.",
        "",
        "Made by (both fine-tunings, then this section):",
        "",
        "```",
        section["command"],
        "```",
        "",
        f"Machine: {section['machine']}. Date: {section['date_utc']}. Wall time: {timing_text_mixed(timing)}. "
        f"Load average at start / end: {section['load_average']['start']} / {section['load_average']['end']}. "
        f"Precision: {section['precision']}.",
        "",
        f"Held-out perplexity (lower is better; the evaluation of the run above). Base model at {original}, no "
        f"fine-tuning: **{fmt(section['base_at_original'])}**. Each row names the rotary it was scored with: a "
        f"mixed-window model runs the original rotary within {original} tokens and {label} past it.",
        "",
        "| model, window (rotary) | " + " | ".join("0 steps" if s == 0 else str(s) for s in steps) + " |",
        "|---|" + "---|" * len(steps),
        row(f"plain LoRA, {short} ({label})", plain["perplexity"].get(short, {})),
        row(f"mixed-window, {short} (original rotary)", mixed["perplexity"].get(short, {})),
        row(f"mixed-window, {short} ({label}, the switch not used)", mixed["perplexity_patched_rotary"].get(short, {})),
        row(f"plain LoRA, {long} ({label})", plain["perplexity"].get(long, {})),
        row(f"mixed-window, {long} ({label})", mixed["perplexity"].get(long, {})),
        "",
        *mixed_window_findings(section),
        "",
        f"Fine-tuning speed (median tokens/s): plain {plain['median_tokens_per_second'] or 0:.0f}, mixed-window "
        f"{mixed['median_tokens_per_second'] or 0:.0f}. The plain LoRA run here repeats the one in the table above "
        "on this machine, so that both rows come from the same pretrained model, precision and code.",
        "",
    ]
    return lines


def timing_text_mixed(timing: dict) -> str:
    parts = [f"{timing[key]:.1f} min {label}" for key, label in TIMING_LABELS if key in timing]
    return ", ".join(parts) + f"; {timing.get('cpu_minutes', 0):.1f} CPU-minutes on 1 torch thread"


TIMING_LABELS = [
    ("pretrain_minutes", "pretraining (not cached on this machine)"),
    ("plain_minutes", "plain LoRA with evaluations"),
    ("mixed_minutes", "mixed-window LoRA with evaluations"),
    ("total_minutes", "in all"),
]


def mixed_window_findings(section: dict) -> list[str]:
    """The short- and long-context numbers at step 200 and at the last step both runs reached."""
    plain, mixed = section["plain"]["perplexity"], section["mixed"]["perplexity"]
    base, short, long = section["base_at_original"], str(section["original"]), str(section["target"])
    done = sorted(set(plain.get(long, {})) & set(mixed.get(long, {})), key=int)
    lines = []
    for step in dict.fromkeys(s for s in ("200", done[-1] if done else None) if s in done):
        m_short, p_short, m_long, p_long = mixed[short][step], plain[short][step], mixed[long][step], plain[long][step]
        lines.append(
            f"- Step {step}: at {short}, mixed-window {fmt(m_short)} ({m_short / base:.3f} x base) against plain "
            f"LoRA {fmt(p_short)} ({p_short / base:.3f} x base); at {long}, mixed-window {fmt(m_long)} against "
            f"plain LoRA {fmt(p_long)} ({m_long / p_long:.3f} x)."
        )
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny-cpu")
    parser.add_argument(
        "--work-dir",
        default=None,
        help="where the fine-tuning run goes (default: outputs/reproduce-pi-<preset>-<time>); must not exist",
    )
    parser.add_argument("--docs-dir", default="docs", help="where the table and the plot go (default docs/)")
    parser.add_argument("--with-yarn", action="store_true", help="also score YaRN x4 / x8 before fine-tuning")
    parser.add_argument(
        "--threads",
        default="auto",
        help="torch CPU threads: a number, or auto (all cores on an idle "
        "machine, 1 when other jobs already keep the cores busy: 2 threads fighting other "
        "processes for 2 cores run 2-3x slower than 1 thread here)",
    )
    parser.add_argument(
        "--mixed-window",
        action="store_true",
        help="instead of the PI run: fine-tune with mixed-window LoRA (LongRoPE2) and with plain LoRA, one after "
        "the other, and add the comparison to DOCS/pi_reproduction.md (a section) and .json (mixed_window)",
    )
    parser.add_argument(
        "--resume",
        action="store_true",
        help="with --mixed-window: continue the runs in an existing --work-dir from their checkpoints",
    )
    parser.add_argument(
        "--short-fraction", type=float, default=0.5, help="with --mixed-window: the fraction of short micro-batches"
    )
    parser.add_argument("--render", metavar="JSON", help="only re-write the .md/.png/.csv from a pi_reproduction.json")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="recipe overrides, e.g. train.max_steps=200")
    args = parser.parse_args(argv)
    if args.render:
        write_report(REPO / args.docs_dir, json.loads(Path(args.render).read_text()))
        print(f"re-rendered {REPO / args.docs_dir}/pi_reproduction.md, .png, .csv from {args.render}")
        return 0

    os.environ.setdefault("CTXEXT_CACHE_DIR", str(REPO / ".cache"))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    from ctxext import assets
    from ctxext.errors import CtxextError
    from ctxext.runtime import machine_description
    from ctxext.train.loop import finetune
    from ctxext.train.pretrain_tiny import TINY_PRESETS, tiny_shakespeare_checkpoint
    from ctxext.train.recipe import load_recipe, parse_overrides

    started, load_start = time.perf_counter(), load_average()
    threads = choose_threads(args.threads)
    torch.set_num_threads(threads)
    print(f"torch threads: {threads} (load average {load_start})", flush=True)
    recipe_path = PRESETS[args.preset]
    stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
    work = Path(args.work_dir or REPO / "outputs" / f"reproduce-pi-{args.preset}-{stamp}")
    overrides = {"output_dir": str(work / "finetune"), **parse_overrides(args.overrides)}
    if args.mixed_window:
        overrides.update({"mixed_window.enabled": True, "mixed_window.short_fraction": args.short_fraction})
    try:
        recipe = load_recipe(REPO / recipe_path, overrides)
        if work.exists() and not args.resume:
            raise CtxextError(f"work directory '{work}' already exists; choose another --work-dir, or --resume")
        if args.resume and not (args.mixed_window and work.is_dir()):
            raise CtxextError("--resume continues a --mixed-window run: give both, and the run's --work-dir")
    except CtxextError as error:
        print(f"reproduce_pi: error: {error}", file=sys.stderr)
        return 2
    timing = {}

    print("1. the tiny LLaMA, pretrained at 256 tokens on Shakespeare (Othello and Macbeth held out)", flush=True)
    settings = TINY_PRESETS.get(recipe.model.removeprefix("ctxext:")) if recipe.model.startswith("ctxext:") else None
    pretrain_record, cached = None, True
    t0 = time.perf_counter()
    if settings is not None:
        cached = (assets.cache_dir() / f"tiny-llama-shakespeare-{settings.key()}" / "config.json").is_file()
        checkpoint = tiny_shakespeare_checkpoint(settings)
        pretrain_record = json.loads((checkpoint / "pretrain.json").read_text())
    else:  # another model given as model=PATH: no pretraining stage
        checkpoint = Path(recipe.model)
    timing["pretrain_minutes"] = (time.perf_counter() - t0) / 60
    timing["pretrain_cached"] = cached
    if cached and pretrain_record:
        timing["pretrain_minutes_when_built"] = pretrain_record["seconds"] / 60
    if pretrain_record and "cpu_seconds" in pretrain_record:
        timing["pretrain_cpu_minutes"] = pretrain_record["cpu_seconds"] / 60
    print(f"   {checkpoint} ({'cached' if cached else 'built'})", flush=True)
    if args.mixed_window:
        command = "python scripts/reproduce_pi.py " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
        info = {
            "command": command.strip(),
            "started": started,
            "load_start": load_start,
            "machine": f"{machine_description()} ({torch.get_num_threads()} torch threads)",
            "timing": {} if cached else {"pretrain_minutes": timing["pretrain_minutes"]},
        }
        return run_mixed_window(recipe, recipe_path, work, REPO / args.docs_dir, info, args.resume)

    print("2. perplexity before fine-tuning", flush=True)
    t0 = time.perf_counter()
    before = evaluate_before(recipe, args.with_yarn, progress=True)
    timing["before_minutes"] = (time.perf_counter() - t0) / 60

    print(
        f"3. LoRA fine-tuning with {recipe.method.label} at {recipe.seq_len} for {recipe.train.max_steps} steps",
        flush=True,
    )
    t0 = time.perf_counter()
    setup, records = finetune(recipe, resume=False, progress=True)
    timing["finetune_minutes"] = (time.perf_counter() - t0) / 60
    timing["total_minutes"] = (time.perf_counter() - started) / 60
    timing["cpu_minutes"] = cpu_minutes()
    timing["torch_threads"] = threads
    if "pretrain_minutes_when_built" in timing:
        timing["total_minutes_with_pretraining"] = timing["total_minutes"] + timing["pretrain_minutes_when_built"]

    evals = [r for r in records if r["kind"] == "eval"]
    base = [r for r in records if r["kind"] == "base_reference"][0]
    windows = sorted({k for r in evals for k in r["perplexity"]}, key=int, reverse=True)
    curve = {w: {str(r["step"]): r["perplexity"][w] for r in evals} for w in windows}
    before_by = {(r["method"], r["length"]): r["perplexity"] for r in before}
    target_curve = {int(s): v for s, v in curve[str(recipe.seq_len)].items()}
    checks = shape_checks(base["perplexity"], target_curve, before_by, setup.method_length, recipe.seq_len)
    run = json.loads((setup.output / "run.json").read_text())
    notes = []
    step0_pi = before_by.get((f"PI x{recipe.seq_len / setup.method_length:g}", recipe.seq_len))
    if step0_pi is not None:
        notes.append(
            f"Consistency: {recipe.method.label} at {recipe.seq_len} before fine-tuning is {fmt(step0_pi)} in the evaluator "
            f"run and {fmt(target_curve[0])} at step 0 of the fine-tuning run (LoRA starts as a no-op)."
        )
    train_records = [r for r in records if r["kind"] == "train"]
    if train_records:
        speeds = [r["tokens_per_second"] for r in train_records]
        notes.append(
            f"Fine-tuning speed: median {sorted(speeds)[len(speeds) // 2]:.0f} tokens/s "
            f"({recipe.train.global_batch_size} x {recipe.seq_len} tokens per step)."
        )
    notes.append(
        "Wall time depends on what else runs: this machine's 2 cores are shared, and the load average "
        "above shows how busy they were. On an idle machine the same run is faster."
    )
    command = "python scripts/reproduce_pi.py " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
    result = {
        "command": command.strip(),
        "date_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{machine_description()} ({torch.get_num_threads()} torch threads)",
        "load_average": {"start": load_start, "end": load_average()},
        "timing": timing,
        "lengths": sorted({r["length"] for r in before}),
        "before_fine_tuning": before,
        "base_at_original": base["perplexity"],
        "fine_tuning": {
            "label": recipe.method.label,
            "target": recipe.seq_len,
            "original": setup.method_length,
            "perplexity": curve,
            "output_dir": str(setup.output),
        },
        "checks": checks,
        "model": {
            "path": str(checkpoint),
            "settings": pretrain_record and pretrain_record["settings"],
            "description": model_description(settings, pretrain_record, checkpoint),
        },
        "held_out": {
            "documents": run["eval"]["documents"],
            "tokens": sum(run["eval"]["document_tokens"]),
            "max_tokens_per_doc": recipe.eval.max_tokens_per_doc,
        },
        "stride": recipe.eval.stride,
        "precision": run["precision"],
        "recipe_summary": recipe_summary(recipe, run, recipe_path),
        "data": (
            f"{run['data'].get('documents')} Shakespeare texts, {run['data'].get('tokens')} tokens, packed into "
            f"{recipe.seq_len}-token sequences ({run['data'].get('epochs')} epochs over the run)"
        ),
        "notes": notes,
    }
    write_report(REPO / args.docs_dir, result)
    print(markdown(result))
    print(f"wrote {REPO / args.docs_dir}/pi_reproduction.md, .png, .json, .csv")
    return 0


def run_mixed_window(recipe, recipe_path: str, work: Path, docs: Path, run_info: dict, resume: bool) -> int:
    """Fine-tune with mixed windows and with plain LoRA (same model, same recipe otherwise), each in its folder
    under `work` (resumed from its checkpoint with --resume, or read back if finished), and add the comparison to
    DOCS/pi_reproduction.json and .md."""
    import copy

    import torch

    from ctxext.train.checkpoints import latest_checkpoint
    from ctxext.train.loop import finetune

    runs, timing = {}, dict(run_info["timing"])
    for name, mixed in (("mixed", True), ("plain", False)):
        run_recipe = copy.deepcopy(recipe)
        run_recipe.mixed_window.enabled = mixed
        run_recipe.output_dir = str(work / ("mixed-window" if mixed else "plain-lora"))
        resuming = resume and latest_checkpoint(Path(run_recipe.output_dir).resolve()) is not None
        print(
            f"{'3' if mixed else '4'}. {'mixed-window' if mixed else 'plain'} LoRA fine-tuning with "
            f"{recipe.method.label} at {recipe.seq_len} for {recipe.train.max_steps} steps"
            + (f" ({recipe.mixed_window.short_fraction:g} of the micro-batches short)" if mixed else "")
            + (" (resumed)" if resuming else ""),
            flush=True,
        )
        t0 = time.perf_counter()
        setup, records = finetune(run_recipe, resume=resuming, progress=True)
        timing[f"{name}_minutes"] = (time.perf_counter() - t0) / 60
        runs[name] = (setup, records)
    timing["total_minutes"] = (time.perf_counter() - run_info["started"]) / 60
    timing["cpu_minutes"] = cpu_minutes()
    setup, records = runs["mixed"]
    run = json.loads((setup.output / "run.json").read_text())
    section = {
        "command": run_info["command"],
        "date_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": run_info["machine"],
        "load_average": {"start": run_info["load_start"], "end": load_average()},
        "timing": timing,
        "torch_threads": torch.get_num_threads(),
        "precision": run["precision"],
        "label": recipe.method.label,
        "original": setup.method_length,
        "target": recipe.seq_len,
        "short_fraction": recipe.mixed_window.short_fraction,
        "short_length": setup.short_length,
        "recipe_summary": recipe_summary(recipe, run, recipe_path),
        "model_path": str(Path(setup.model_path).resolve()),
        "base_at_original": [r for r in records if r["kind"] == "base_reference"][0]["perplexity"],
        "plain": run_curves(*runs["plain"]),
        "mixed": run_curves(*runs["mixed"]),
    }
    (work / "mixed_window_section.json").write_text(json.dumps(section, indent=2) + "\n")
    saved = docs / "pi_reproduction.json"
    result = json.loads(saved.read_text())
    result["mixed_window"] = section
    write_report(docs, result)
    print("\n".join(mixed_window_markdown(result)))
    print(f"wrote {docs}/pi_reproduction.md and .json (its mixed_window entry); {work}/mixed_window_section.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
