"""The fine-tuning loop: a patched model, LoRA, packed data, AdamW with the PI warm-up, in-loop perplexity.

Read it top to bottom: `finetune(recipe)` calls `prepare`, which sets everything up (checking all input
before anything is written), then `train`, whose loop is the whole story of a step: learning rate,
`train_step` (micro-batches, backward, clip, AdamW), log, evaluate, checkpoint. It runs as one process, or
under `accelerate launch` (DDP, FSDP, DeepSpeed) with the same numbers: the global batch is fixed by the
recipe, and every process takes its share of every step's samples by index, so 1 process and N processes
see the same data.

The output directory:

    recipe.yaml          the resolved recipe          metrics.jsonl   one JSON line per log / evaluation
    run.json             environment, sizes, timing   metrics.png     perplexity against step
    checkpoints/step-N/  resumable state              adapter/        the PEFT adapter (+ ctxext.yaml)
    trackers/            TensorBoard's event files    merged/         base + LoRA folded in, rope config included
                         (--report-to tensorboard)

Checkpoint files hold tensors and plain containers only and are loaded weights-only: a resume never runs code
from a file.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml

from ..errors import CtxextError
from ..runtime import (
    Processes,
    attention_implementation,
    cpu_processes,
    launched_sharded,
    on_main_first,
    training_precision,
)
from .recipe import Recipe

CHECKPOINTS = "checkpoints"


# --------------------------------------------------------------------------------------- the schedule
def lr_factor(step: int, warmup_steps: int, warmup_start_factor: float, schedule: str, max_steps: int) -> float:
    """Multiplier of the peak lr at optimizer step `step` (0-based): PI's linear warm-up from 10%, then constant.

    PI: "linear learning rate warm-up of 20 steps beginning from 10% of the maximum learning rate".
    `cosine` decays to 10% of the peak at the last step instead of staying constant.
    """
    if warmup_steps and step < warmup_steps:
        return warmup_start_factor + (1.0 - warmup_start_factor) * step / warmup_steps
    if schedule == "cosine":
        progress = (step - warmup_steps) / max(1, max_steps - 1 - warmup_steps)
        return 0.1 + 0.45 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    return 1.0


def sample_indices(
    step: int, micro_step: int, rank: int, world_size: int, micro_batch: int, global_batch: int
) -> list[int]:
    """The samples one process uses in one micro-step: the step's global batch is split across processes."""
    first = step * global_batch + (micro_step * world_size + rank) * micro_batch
    return list(range(first, first + micro_batch))


# ------------------------------------------------------------------------------------------- runtime
@dataclass
class Runtime:
    accelerator: object
    processes: Processes
    precision: str  # fp32 | bf16-mixed | bf16
    weights_dtype: torch.dtype
    attn_implementation: str
    accumulation: int  # micro-steps per optimizer step, per process
    trackers: tuple[str, ...] = ()  # --report-to: tensorboard, wandb, mlflow (ctxext.train.trackers)

    @property
    def is_main(self) -> bool:
        return self.accelerator.is_main_process

    @property
    def sharded(self) -> bool:
        """FSDP and DeepSpeed shard parameters: every process must take part in every forward."""
        from accelerate.utils import DistributedType

        return self.accelerator.distributed_type in (DistributedType.FSDP, DistributedType.DEEPSPEED)


