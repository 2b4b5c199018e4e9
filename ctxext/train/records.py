"""What a fine-tuning run records about itself: recipe.yaml (the same recipe on a resume), run.json (what ran
where), metrics.jsonl (one line per training log or evaluation, sent to the `--report-to` trackers too) and
metrics.png (perplexity against step).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import time
from pathlib import Path
from typing import TYPE_CHECKING

import yaml
from matplotlib.ticker import ScalarFormatter

from ..errors import CtxextError
from ..outputs import atomic_write_text, new_figure, provenance, save_figure, write_json
from . import trackers
from .lora import count_parameters
from .recipe import SECTIONS, Recipe

if TYPE_CHECKING:
    from .state import Setup


# ------------------------------------------------------------------------------------------- the metrics
class MetricsLog:
    """metrics.jsonl, written by the main process; one line per training log or evaluation. With trackers
    (`--report-to`), every record goes to them too, at its step."""

    def __init__(self, path: Path, enabled: bool, accelerator=None):
        self.path = path
        self.enabled = enabled
        self.accelerator = accelerator  # the Accelerator whose trackers get the records, or None

    def write(self, record: dict) -> None:
        if self.enabled:
            with open(self.path, "a") as handle:
                handle.write(json.dumps(record) + "\n")
        if self.accelerator is not None:
            self.accelerator.log(trackers.tracker_metrics(record), step=record["step"])  # the main process logs

    def read(self) -> list[dict]:
        if not self.path.is_file():
            return []
        return [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]

    def truncate_after(self, step: int) -> None:
        """Drop what a killed run logged after its last checkpoint, so the resumed log is the uninterrupted one."""
        if self.enabled and self.path.is_file():
            kept = [r for r in self.read() if r["step"] <= step]
            atomic_write_text(self.path, "".join(json.dumps(r) + "\n" for r in kept))


class LossWindow:
    """The mean training loss and the tokens/s since the last log line (time paused for evaluations excluded)."""

    def __init__(self, tokens_per_step: int):
        self.tokens_per_step = tokens_per_step
        self.reset()

    def reset(self) -> None:
        self.loss, self.steps, self.clock = 0.0, 0, time.perf_counter()

    def add(self, loss: float) -> None:
        self.loss, self.steps = self.loss + loss, self.steps + 1

    @contextlib.contextmanager
    def paused(self):
        paused = time.perf_counter()
        yield
        self.clock += time.perf_counter() - paused

    def record(self, step: int, last_loss: float, lr: float, tokens: int) -> dict:
        """The metrics.jsonl line of a training log; the window starts again."""
        elapsed = time.perf_counter() - self.clock
        record = {
            "kind": "train",
            "step": step,
            "loss": self.loss / self.steps,
            "last_loss": last_loss,
            "lr": lr,
            "tokens": tokens,
            "tokens_per_second": round(self.steps * self.tokens_per_step / elapsed, 1),
        }
        self.reset()
        return record


# ------------------------------------------------------------------------------------------- the run
def open_run(setup: Setup, resume: bool) -> MetricsLog:
    """The output directory with its recipe.yaml, and the metrics log (which feeds the trackers, if any)."""
    runtime = setup.runtime
    if runtime.is_main:
        setup.output.mkdir(parents=True, exist_ok=True)
        write_or_check_recipe(setup.output / "recipe.yaml", setup.recipe, resume)
    runtime.accelerator.wait_for_everyone()
    tracked = runtime.accelerator if runtime.trackers else None
    return MetricsLog(setup.output / "metrics.jsonl", runtime.is_main, tracked)


def write_or_check_recipe(path: Path, recipe: Recipe, resume: bool) -> None:
    """A fresh run records its recipe; a resumed run must be the same recipe (max_steps may grow)."""
    current = recipe.to_dict()
    if resume and path.is_file():
        saved = with_default_sections(yaml.safe_load(path.read_text()))
        a = {**saved, "train": {**saved["train"], "max_steps": None}}
        b = {**current, "train": {**current["train"], "max_steps": None}}
        if a != b:
            changed = sorted(f"{k}" for k in set(a) | set(b) if a.get(k) != b.get(k))
            raise CtxextError(
                f"--resume: the recipe differs from the one in {path} (in: {', '.join(changed)}); "
                "resume with the same recipe, or start a new output_dir"
            )
        if saved["train"]["max_steps"] != current["train"]["max_steps"]:
            atomic_write_text(path, recipe.to_yaml())
        return
    atomic_write_text(path, recipe.to_yaml())


def with_default_sections(saved: dict) -> dict:
    """A recorded recipe with any section it predates (e.g. mixed_window) filled in with that section's defaults."""
    return {**{name: dataclasses.asdict(cls()) for name, cls in SECTIONS.items()}, **saved}


