"""Checkpoints of a fine-tuning run and what it leaves behind: resumable state under checkpoints/step-N/
(written all or nothing, loaded weights-only, so a resume never runs code from a file), then the PEFT adapter
and the merged model.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from peft import PeftModel
from transformers.integrations import unset_hf_deepspeed_config

from ..errors import CtxextError
from ..integrations.adapters import adapter_record
from ..loading import load_model
from ..outputs import atomic_output_dir
from ..patching.patch import recorded_rope_parameters
from ..record_file import CtxextRecord, write_record
from ..serving.forms import write_config_for_serving

if TYPE_CHECKING:
    from .records import MetricsLog
    from .state import Setup

CHECKPOINTS = "checkpoints"


@dataclass
class RunState:
    """Where a run stands: steps done, tokens trained on, and training seconds (those before a resume too)."""

    step: int = 0
    tokens: int = 0
    seconds_before: float = 0.0
    started: float = 0.0

    def start_clock(self) -> None:
        self.started = time.perf_counter()

    def seconds(self) -> float:
        return self.seconds_before + time.perf_counter() - self.started


# ------------------------------------------------------------------------------------------ save and resume
def checkpoint_dir(output: Path, step: int) -> Path:
    return output / CHECKPOINTS / f"step-{step:06d}"


def latest_checkpoint(output: Path) -> Path | None:
    folder = output / CHECKPOINTS
    if not folder.is_dir():
        return None
    done = sorted(p for p in folder.glob("step-*") if (p / "state.json").is_file())
    return done[-1] if done else None


def save_checkpoint(setup: Setup, model, optimizer, step: int, tokens: int, seconds: float) -> None:
    """Everything a resume needs, written to a temporary folder and renamed into place (all or nothing).

    A run resumed from its last checkpoint (max_steps unchanged) already has that step's checkpoint: kept.
    """
    runtime = setup.runtime
    accelerator = runtime.accelerator
    final = checkpoint_dir(setup.output, step)
    if (final / "state.json").is_file():
        return
    staging = final.with_name(final.name + ".tmp")
    if runtime.is_main:
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
    accelerator.wait_for_everyone()
    if runtime.sharded:
        accelerator.save_state(str(staging / "accelerate"))
    elif runtime.is_main:
        torch.save(trainable_state(accelerator.unwrap_model(model)), staging / "trainable.pt")
        torch.save(optimizer.state_dict(), staging / "optimizer.pt")
    torch.save(rng_state(), staging / f"rng-{accelerator.process_index}.pt")
    accelerator.wait_for_everyone()
    if runtime.is_main:
        state = {"step": step, "tokens": tokens, "seconds": seconds, "processes": accelerator.num_processes}
        (staging / "state.json").write_text(json.dumps(state))  # inside the staging folder, renamed below
        os.replace(staging, final)
    accelerator.wait_for_everyone()


def restore(setup: Setup, model, optimizer, log: MetricsLog) -> RunState:
    """Load the last checkpoint into the model and optimizer; drop what was logged after it."""
    folder = latest_checkpoint(setup.output)
    saved = load_checkpoint(setup, model, optimizer, folder)
    log.truncate_after(saved["step"])
    setup.runtime.accelerator.print(f"resuming from {folder} (step {saved['step']})")
    return RunState(saved["step"], saved["tokens"], saved["seconds"])


def load_checkpoint(setup: Setup, model, optimizer, folder: Path) -> dict:
    runtime = setup.runtime
    accelerator = runtime.accelerator
    state = json.loads((folder / "state.json").read_text())
    if state["processes"] != accelerator.num_processes and runtime.sharded:
        raise CtxextError(
            f"checkpoint {folder} was written by {state['processes']} processes; resume a sharded "
            f"run with the same number ({accelerator.num_processes} now)"
        )
    if runtime.sharded:
        accelerator.load_state(str(folder / "accelerate"))  # accelerate loads weights-only too
    else:
        saved = load_saved(folder / "trainable.pt")
        params = dict(accelerator.unwrap_model(model).named_parameters())
        with torch.no_grad():
            for name, value in saved.items():
                params[name].copy_(value)
        optimizer.load_state_dict(load_saved(folder / "optimizer.pt"))
    rng_file = folder / f"rng-{accelerator.process_index}.pt"
    if rng_file.is_file():
        set_rng_state(load_saved(rng_file))
    return state


def trainable_state(model) -> dict[str, torch.Tensor]:
    # No clone: torch.save writes before training goes on (on a GPU, .cpu() copies anyway).
    return {name: p.detach().cpu() for name, p in model.named_parameters() if p.requires_grad}


def rng_state() -> dict[str, torch.Tensor | list[torch.Tensor]]:
    """The random generators' states as tensors, which a weights-only load accepts."""
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def load_saved(path: Path):
    """A file of a checkpoint, loaded weights-only: tensors and plain containers, never code from the file."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        raise CtxextError(
            f"refusing to load '{path}': it holds more than tensors and plain containers, and loading it would "
            "run code from the file; resume only from checkpoints ctxext wrote"
        ) from error


# ------------------------------------------------------------------------------------------ the adapter and merged
def save_results(setup: Setup, model) -> None:
    """adapter/ (standard PEFT) and merged/ (LoRA folded in; the config carries the rope parameters)."""
    runtime = setup.runtime
    accelerator = runtime.accelerator
    state_dict = accelerator.get_state_dict(model) if runtime.sharded else None
    accelerator.wait_for_everyone()
    if not runtime.is_main:
        return
    unwrapped = accelerator.unwrap_model(model)
    with atomic_output_dir(setup.output / "adapter", overwrite=True) as staging:
        unwrapped.save_pretrained(staging, state_dict=state_dict)
        setup.tokenizer.save_pretrained(staging)
        record = {**(adapter_record(unwrapped.get_base_model()) or {}), **method_record(setup)}  # patch, then recipe
        write_record(staging, CtxextRecord("adapter", "ctxext finetune", record))
    if not setup.recipe.train.save_merged:
        return
    if runtime.sharded:
        with without_zero3_loading(accelerator):
            merged = merge_adapter(setup.model_path, setup.output / "adapter", setup.recipe.method)
    else:
        merged = unwrapped.merge_and_unload()
    with atomic_output_dir(setup.output / "merged", overwrite=True) as staging:
        merged.config.use_cache = True
        merged.save_pretrained(staging)
        form = write_config_for_serving(merged, staging)  # the method's exact native form where one exists
        setup.tokenizer.save_pretrained(staging)
        record = {
            **method_record(setup),
            "rope_parameters": recorded_rope_parameters(merged),
            "max_position_embeddings": merged.config.max_position_embeddings,
            "written_as": {"format": "native", "rope_type": form.rope_parameters["rope_type"], "how": form.how},
        }
        write_record(staging, CtxextRecord("merged", "ctxext finetune", record))


def merge_adapter(model_path: str, adapter: Path, method):
    """Base model + method + adapter, merged, on the CPU (for runs whose live model is sharded)."""
    base = load_model(model_path, dtype="auto", device="cpu")
    method.apply(base)
    return PeftModel.from_pretrained(base, str(adapter)).merge_and_unload()


@contextlib.contextmanager
def without_zero3_loading(accelerator):
    """Under DeepSpeed ZeRO-3, transformers' `from_pretrained` partitions what it loads (zero.Init, a collective
    every process must join): the main process loading the base alone for the merge would wait for the others
    forever. accelerate keeps the ZeRO-3 config in transformers' global even with zero3_init_flag false (and its
    `zero3_init_context_manager(enable=False)` then does nothing), so hide it from transformers meanwhile."""
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    if plugin is None:
        yield
        return
    unset_hf_deepspeed_config()
    try:
        yield
    finally:
        plugin.set_deepspeed_weakref()  # accelerate's own call that set it


def method_record(setup: Setup) -> dict:
    """The ctxext.yaml beside the adapter and the merged model: the source, the method and its lengths."""
    record = {
        "source_model": setup.recipe.model,
        "model_path": setup.model_path,
        **setup.recipe.method.to_dict(),
        "original_max_position_embeddings": setup.method_length,
        "seq_len": setup.recipe.seq_len,
    }
    if setup.mixed_window:
        record["mixed_window"] = {
            "short_fraction": setup.recipe.mixed_window.short_fraction,
            "short_length": setup.short_length,
            "inference": MIXED_WINDOW_INFERENCE.format(L=setup.method_length),
        }
    return record


MIXED_WINDOW_INFERENCE = (
    "trained with the original rotary up to {L} tokens and the patched one past it; to run it that way, patch, "
    "load, then: from ctxext.patching.rotary import original_rotary_within; with original_rotary_within(model, {L}): "
    "... (a forward whose positions all lie below {L} then uses the original rotary)"
)