def make_runtime(recipe: Recipe, output: Path | None = None, trackers: tuple[str, ...] = ()) -> Runtime:
    """The accelerate processes, device, precision, attention and trackers of a run (ctxext.runtime chooses the
    first four; the trackers write under `output`)."""
    from accelerate import Accelerator

    from .trackers import TRACKERS_DIR

    train = recipe.train
    processes = Processes(cpu=cpu_processes(train.device), always=True)
    world = processes.world_size
    device = processes.device_for(train.device)
    if train.global_batch_size % (train.micro_batch_size * world):
        raise CtxextError(
            f"train.global_batch_size ({train.global_batch_size}) must be a multiple of train.micro_batch_size "
            f"({train.micro_batch_size}) x processes ({world})"
        )
    accumulation = train.global_batch_size // (train.micro_batch_size * world)
    precision = training_precision(train.precision, device, launched_sharded())
    if precision != "fp32" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise CtxextError(f"train.precision={precision}, but this GPU has no bf16; use train.precision=fp32")
    accelerator = Accelerator(
        cpu=cpu_processes(train.device) or device.type == "cpu",
        gradient_accumulation_steps=accumulation,
        mixed_precision="no" if precision == "fp32" else "bf16",
        log_with=list(trackers) or None,
        project_dir=str(output / TRACKERS_DIR) if trackers and output is not None else None,
    )
    weights_dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    attn = attention_implementation(train.attn_implementation, accelerator.device, precision != "fp32")
    return Runtime(accelerator, processes, precision, weights_dtype, attn, accumulation, tuple(trackers))


# ------------------------------------------------------------------------------------------ setting up
@dataclass
class Setup:
    recipe: Recipe
    runtime: Runtime
    model: object  # PeftModel, patched
    tokenizer: object
    train_data: object  # PackedSequences
    data_info: dict
    eval_documents: list
    eval_lengths: list[int]
    bos_token_id: int | None
    original_length: int
    output: Path
    model_path: str
    short_length: int | None = None  # mixed_window: tokens per short sequence (None: mixed-window is off)

    @property
    def mixed_window(self) -> bool:
        return self.short_length is not None


def supported_length(model) -> int | None:
    """The longest sequence the patched model is meant for, or None for dynamic methods (no limit)."""
    from ..patching import is_dynamic

    if is_dynamic(model):
        return None
    return int(model.config.max_position_embeddings)


def prepare(recipe: Recipe, resume: bool, progress: bool = True, report_to=None) -> Setup:
    """Load and check everything; raises CtxextError for bad input before the output directory is touched.

    `report_to`: the trackers, as for `ctxext finetune --report-to` ('tensorboard,wandb', a list, or None).
    """
    from accelerate.utils import set_seed

    from .trackers import tracker_names

    trackers = tracker_names(report_to)
    output = check_run_directory(recipe, resume)
    runtime = make_runtime(recipe, output, trackers)
    set_seed(recipe.seed)  # the same LoRA init on every process and every run
    model_path, tokenizer, model, original_length = load_patched_model(recipe, runtime, progress)
    short_length = mixed_window_length(recipe, model, original_length)
    model = with_lora(model, recipe)
    train_data, info = load_training_data(recipe, runtime, tokenizer, progress)
    documents, lengths, bos = load_eval_documents(recipe, tokenizer, original_length, info.get("names", []))
    return Setup(
        recipe=recipe,
        runtime=runtime,
        model=model,
        tokenizer=tokenizer,
        train_data=train_data,
        data_info=info,
        eval_documents=documents,
        eval_lengths=lengths,
        bos_token_id=bos,
        original_length=original_length,
        output=output,
        model_path=model_path,
        short_length=short_length,
    )


def mixed_window_length(recipe: Recipe, model, original_length: int) -> int | None:
    """The short sequences' length under mixed_window (checked against the patched model), else None."""
    from .mixed_window import check_switchable, short_length_for

    if not recipe.mixed_window.enabled:
        return None
    check_switchable(model, recipe.method.label)
    return short_length_for(recipe.mixed_window, original_length)


def check_run_directory(recipe: Recipe, resume: bool) -> Path:
    """The run's output directory: new (or empty), or, under --resume, one holding a checkpoint."""
    from ..outputs import check_overlap

    output = Path(recipe.output_dir).expanduser().resolve()
    protected = [recipe.model] if Path(recipe.model).expanduser().exists() else []
    if resume:
        if not latest_checkpoint(output):
            raise CtxextError(f"--resume: '{output}' holds no checkpoint to resume from")
    elif output.is_dir() and any(output.iterdir()):
        raise CtxextError(
            f"output directory '{output}' already exists; use --resume to continue that run, "
            "or choose another output_dir"
        )
    return check_overlap(output, protected)  # not inside the input model, not a file