def start_trackers(setup: Setup, resume_step: int | None) -> None:
    """Open the `--report-to` trackers with the recipe as the run's config (ctxext.train.trackers)."""
    if setup.runtime.trackers:
        trackers.start_trackers(setup.runtime.accelerator, setup.recipe.to_dict(), setup.output, resume_step)


def write_run_record(setup: Setup, model, resume: bool, start_step: int) -> None:
    """run.json: what ran where (sizes, data, evaluation, provenance); a resume appends to its `resumed` list."""
    runtime = setup.runtime
    n_trainable, n_total = count_parameters(runtime.accelerator.unwrap_model(model))
    if not runtime.is_main:
        return
    record = {
        "model": setup.recipe.model,
        "model_path": setup.model_path,
        "method": setup.recipe.method.to_dict(),
        "method_length": setup.method_length,
        "seq_len": setup.recipe.seq_len,
        "train_sequence_length": setup.recipe.train_sequence_length,
        "mixed_window": {"short_length": setup.short_length, "short_fraction": setup.recipe.mixed_window.short_fraction}
        if setup.mixed_window
        else None,
        "processes": runtime.accelerator.num_processes,
        "sequence_parallel": runtime.sp_size,  # processes to a sequence (parallel.sp_size)
        "distributed_type": str(runtime.accelerator.distributed_type),
        "device": str(runtime.accelerator.device),
        "precision": runtime.precision,
        "attn_implementation": runtime.attn_implementation,
        "gradient_accumulation": runtime.accumulation,
        "parameters": {"trainable": n_trainable, "total": n_total},
        "data": setup.data_info,
        "eval": {
            "documents": [d.name for d in setup.eval_documents],
            "document_tokens": [len(d) for d in setup.eval_documents],
            "lengths": setup.eval_lengths,
            "stride": setup.recipe.eval.stride,
            "bos_token_id": setup.bos_token_id,
        },
        "environment": provenance(),
    }
    path = setup.output / "run.json"
    if resume and path.is_file():
        previous = json.loads(path.read_text())
        record["resumed"] = previous.get("resumed", []) + [{"from_step": start_step, **record["environment"]}]
        record["environment"] = previous.get("environment", record["environment"])
    write_json(path, record)


# ------------------------------------------------------------------------------------------- the plot
def plot_metrics(records: list[dict], path: Path, title: str) -> None:
    """Perplexity against step, one line per evaluated length, and the base model's line at the original length."""
    evals = [r for r in records if r.get("kind") == "eval"]
    if not evals:
        return
    fig = new_figure(figsize=(7.5, 4.8))
    ax = fig.subplots()
    lengths = sorted({int(k) for r in evals for k in r["perplexity"]}, reverse=True)
    for length in lengths:
        points = [(r["step"], r["perplexity"][str(length)]) for r in evals if str(length) in r["perplexity"]]
        ax.plot(*zip(*points), marker="o", label=f"fine-tuned, window {length}")
    base = [r for r in records if r.get("kind") == "base_reference"]
    if base:
        ax.axhline(
            base[0]["perplexity"],
            color="black",
            ls="--",
            lw=1,
            label=f"base model at its context {base[0]['length']}: {base[0]['perplexity']:.2f}",
        )
    save_step_plot(fig, ax, path, "perplexity (held-out, lower is better)", title)


def save_step_plot(fig, ax, path: Path, ylabel: str, title: str) -> None:
    """The shared look of perplexity-against-step plots: log y with plain numbers, grid, legend; then save."""
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(ScalarFormatter())
    ax.yaxis.set_minor_formatter(ScalarFormatter())
    ax.set_xlabel("fine-tuning step")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, path)


def plot_title(setup: Setup) -> str:
    recipe = setup.recipe
    return (
        f"{Path(setup.recipe.model).name}: {recipe.method.label}, LoRA r={recipe.lora.r}, "
        f"{setup.method_length} -> {recipe.seq_len}"
    )
