"""Setting a fine-tuning run up: the accelerate runtime, the patched model with its LoRA adapters, the packed
training data, the held-out evaluation documents and the optimizer. `prepare` checks every input before the
output directory is touched.
"""

from __future__ import annotations

import math
from pathlib import Path

import accelerate
import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType, parse_flag_from_env, set_seed

from .. import compat
from ..errors import CtxextError
from ..loading import load_model, load_tokenizer
from ..outputs import check_overlap
from ..patching import is_dynamic
from ..runtime import (
    Processes,
    attention_implementation,
    cpu_processes,
    launched_deepspeed,
    launched_sharded,
    on_main_first,
    training_precision,
)
from .checkpoints import latest_checkpoint
from .data import PackedSequences, token_stream
from .evaluation import load_eval_documents
from .lora import add_lora
from .mixed_window import check_switchable, short_length_for
from .pretrain_tiny import resolve_model_name
from .recipe import Recipe
from .sequence_parallel import check_model, hand_attention_to_ulysses, parallelism_config
from .state import Runtime, Setup
from .trackers import TRACKERS_DIR, tracker_names


# ------------------------------------------------------------------------------------------- runtime
def make_runtime(recipe: Recipe, output: Path | None = None, trackers: tuple[str, ...] = ()) -> Runtime:
    """The accelerate processes, device, precision, attention and trackers of a run (ctxext.runtime chooses the
    first four; the trackers write under `output`)."""
    train = recipe.train
    processes = Processes(cpu=cpu_processes(train.device), always=True)
    sp = recipe.parallel.sp_size
    parallelism = parallelism_config(sp, processes.world_size)
    world = processes.world_size // sp  # data-parallel: the processes of one SP group share their samples
    device = processes.device_for(train.device)
    if train.global_batch_size % (train.micro_batch_size * world):
        raise CtxextError(
            f"train.global_batch_size ({train.global_batch_size}) must be a multiple of train.micro_batch_size "
            f"({train.micro_batch_size}) x {f'groups of {sp} processes' if sp > 1 else 'processes'} ({world})"
        )
    accumulation = train.global_batch_size // (train.micro_batch_size * world)
    precision = training_precision(train.precision, device, launched_sharded())
    if precision != "fp32" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise CtxextError(f"train.precision={precision}, but this GPU has no bf16; use train.precision=fp32")
    # cpu=True would make accelerate drop DeepSpeed (AcceleratorState takes it only `and not cpu`); under
    # DeepSpeed the processes are already joined over gloo (Processes), and DeepSpeed runs on its CPU accelerator.
    # FSDP keeps cpu=True: without it accelerate would make each CPU process a run of its own.
    accelerator = Accelerator(
        cpu=(cpu_processes(train.device) or device.type == "cpu") and not launched_deepspeed(),
        gradient_accumulation_steps=accumulation,
        mixed_precision="no" if precision == "fp32" else "bf16",
        log_with=list(trackers) or None,
        project_dir=str(output / TRACKERS_DIR) if trackers and output is not None else None,
        parallelism_config=parallelism,
    )
    check_sharding_engine(accelerator)
    weights_dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    attn = attention_implementation(train.attn_implementation, accelerator.device, precision != "fp32")
    return Runtime(accelerator, processes, precision, weights_dtype, attn, accumulation, tuple(trackers), sp)


def check_sharding_engine(accelerator) -> None:
    """The engine `accelerate launch` asked for (FSDP, DeepSpeed) must be the one that runs. accelerate (1.15) turns
    FSDP on only over GPUs and the like (AcceleratorState: MULTI_GPU, MULTI_XPU..., not MULTI_CPU), and drops
    DeepSpeed under --cpu: either would silently be plain data parallel."""
    for flag, engine in (
        ("ACCELERATE_USE_FSDP", DistributedType.FSDP),
        ("ACCELERATE_USE_DEEPSPEED", DistributedType.DEEPSPEED),
    ):
        if parse_flag_from_env(flag) and accelerator.distributed_type != engine:
            raise CtxextError(
                f"accelerate launch asked for {engine.value}, but accelerate {accelerate.__version__} set up "
                f"{accelerator.distributed_type.value} (no sharding) instead; it runs FSDP only on GPUs. Without GPUs use "
                "configs/accelerate/cpu-2proc.yaml (DDP), deepspeed-zero2-cpu.yaml or deepspeed-zero3-cpu.yaml"
            )