def load_patched_model(recipe: Recipe, runtime: Runtime, progress: bool = True):
    """(model path, tokenizer, model patched with the recipe's method, original context length)."""
    from ..loading import load_model, load_tokenizer
    from ..patching import applied_method
    from .pretrain_tiny import resolve_model_name

    on_main_first(runtime.processes, lambda: resolve_model_name(recipe.model))  # builds the tiny model once, if named
    model_path = resolve_model_name(recipe.model)
    tokenizer = load_tokenizer(model_path)
    model = load_model(
        model_path,
        dtype=runtime.weights_dtype,
        device=runtime.accelerator.device,
        attn_implementation=runtime.attn_implementation,
        progress=progress,
    )
    original_length = int(model.config.max_position_embeddings)
    recipe.method.apply(model)
    original_length = applied_method(model)["original_max_position_embeddings"] or original_length
    limit = supported_length(model)
    if limit is not None and recipe.seq_len > limit:
        raise CtxextError(
            f"seq_len {recipe.seq_len} is beyond what the model patched with {recipe.method.label} supports "
            f"({limit} = {original_length} x {recipe.method.factor:g}); raise method.factor to at least "
            f"{math.ceil(recipe.seq_len / original_length)} or lower seq_len"
        )
    return model_path, tokenizer, model, original_length


def with_lora(model, recipe: Recipe):
    """The model ready to train: gradient checkpointing as asked, no KV cache, LoRA adapters (PEFT)."""
    from .lora import add_lora

    if recipe.train.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    lora = recipe.lora
    model = add_lora(model, lora.r, lora.alpha, lora.dropout, lora.target_modules, lora.train_embeddings_and_norms)
    for param in model.parameters():  # adapters, embeddings and norms train in fp32 whatever the base dtype
        if param.requires_grad and param.dtype != torch.float32:
            param.data = param.data.float()
    return model


def load_training_data(recipe: Recipe, runtime: Runtime, tokenizer, progress: bool):
    """(PackedSequences, description): tokenised once by the main process, cached, memory-mapped by all."""
    from .data import PackedSequences, token_stream

    length = recipe.train_sequence_length
    needed = recipe.train.max_steps * recipe.train.global_batch_size * length + 2 * length
    max_tokens = recipe.data.max_tokens or needed
    on_main_first(
        runtime.processes, lambda: token_stream(recipe.data, tokenizer, max_tokens, is_main=True, progress=progress)
    )
    stream, info = token_stream(recipe.data, tokenizer, max_tokens, is_main=False)
    train_data = PackedSequences(stream, length, seed=recipe.seed)
    info.update(
        sequence_length=length,
        sequences_per_epoch=train_data.per_epoch,
        epochs=round(train_data.epochs_for(recipe.train.max_steps * recipe.train.global_batch_size), 3),
    )
    return train_data, info


# ------------------------------------------------------------------------------------------ evaluation
def load_eval_documents(recipe: Recipe, tokenizer, original_length: int, train_names: list[str]):
    """(documents, lengths, bos_token_id) of the held-out evaluation; checked against the training documents."""
    from ..eval.data import load_documents, tokenizer_adds_bos
    from .data import check_held_out

    ev = recipe.eval
    if not ev.every:
        return [], [], None
    doc_set = load_documents(
        tokenizer,
        text_files=ev.text_files or None,
        dataset=ev.dataset or None,
        split=ev.split,
        dataset_config=ev.config,
        text_field=ev.text_field,
        max_docs=ev.max_docs,
    )
    documents = doc_set.documents
    if ev.max_tokens_per_doc:
        for doc in documents:
            doc.ids = doc.ids[: ev.max_tokens_per_doc]
    check_held_out(train_names, [d.name for d in documents])
    lengths = sorted(set(ev.lengths or [recipe.seq_len, original_length]), reverse=True)
    bos = tokenizer.bos_token_id if tokenizer_adds_bos(tokenizer) else None
    for length in lengths:  # fails now if no document is long enough
        plan_length(documents, length, ev.stride, bos)
    return documents, lengths, bos


