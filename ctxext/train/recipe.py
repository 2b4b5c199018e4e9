"""Fine-tuning recipes: a YAML file -> a validated `Recipe` dataclass, with `key=value` overrides.

A recipe (see configs/recipes/*.yaml) has a few top-level keys and one mapping per section:

    model: huggyllama/llama-7b
    method: {method: linear, factor: 4}      # any ctxext method, as in configs/methods/*.yaml
    seq_len: 8192
    output_dir: outputs/pi-llama-7b-8k
    lora:  {r: 8, alpha: 16, ...}
    optim: {lr: 2.0e-5, ...}
    train: {max_steps: 1000, global_batch_size: 64, ...}
    data:  {dataset: monology/pile-uncopyrighted, ...}
    eval:  {dataset: pg19, every: 200, ...}
    pose:  {enabled: false, ...}
    mixed_window: {enabled: false, ...}
    parallel: {sp_size: 1}                   # sequence parallelism (DeepSpeed Ulysses)

Every key has a default (the Position Interpolation recipe), so a recipe only states what differs.
Overrides use dotted keys: `lora.r=16 train.max_steps=10 method.factor=8 seq_len=4096`.
Unknown keys are errors with a "did you mean".
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from ..config import MethodConfig, parse_value, read_yaml_mapping
from ..errors import CtxextError, did_you_mean
from ..validate import boolean, choice, number, string_list, whole_number

PRECISIONS = ("auto", "fp32", "bf16-mixed", "bf16")  # what ctxext.runtime.training_precision understands
ATTENTION_IMPLEMENTATIONS = ("auto", "sdpa", "eager", "flash_attention_2", "flash_attention_3")


def option(default, help: str):
    """A dataclass field with its help text (shown by `ctxext finetune --show-keys`)."""
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata={"help": help})
    return field(default=default, metadata={"help": help})


@dataclass
class LoraSection:
    r: int = option(8, "LoRA rank")
    alpha: float = option(16, "LoRA alpha (the update is scaled by alpha / r)")
    dropout: float = option(0.05, "dropout on the LoRA input")
    target_modules: list = option(["q_proj", "k_proj", "v_proj", "o_proj"], "module names that get LoRA adapters")
    train_embeddings_and_norms: bool = option(
        True, "also train the input embeddings and every norm, in full (LongLoRA found this necessary)"
    )


@dataclass
class OptimSection:
    lr: float = option(2e-5, "peak learning rate (PI: 2e-5 for 7B/13B)")
    betas: list = option([0.9, 0.95], "AdamW betas")
    weight_decay: float = option(0.0, "AdamW weight decay")
    warmup_steps: int = option(20, "linear warm-up steps")
    warmup_start_factor: float = option(0.1, "the warm-up starts at this fraction of lr (PI: 10%)")
    schedule: str = option("constant", "after warm-up: constant (PI) or cosine (to 10% of lr at max_steps)")
    max_grad_norm: float = option(1.0, "clip the gradient norm to this (0: no clipping)")


@dataclass
class TrainSection:
    max_steps: int = option(1000, "optimizer steps")
    global_batch_size: int = option(64, "sequences per optimizer step, over all processes")
    micro_batch_size: int = option(1, "sequences per forward pass; gradient accumulation makes up the rest")
    precision: str = option(
        "auto",
        "auto, fp32, bf16-mixed (fp32 weights, bf16 autocast), "
        "bf16 (frozen weights in bf16, trainable in fp32, bf16 autocast)",
    )
    gradient_checkpointing: bool = option(True, "recompute activations in backward to save memory")
    attn_implementation: str = option("auto", "auto (flash_attention_2 on GPU if installed, else sdpa), sdpa, eager")
    checkpoint_every: int = option(200, "save a resumable checkpoint every N steps (0: only at the end)")
    log_every: int = option(10, "log the training loss every N steps")
    save_merged: bool = option(True, "also save a merged checkpoint (LoRA folded in, rope config included)")
    device: str = option("auto", "auto, cpu, cuda, mps (under accelerate launch: the process's device)")


@dataclass
class DataSection:
    dataset: str | None = option(
        None,
        "training data: a HF dataset id (pile, RedPajama, PG19 style), a local "
        "json/jsonl/parquet/csv file or save_to_disk folder, or 'shakespeare'",
    )
    text_files: list = option([], "or local text files/folders (*.txt) for offline use")
    split: str = option("train", "dataset split")
    config: str | None = option(None, "dataset configuration (subset) name")
    text_field: str = option("text", "the column holding the text")
    streaming: bool = option(True, "stream a hub dataset instead of downloading all of it")
    exclude: list = option([], "document names to leave out (for shakespeare: text stems)")
    max_tokens: int | None = option(None, "tokenise at most this many tokens (default: what max_steps needs)")


@dataclass
class EvalSection:
    every: int = option(200, "evaluate every N steps (and at step 0); 0: never")
    dataset: str | None = option(
        "pg19",
        "held-out data, as for `ctxext eval --dataset` (pg19, proof-pile, "
        "shakespeare:othello_gut,..., a hub id or a local file)",
    )
    text_files: list = option([], "or local text files/folders")
    split: str | None = option(None, "dataset split (default: the preset's, else test)")
    config: str | None = option(None, "dataset configuration name")
    text_field: str | None = option(None, "the column holding the text")
    max_docs: int | None = option(5, "evaluate on at most N documents")
    max_tokens_per_doc: int | None = option(None, "cut every document to its first N tokens (faster evaluation)")
    lengths: list | None = option(None, "window lengths (default: [seq_len, the original length])")
    stride: int = option(256, "sliding-window stride (docs/METHODS.md protocol; PI used 256)")
    base_reference: bool = option(
        True, "also score the unpatched model at the original length once (the reference line of the plot)"
    )


@dataclass
class PoseSection:
    enabled: bool = option(False, "PoSE: train positions up to seq_len inside short windows (cheap on small GPUs)")
    train_window: int = option(2048, "tokens per training sequence when PoSE is on")
    num_chunks: int = option(2, "chunks per window; each gets its own skip of positions")


@dataclass
class MixedWindowSection:
    enabled: bool = option(
        False,
        "mixed-window fine-tuning (LongRoPE2): a fraction of the micro-batches is cut into short sequences (at most "
        "the original length L) that train with the model's original rotary; the rest train at seq_len with the "
        "patched rotary, to keep short-context quality",
    )
    short_fraction: float = option(
        0.5, "the fraction of micro-batches that are short, in [0, 1], spread evenly over the run (by index)"
    )
    short_length: int | None = option(
        None,
        "tokens per short sequence (default: the original length L; at most L); a short micro-batch holds "
        "the same tokens as a long one, cut into seq_len // short_length times as many sequences",
    )


@dataclass
class ParallelSection:
    sp_size: int = option(
        1,
        "sequence parallelism (DeepSpeed ALST/Ulysses through accelerate): each sequence is split over this many "
        "processes, which exchange attention heads so that every one attends over the whole sequence; 1 is off. "
        "Needs `accelerate launch` with a DeepSpeed config and as many processes as a multiple of sp_size",
    )


SECTIONS = {
    "lora": LoraSection,
    "optim": OptimSection,
    "train": TrainSection,
    "data": DataSection,
    "eval": EvalSection,
    "pose": PoseSection,
    "mixed_window": MixedWindowSection,
    "parallel": ParallelSection,
}
TOP_LEVEL_HELP = {
    "model": "the model to fine-tune: a local checkpoint, a hub id, or ctxext:tiny-shakespeare",
    "method": "the scaling method: a mapping as in configs/methods/*.yaml (method, factor, parameters)",
    "seq_len": "the training and target context length",
    "output_dir": "where the run writes (checkpoints, metrics.jsonl, adapter/, merged/); never overwritten",
    "seed": "seed of the data order, LoRA init and dropout",
}


@dataclass
class Recipe:
    model: str = ""
    method: MethodConfig = field(default_factory=lambda: MethodConfig("linear", 4.0))
    seq_len: int = 8192
    output_dir: str = ""
    seed: int = 0
    lora: LoraSection = field(default_factory=LoraSection)
    optim: OptimSection = field(default_factory=OptimSection)
    train: TrainSection = field(default_factory=TrainSection)
    data: DataSection = field(default_factory=DataSection)
    eval: EvalSection = field(default_factory=EvalSection)
    pose: PoseSection = field(default_factory=PoseSection)
    mixed_window: MixedWindowSection = field(default_factory=MixedWindowSection)
    parallel: ParallelSection = field(default_factory=ParallelSection)

    def to_dict(self) -> dict[str, Any]:
        out = {
            "model": self.model,
            "method": self.method.to_dict(),
            "seq_len": self.seq_len,
            "output_dir": self.output_dir,
            "seed": self.seed,
        }
        for name in SECTIONS:
            out[name] = dataclasses.asdict(getattr(self, name))
        return out

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    @property
    def train_sequence_length(self) -> int:
        """Tokens per training sequence: seq_len, or the PoSE window."""
        return self.pose.train_window if self.pose.enabled else self.seq_len


# ------------------------------------------------------------------------------------------ overrides
def parse_overrides(items: list[str]) -> dict[str, Any]:
    """['lora.r=16', 'seq_len=4096'] -> {'lora.r': 16, 'seq_len': 4096} (values as YAML/numbers)."""
    overrides = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise CtxextError(f"override '{item}' must look like key=value, e.g. train.max_steps=10")
        overrides[key.strip()] = parse_value(value.strip())
    return overrides


def apply_overrides(mapping: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """Set dotted keys in a nested mapping (a copy); validation happens later, in `recipe_from_mapping`."""
    result = {k: (dict(v) if isinstance(v, dict) else v) for k, v in mapping.items()}
    for dotted, value in overrides.items():
        parts = dotted.split(".")
        if len(parts) > 2:
            raise CtxextError(f"override key '{dotted}' has too many parts; use section.key, e.g. lora.r")
        if len(parts) == 1:
            result[parts[0]] = value
            continue
        section, key = parts
        inner = result.get(section)
        if inner is None:
            inner = {}
        if not isinstance(inner, dict):
            raise CtxextError(f"override '{dotted}': '{section}' is not a section")
        inner = dict(inner)
        inner[key] = value
        result[section] = inner
    return result


# ------------------------------------------------------------------------------------------ validation
def _check_keys(given: dict, allowed: list[str], where: str) -> None:
    for key in given:
        if key not in allowed:
            raise CtxextError(
                f"unknown key '{key}' in {where}{did_you_mean(key, allowed)}; the keys are: {', '.join(allowed)}"
            )


def _section(cls, given, name: str):
    if given is None:
        given = {}
    if not isinstance(given, dict):
        raise CtxextError(f"'{name}' must be a mapping of keys to values, got {given!r}")
    _check_keys(given, [f.name for f in dataclasses.fields(cls)], f"section '{name}'")
    return cls(**given)


def validate(recipe: Recipe) -> Recipe:
    """Raise a one-line CtxextError for anything wrong that can be seen without loading a model."""
    if not isinstance(recipe.model, str) or not recipe.model:
        raise CtxextError("the recipe has no 'model' (a checkpoint directory, hub id or ctxext:tiny-shakespeare)")
    if not isinstance(recipe.output_dir, str) or not recipe.output_dir:
        raise CtxextError("the recipe has no 'output_dir'; set it in the recipe or with output_dir=PATH")
    recipe.seq_len = whole_number("seq_len", recipe.seq_len)
    recipe.seed = whole_number("seed", recipe.seed, minimum=0)
    _validate_lora(recipe.lora)
    _validate_optim(recipe.optim)
    _validate_train(recipe.train)
    _validate_data(recipe.data)
    _validate_eval(recipe.eval)
    _validate_pose(recipe.pose, recipe.seq_len)
    _validate_mixed_window(recipe)
    _validate_parallel(recipe)
    return recipe


def _validate_lora(lora: LoraSection) -> None:
    lora.r = whole_number("lora.r", lora.r)
    number("lora.alpha", lora.alpha, minimum=0)
    number("lora.dropout", lora.dropout, minimum=0, maximum=1)
    lora.target_modules = string_list("lora.target_modules", lora.target_modules)
    if not lora.target_modules:
        raise CtxextError("'lora.target_modules' is empty; LoRA needs at least one module, e.g. q_proj")
    boolean("lora.train_embeddings_and_norms", lora.train_embeddings_and_norms)


def _validate_optim(optim: OptimSection) -> None:
    number("optim.lr", optim.lr, minimum=0)
    if (
        not isinstance(optim.betas, (list, tuple))
        or len(optim.betas) != 2
        or not all(isinstance(b, (int, float)) and 0 <= b < 1 for b in optim.betas)
    ):
        raise CtxextError(f"'optim.betas' must be two numbers in [0, 1), got {optim.betas!r}")
    number("optim.weight_decay", optim.weight_decay, minimum=0)
    optim.warmup_steps = whole_number("optim.warmup_steps", optim.warmup_steps, minimum=0)
    number("optim.warmup_start_factor", optim.warmup_start_factor, minimum=0, maximum=1)
    choice("optim.schedule", optim.schedule, ("constant", "cosine"))
    number("optim.max_grad_norm", optim.max_grad_norm, minimum=0)


def _validate_train(train: TrainSection) -> None:
    train.max_steps = whole_number("train.max_steps", train.max_steps)
    train.global_batch_size = whole_number("train.global_batch_size", train.global_batch_size)
    train.micro_batch_size = whole_number("train.micro_batch_size", train.micro_batch_size)
    choice("train.precision", train.precision, PRECISIONS)
    choice("train.attn_implementation", train.attn_implementation, ATTENTION_IMPLEMENTATIONS)
    train.checkpoint_every = whole_number("train.checkpoint_every", train.checkpoint_every, minimum=0)
    train.log_every = whole_number("train.log_every", train.log_every)


def _validate_data(data: DataSection) -> None:
    data.text_files = string_list("data.text_files", data.text_files)
    data.exclude = string_list("data.exclude", data.exclude)
    if bool(data.dataset) == bool(data.text_files):
        raise CtxextError("give the training data with data.dataset=NAME or data.text_files=[PATH, ...] (one of them)")
    data.max_tokens = whole_number("data.max_tokens", data.max_tokens, allow_none=True)


def _validate_eval(ev: EvalSection) -> None:
    ev.every = whole_number("eval.every", ev.every, minimum=0)
    ev.text_files = string_list("eval.text_files", ev.text_files)
    if ev.every and bool(ev.dataset) == bool(ev.text_files):
        raise CtxextError(
            "give the held-out data with eval.dataset=NAME or eval.text_files=[PATH] (one of them); "
            "eval.dataset=null with eval.text_files, or eval.every=0 for no evaluation"
        )
    ev.max_docs = whole_number("eval.max_docs", ev.max_docs, allow_none=True)
    ev.max_tokens_per_doc = whole_number("eval.max_tokens_per_doc", ev.max_tokens_per_doc, allow_none=True)
    if ev.lengths is not None:
        if not isinstance(ev.lengths, list) or not ev.lengths:
            raise CtxextError(f"'eval.lengths' must be a list of window lengths, got {ev.lengths!r}")
        ev.lengths = [whole_number("eval.lengths", value) for value in ev.lengths]
    ev.stride = whole_number("eval.stride", ev.stride)


def _validate_pose(pose: PoseSection, seq_len: int) -> None:
    if not pose.enabled:
        return
    pose.train_window = whole_number("pose.train_window", pose.train_window)
    pose.num_chunks = whole_number("pose.num_chunks", pose.num_chunks)
    if pose.train_window > seq_len:
        raise CtxextError(f"pose.train_window ({pose.train_window}) must not exceed seq_len ({seq_len})")
    if pose.num_chunks > pose.train_window:
        raise CtxextError("pose.num_chunks must not exceed pose.train_window")


def _validate_mixed_window(recipe: Recipe) -> None:
    """The settings alone; that short_length is at most L is checked once the model is loaded (setup.py)."""
    mixed = recipe.mixed_window
    boolean("mixed_window.enabled", mixed.enabled)
    number("mixed_window.short_fraction", mixed.short_fraction, minimum=0, maximum=1)
    mixed.short_length = whole_number("mixed_window.short_length", mixed.short_length, allow_none=True)
    if not mixed.enabled:
        return
    if recipe.method.method == "none":
        raise CtxextError(
            "mixed_window needs a scaling method: with method none the rotary is not patched, so there is nothing "
            "to switch between; set method (e.g. {method: linear, factor: 4}) or mixed_window.enabled=false"
        )
    if recipe.pose.enabled:
        raise CtxextError("mixed_window and pose cannot be combined; enable one of them")
    if mixed.short_length is not None and mixed.short_length > recipe.seq_len:
        raise CtxextError(
            f"mixed_window.short_length ({mixed.short_length}) must not exceed seq_len ({recipe.seq_len})"
        )


def _validate_parallel(recipe: Recipe) -> None:
    """The settings alone; the process count and the model's heads are checked at setup (sequence_parallel.py)."""
    sp = whole_number("parallel.sp_size", recipe.parallel.sp_size)
    recipe.parallel.sp_size = sp
    if sp > 1 and recipe.train_sequence_length % sp:
        raise CtxextError(
            f"parallel.sp_size={sp} must divide the training sequence length ({recipe.train_sequence_length} "
            "tokens): each process takes an equal slice"
        )