# ------------------------------------------------------------------------------------------ setting up
def prepare(recipe: Recipe, resume: bool, progress: bool = True, report_to=None) -> Setup:
    """Load and check everything; raises CtxextError for bad input before the output directory is touched.

    `report_to`: the trackers, as for `ctxext finetune --report-to` ('tensorboard,wandb', a list, or None).
    """
    trackers = tracker_names(report_to)
    output = check_run_directory(recipe, resume)
    runtime = make_runtime(recipe, output, trackers)
    set_seed(recipe.seed)  # the same LoRA init on every process and every run
    model_path, tokenizer, model, method_length = load_patched_model(recipe, runtime, progress)
    short_length = mixed_window_length(recipe, model, method_length)
    model = with_lora(model, recipe)
    train_data, info = load_training_data(recipe, runtime, tokenizer, progress)
    documents, lengths, bos = load_eval_documents(recipe, tokenizer, method_length, info.get("names", []))
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
        method_length=method_length,
        output=output,
        model_path=model_path,
        short_length=short_length,
    )


def check_run_directory(recipe: Recipe, resume: bool) -> Path:
    """The run's output directory: new (or empty), or, under --resume, one holding a checkpoint."""
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
    """(model path, tokenizer, model patched with the recipe's method, the L the method counts from)."""
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
    planned = recipe.method.plan(model)  # the one place the L the method counts from is decided
    recipe.method.apply(model, planned)
    check_model(model, recipe.parallel.sp_size, compat.attention_implementation(model.config))
    method_length = planned.method_length
    limit = supported_length(model)
    if limit is not None and recipe.seq_len > limit:
        raise CtxextError(
            f"seq_len {recipe.seq_len} is beyond what the model patched with {recipe.method.label} supports "
            f"({limit} = {method_length} x {recipe.method.factor:g}); raise method.factor to at least "
            f"{math.ceil(recipe.seq_len / method_length)} or lower seq_len"
        )
    return model_path, tokenizer, model, method_length


def supported_length(model) -> int | None:
    """The longest sequence the patched model is meant for, or None for dynamic methods (no limit)."""
    if is_dynamic(model):
        return None
    return int(model.config.max_position_embeddings)


def mixed_window_length(recipe: Recipe, model, method_length: int) -> int | None:
    """The short sequences' length under mixed_window (checked against the patched model), else None."""
    if not recipe.mixed_window.enabled:
        return None
    check_switchable(model, recipe.method.label)
    short = short_length_for(recipe.mixed_window, method_length)
    if short % recipe.parallel.sp_size:
        raise CtxextError(
            f"parallel.sp_size={recipe.parallel.sp_size} must divide the mixed window's short sequences ({short} "
            "tokens; mixed_window.short_length): each process takes an equal slice"
        )
    return short


def with_lora(model, recipe: Recipe):
    """The model ready to train: gradient checkpointing as asked, no KV cache, LoRA adapters (PEFT)."""
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


# ------------------------------------------------------------------------------------------ the optimizer
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
        # DeepSpeed clips inside its step (accelerator.clip_grad_norm_ only reads the norm): the recipe's value
        deepspeed.deepspeed_config["gradient_clipping"] = recipe.optim.max_grad_norm
    if runtime.sp_size > 1:
        hand_attention_to_ulysses(accelerator, setup.model)
    return accelerator.prepare(setup.model, optimizer)