def plan_length(documents, length: int, stride: int, bos: int | None):
    """The evaluator's window plan at one length (the stride rule is `ctxext.eval.perplexity.stride_at`)."""
    from ..eval.runner import plan_lengths

    return plan_lengths(documents, [length], stride, bos)[0]


def evaluate(setup: Setup, model, lengths: list[int], switch: bool = True) -> dict[int, float]:
    """Perplexity at each length on the held-out documents (docs/METHODS.md protocol, via ctxext.eval).

    The windows are shared out over the processes and the sums gathered; under FSDP/DeepSpeed every process
    scores every window, since each forward needs all of them. A mixed-window run scores windows of at most L
    tokens with the original rotary, unless `switch` is False (then every window uses the patched rotary).
    """
    from ..eval.perplexity import evaluation_mode, perplexity, window_nll
    from .mixed_window import rotary_switch

    runtime = setup.runtime
    accelerator = runtime.accelerator
    share = not runtime.sharded and accelerator.num_processes > 1
    rank, world = (accelerator.process_index, accelerator.num_processes) if share else (0, 1)
    results = {}
    switched = rotary_switch(setup.mixed_window and switch, model, setup.original_length)
    with accelerator.autocast(), evaluation_mode(model), switched:
        for plan in [
            plan_length(setup.eval_documents, n, setup.recipe.eval.stride, setup.bos_token_id) for n in lengths
        ]:
            nll = 0.0
            for index in range(rank, len(plan.windows), world):
                window = plan.windows[index]
                nll += window_nll(model, setup.eval_documents[window.doc].ids, window, setup.bos_token_id)
            if share:
                nll = float(
                    accelerator.reduce(
                        torch.tensor([nll], dtype=torch.float64, device=accelerator.device), reduction="sum"
                    )[0]
                )
            results[plan.length] = perplexity(nll, plan.scored_tokens)
    return results


def base_reference(setup: Setup, model) -> float:
    """The unpatched model's perplexity at the original length (LoRA's B starts at zero, so this is the base)."""
    from ..patching import unpatch

    unpatch(model)
    try:
        return evaluate(setup, model, [setup.original_length])[setup.original_length]
    finally:
        setup.recipe.method.apply(model)


# ------------------------------------------------------------------------------------------ checkpoints
def checkpoint_dir(output: Path, step: int) -> Path:
    return output / CHECKPOINTS / f"step-{step:06d}"


def latest_checkpoint(output: Path) -> Path | None:
    folder = output / CHECKPOINTS
    if not folder.is_dir():
        return None
    done = sorted(p for p in folder.glob("step-*") if (p / "state.json").is_file())
    return done[-1] if done else None


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
    import pickle

    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        raise CtxextError(
            f"refusing to load '{path}': it holds more than tensors and plain containers, and loading it would "
            "run code from the file; resume only from checkpoints ctxext wrote"
        ) from error


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


# ----------------------------------------------------------------------------------------------- logging
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
            from .trackers import tracker_metrics

            self.accelerator.log(tracker_metrics(record), step=record["step"])  # the main process logs

    def read(self) -> list[dict]:
        if not self.path.is_file():
            return []
        return [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]

    def truncate_after(self, step: int) -> None:
        """Drop what a killed run logged after its last checkpoint, so the resumed log is the uninterrupted one."""
        from ..outputs import atomic_write_text

        if self.enabled and self.path.is_file():
            kept = [r for r in self.read() if r["step"] <= step]
            atomic_write_text(self.path, "".join(json.dumps(r) + "\n" for r in kept))


def plot_metrics(records: list[dict], path: Path, title: str) -> None:
    """Perplexity against step, one line per evaluated length, and the base model's line at the original length."""
    from ..outputs import new_figure

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
    from matplotlib.ticker import ScalarFormatter

    from ..outputs import save_figure

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