def recipe_from_mapping(mapping: dict[str, Any], source: str | None = None) -> Recipe:
    try:
        return _recipe_from_mapping(mapping)
    except CtxextError as error:
        raise CtxextError(f"{source}: {error}" if source else str(error)) from None
    except TypeError as error:  # a field given a value of the wrong shape
        raise CtxextError(f"{source + ': ' if source else ''}{error}") from None


def _recipe_from_mapping(mapping: dict[str, Any]) -> Recipe:
    allowed = list(TOP_LEVEL_HELP) + list(SECTIONS)
    _check_keys(mapping, allowed, "the recipe")
    method = mapping.get("method", {"method": "linear", "factor": 4.0})
    if isinstance(method, str):
        method = {"method": method}
    if not isinstance(method, dict):
        raise CtxextError(f"'method' must be a mapping like {{method: linear, factor: 4}}, got {method!r}")
    recipe = Recipe(
        model=mapping.get("model", ""),
        method=MethodConfig.from_mapping(method, source="'method'"),
        seq_len=mapping.get("seq_len", 8192),
        output_dir=mapping.get("output_dir", ""),
        seed=mapping.get("seed", 0),
        **{name: _section(cls, mapping.get(name), name) for name, cls in SECTIONS.items()},
    )
    if recipe.model is not None and not isinstance(recipe.model, str):
        recipe.model = str(recipe.model)
    if not isinstance(recipe.output_dir, str):
        recipe.output_dir = str(recipe.output_dir)
    return validate(recipe)


def load_recipe(path: str | Path | None, overrides: dict[str, Any] | None = None) -> Recipe:
    """Read a recipe YAML (optional: overrides alone can make a recipe), apply overrides, validate."""
    mapping = read_yaml_mapping(path) if path is not None else {}
    merged = apply_overrides(mapping, overrides or {})
    source = f"recipe '{path}'" if path is not None else "recipe"
    return recipe_from_mapping(merged, source=source)


def describe_keys() -> str:
    """Every recipe key with its default and help, for `ctxext finetune --show-keys`."""
    lines = []
    for key, help_text in TOP_LEVEL_HELP.items():
        lines.append(f"{key:<34} {help_text}")
    for name, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            lines.append(f"{name + '.' + f.name:<34} {f.metadata['help']} (default {default!r})")
    return "\n".join(lines)