# ------------------------------------------------------------------------------------------------ saving
def method_record(setup: Setup) -> dict:
    record = {
        "source_model": setup.recipe.model,
        "model_path": setup.model_path,
        **setup.recipe.method.to_dict(),
        "original_max_position_embeddings": setup.original_length,
        "seq_len": setup.recipe.seq_len,
    }
    if setup.mixed_window:
        record["mixed_window"] = {
            "short_fraction": setup.recipe.mixed_window.short_fraction,
            "short_length": setup.short_length,
            "inference": MIXED_WINDOW_INFERENCE.format(L=setup.original_length),
        }
    return record


MIXED_WINDOW_INFERENCE = (
    "trained with the original rotary up to {L} tokens and the patched one past it; to run it that way, patch, "
    "load, then: from ctxext.patching.rotary import original_rotary_within; with original_rotary_within(model, {L}): "
    "... (a forward whose positions all lie below {L} then uses the original rotary)"
)


def save_results(setup: Setup, model) -> None:
    """adapter/ (standard PEFT) and merged/ (LoRA folded in; the config carries the rope parameters)."""
    from ..outputs import atomic_output_dir
    from ..patching.patch import recorded_rope_parameters
    from ..serving.forms import write_config_for_serving

    runtime = setup.runtime
    accelerator = runtime.accelerator
    state_dict = accelerator.get_state_dict(model) if runtime.sharded else None
    accelerator.wait_for_everyone()
    if not runtime.is_main:
        return
    unwrapped = accelerator.unwrap_model(model)
    note = (
        "# Written by `ctxext finetune`. Load the adapter on the base model patched with this method:\n"
        "#   model = AutoModelForCausalLM.from_pretrained(source); ctxext.patch(model, method, factor=...)\n"
        "#   model = PeftModel.from_pretrained(model, this_folder)\n"
    )
    with atomic_output_dir(setup.output / "adapter", overwrite=True) as staging:
        unwrapped.save_pretrained(staging, state_dict=state_dict)
        setup.tokenizer.save_pretrained(staging)
        (staging / "ctxext.yaml").write_text(note + yaml.safe_dump(method_record(setup), sort_keys=False))
    if not setup.recipe.train.save_merged:
        return
    if runtime.sharded:
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
        (staging / "ctxext.yaml").write_text(
            "# Written by `ctxext finetune`: base + LoRA, merged.\n" + yaml.safe_dump(record, sort_keys=False)
        )


def merge_adapter(model_path: str, adapter: Path, method):
    """Base model + method + adapter, merged, on the CPU (for runs whose live model is sharded)."""
    from peft import PeftModel

    from ..loading import load_model

    base = load_model(model_path, dtype="auto", device="cpu")
    method.apply(base)
    return PeftModel.from_pretrained(base, str(adapter)).merge_and_unload()


# ------------------------------------------------------------------------------------------------- train
def train(setup: Setup, resume: bool, progress: bool = True, after_step=None) -> list[dict]:
    """Run the steps; `after_step(step)`, if given, is called after each optimizer step is logged, evaluated and
    checkpointed (1-based step)."""
    recipe, runtime = setup.recipe, setup.runtime
    max_steps = recipe.train.max_steps
    log = open_run(setup, resume)
    model, optimizer = prepare_training(setup)
    state = restore(setup, model, optimizer, log) if resume else RunState()
    start_trackers(setup, resume_step=state.step if resume else None)
    write_run_record(setup, model, resume, state.step)
    if state.step == 0 and recipe.eval.every:
        evaluate_before_training(setup, model, log)

    bar = progress_bar(setup, state.step, progress)
    window = LossWindow(recipe.train.global_batch_size * recipe.train_sequence_length)
    state.start_clock()
    model.train()
    for step in range(state.step, max_steps):
        lr = set_learning_rate(optimizer, recipe, step)
        loss = train_step(setup, model, optimizer, step)
        state.step, state.tokens = step + 1, state.tokens + window.tokens_per_step
        window.add(loss)
        bar.update(1)
        if due(state.step, recipe.train.log_every, max_steps):
            record = window.record(state.step, loss, lr, state.tokens)
            log.write(record)
            bar.set_postfix(loss=f"{record['loss']:.4f}")
        with window.paused():  # evaluation and checkpoints do not count in the training tokens/s
            if recipe.eval.every and due(state.step, recipe.eval.every, max_steps):
                log_evaluation(setup, model, log, state.step, bar)
                model.train()
            every = recipe.train.checkpoint_every
            if every and state.step % every == 0 and state.step < max_steps:
                save_checkpoint(setup, model, optimizer, state.step, state.tokens, state.seconds())
                if runtime.is_main:
                    plot_metrics(log.read(), setup.output / "metrics.png", plot_title(setup))
        if after_step is not None:
            after_step(state.step)
    bar.close()
    return finish(setup, model, optimizer, log, state)


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


def due(step: int, every: int, max_steps: int) -> bool:
    """Whether something done every `every` steps (and after the last one) is due after 1-based `step`."""
    return step % every == 0 or step == max_steps


def open_run(setup: Setup, resume: bool) -> MetricsLog:
    """The output directory with its recipe.yaml, and the metrics log (which feeds the trackers, if any)."""
    runtime = setup.runtime
    if runtime.is_main:
        setup.output.mkdir(parents=True, exist_ok=True)
        write_or_check_recipe(setup.output / "recipe.yaml", setup.recipe, resume)
    runtime.accelerator.wait_for_everyone()
    tracked = runtime.accelerator if runtime.trackers else None
    return MetricsLog(setup.output / "metrics.jsonl", runtime.is_main, tracked)


def start_trackers(setup: Setup, resume_step: int | None) -> None:
    """Open the `--report-to` trackers with the recipe as the run's config (ctxext.train.trackers)."""
    from . import trackers

    if setup.runtime.trackers:
        trackers.start_trackers(setup.runtime.accelerator, setup.recipe.to_dict(), setup.output, resume_step)


def prepare_training(setup: Setup):
    """(model, AdamW optimizer), prepared by accelerate (DDP, FSDP or DeepSpeed wrapping)."""
    recipe, runtime = setup.recipe, setup.runtime
    accelerator = runtime.accelerator
    trainable = [p for p in setup.model.parameters() if p.requires_grad]
    # The fused kernel updates in place: no temporaries the size of the trainable embedding, and faster.
    fused = accelerator.device.type in ("cuda", "cpu") and not runtime.sharded
    optimizer = torch.optim.AdamW(
        trainable,
        lr=recipe.optim.lr,
        betas=tuple(recipe.optim.betas),
        weight_decay=recipe.optim.weight_decay,
        fused=fused or None,
    )
    deepspeed = getattr(accelerator.state, "deepspeed_plugin", None)
    if deepspeed is not None:  # DeepSpeed reads the micro-batch from a dataloader, and we pass none
        deepspeed.deepspeed_config["train_micro_batch_size_per_gpu"] = recipe.train.micro_batch_size
    return accelerator.prepare(setup.model, optimizer)


def restore(setup: Setup, model, optimizer, log: MetricsLog) -> RunState:
    """Load the last checkpoint into the model and optimizer; drop what was logged after it."""
    folder = latest_checkpoint(setup.output)
    saved = load_checkpoint(setup, model, optimizer, folder)
    log.truncate_after(saved["step"])
    setup.runtime.accelerator.print(f"resuming from {folder} (step {saved['step']})")
    return RunState(saved["step"], saved["tokens"], saved["seconds"])


def evaluate_before_training(setup: Setup, model, log: MetricsLog) -> None:
    """Step 0: the unpatched base model's reference (if asked) and the patched model before any update."""
    if setup.recipe.eval.base_reference:
        started = time.perf_counter()
        base = base_reference(setup, setup.runtime.accelerator.unwrap_model(model))
        log.write(
            {
                "kind": "base_reference",
                "step": 0,
                "length": setup.original_length,
                "perplexity": base,
                "seconds": round(time.perf_counter() - started, 2),
            }
        )
    log_evaluation(setup, model, log, 0)


def log_evaluation(setup: Setup, model, log: MetricsLog, step: int, bar=None) -> dict:
    """Evaluate at every length, log the record, and show it under the progress bar (if given)."""
    started = time.perf_counter()
    unwrapped = setup.runtime.accelerator.unwrap_model(model)
    scores = evaluate(setup, unwrapped, setup.eval_lengths)
    record = {"kind": "eval", "step": step, "perplexity": {str(k): v for k, v in scores.items()}}
    if setup.mixed_window:
        record.update(mixed_window_scores(setup, unwrapped))
    record["seconds"] = round(time.perf_counter() - started, 2)
    log.write(record)
    if bar is not None and setup.runtime.is_main:
        bar.write(f"step {step}: perplexity " + ", ".join(f"{k}: {v:.2f}" for k, v in record["perplexity"].items()))
    return record


def mixed_window_scores(setup: Setup, model) -> dict:
    """For a mixed-window run: which rotary scored each length, and the windows of at most L scored with the
    patched rotary too (what the model does when the switch is not used)."""
    from .mixed_window import rotary_used

    label, original = setup.recipe.method.label, setup.original_length
    short = [n for n in setup.eval_lengths if n <= original]
    patched = evaluate(setup, model, short, switch=False) if short else {}
    return {
        "rotary": {str(n): rotary_used(n, original, label) for n in setup.eval_lengths},
        "perplexity_patched_rotary": {str(k): v for k, v in patched.items()},
    }


def progress_bar(setup: Setup, start_step: int, progress: bool):
    from tqdm.auto import tqdm

    return tqdm(
        total=setup.recipe.train.max_steps,
        initial=start_step,
        desc="fine-tuning",
        unit="step",
        disable=not (progress and setup.runtime.is_main),
        mininterval=2,
    )


def set_learning_rate(optimizer, recipe: Recipe, step: int) -> float:
    """Set and return the learning rate of optimizer step `step` (0-based)."""
    optim = recipe.optim
    lr = optim.lr * lr_factor(
        step, optim.warmup_steps, optim.warmup_start_factor, optim.schedule, recipe.train.max_steps
    )
    for group in optimizer.param_groups:
        group["lr"] = lr
    return lr


def train_step(setup: Setup, model, optimizer, step: int) -> float:
    """One optimizer step over the global batch, in micro-steps; its loss, the mean of every process's mean.
    Under mixed_window, a short micro-batch (at most L tokens a sequence) runs with the original rotary."""
    from .mixed_window import rotary_switch

    recipe, runtime = setup.recipe, setup.runtime
    accelerator = runtime.accelerator
    step_loss = torch.zeros((), dtype=torch.float64, device=accelerator.device)
    unwrapped = accelerator.unwrap_model(model)
    for micro in range(runtime.accumulation):
        inputs = micro_batch(setup, step, micro)
        switched = rotary_switch(setup.mixed_window, unwrapped, setup.original_length)
        with accelerator.accumulate(model), switched:
            loss = model(**inputs, use_cache=False).loss
            accelerator.backward(loss)
            if accelerator.sync_gradients and recipe.optim.max_grad_norm > 0:
                accelerator.clip_grad_norm_(model.parameters(), recipe.optim.max_grad_norm)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        step_loss += loss.detach().double() / runtime.accumulation
        del loss, inputs  # free this micro-step's graph remnants before the next forward
    return float(accelerator.reduce(step_loss, reduction="mean"))


def micro_batch(setup: Setup, step: int, micro: int) -> dict[str, torch.Tensor]:
    """The model inputs of this process in one micro-step: its share of the step's samples, by index (under
    mixed_window, a short micro-batch has them cut into short sequences; ctxext.train.mixed_window)."""
    from .mixed_window import cut_into_short_sequences, is_short_micro_batch, micro_batch_index

    recipe, accelerator = setup.recipe, setup.runtime.accelerator
    indices = sample_indices(
        step,
        micro,
        accelerator.process_index,
        accelerator.num_processes,
        recipe.train.micro_batch_size,
        recipe.train.global_batch_size,
    )
    batch = setup.train_data.batch(indices)
    if setup.mixed_window and is_short_micro_batch(
        micro_batch_index(indices[0], recipe.train.micro_batch_size), recipe.mixed_window.short_fraction
    ):
        batch = cut_into_short_sequences(batch, setup.short_length)
    batch = batch.to(accelerator.device)
    inputs = {"input_ids": batch, "labels": batch}
    if recipe.pose.enabled:
        inputs["position_ids"] = pose_positions(recipe, indices).to(accelerator.device)
        # Without a mask, transformers reads a jump in position_ids as the start of another packed
        # sequence and blocks attention across it; PoSE chunks are one text and must see each other.
        inputs["attention_mask"] = torch.ones_like(batch)
    return inputs


def finish(setup: Setup, model, optimizer, log: MetricsLog, state: RunState) -> list[dict]:
    """The last checkpoint, adapter/ and merged/, the plot; the trackers closed. Returns the metrics records."""
    save_checkpoint(setup, model, optimizer, state.step, state.tokens, state.seconds())
    save_results(setup, model)
    records = log.read() if setup.runtime.is_main else []
    if setup.runtime.is_main:
        plot_metrics(records, setup.output / "metrics.png", plot_title(setup))
    accelerator = setup.runtime.accelerator
    accelerator.wait_for_everyone()
    accelerator.end_training()
    return records


def pose_positions(recipe: Recipe, indices: list[int]) -> torch.Tensor:
    from .pose import pose_generator, pose_position_ids

    return torch.stack(
        [
            pose_position_ids(
                recipe.pose.train_window, recipe.seq_len, recipe.pose.num_chunks, pose_generator(recipe.seed, i)
            )
            for i in indices
        ]
    )


def plot_title(setup: Setup) -> str:
    recipe = setup.recipe
    return (
        f"{Path(setup.recipe.model).name}: {recipe.method.label}, LoRA r={recipe.lora.r}, "
        f"{setup.original_length} -> {recipe.seq_len}"
    )


def write_or_check_recipe(path: Path, recipe: Recipe, resume: bool) -> None:
    """A fresh run records its recipe; a resumed run must be the same recipe (max_steps may grow)."""
    from ..outputs import atomic_write_text

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
    import dataclasses

    from .recipe import SECTIONS

    return {**{name: dataclasses.asdict(cls()) for name, cls in SECTIONS.items()}, **saved}


def write_run_record(setup: Setup, model, resume: bool, start_step: int) -> None:
    """run.json: what ran where (sizes, data, evaluation, provenance); a resume appends to its `resumed` list."""
    from ..outputs import provenance, write_json
    from .lora import count_parameters

    runtime = setup.runtime
    n_trainable, n_total = count_parameters(runtime.accelerator.unwrap_model(model))
    if not runtime.is_main:
        return
    record = {
        "model": setup.recipe.model,
        "model_path": setup.model_path,
        "method": setup.recipe.method.to_dict(),
        "original_length": setup.original_length,
        "seq_len": setup.recipe.seq_len,
        "train_sequence_length": setup.recipe.train_sequence_length,
        "mixed_window": {"short_length": setup.short_length, "short_fraction": setup.recipe.mixed_window.short_fraction}
        if setup.mixed_window
        else None,
        "processes": runtime.accelerator.num_processes,
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


def finetune(
    recipe: Recipe, resume: bool = False, progress: bool = True, after_step=None, report_to=None
) -> tuple[Setup, list[dict]]:
    """Run a recipe end to end; returns the setup and the metrics records (on the main process).

    `after_step`: see `train`. `report_to`: trackers to log to as well, e.g. 'tensorboard' or
    ['wandb', 'mlflow'] (ctxext.train.trackers).
    """
    setup = prepare(recipe, resume, progress, report_to)
    records = train(setup, resume, progress, after_step)
    return setup, records
