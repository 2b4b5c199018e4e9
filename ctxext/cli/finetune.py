"""`ctxext finetune --recipe RECIPE.yaml [key=value ...]`: LoRA fine-tuning at a longer context."""

from __future__ import annotations

from ..config import parse_value
from ..errors import CtxextError
from ..train.recipe import describe_keys, load_recipe, parse_overrides
from .aliases import add_alias
from .common import HelpFormatter

HELP = "LoRA fine-tuning at a longer context (PI / YaRN / any method), resumable"
DESCRIPTION = """\
Fine-tune a model at a longer context with LoRA (PEFT), after patching it with a ctxext method. The default
recipe is Position Interpolation's: AdamW (0.9, 0.95), weight decay 0, lr 2e-5, 20 warm-up steps from 10%,
1000 steps; LoRA on q,k,v,o with embeddings and norms trained too (LongLoRA). Any method works: fine-tuning
with yarn is the YaRN recipe.

Every eval.every steps the held-out perplexity at the target and the original length goes to
OUTPUT/metrics.jsonl and OUTPUT/metrics.png. Checkpoints every train.checkpoint_every steps; --resume
continues the last one and reproduces the same curve. An existing output directory is never overwritten.
Results: OUTPUT/adapter (a standard PEFT adapter) and OUTPUT/merged (a full checkpoint with the rope config).

Several GPUs (configs/accelerate/: ddp, fsdp, deepspeed-zero2, deepspeed-zero3), or 2 CPU processes to try it:
  accelerate launch --config_file configs/accelerate/fsdp.yaml -m ctxext finetune --recipe RECIPE.yaml
  accelerate launch --config_file configs/accelerate/cpu-2proc.yaml -m ctxext finetune --recipe RECIPE.yaml
The global batch stays train.global_batch_size: gradient accumulation = global / (micro x processes).
Sequences longer than one GPU holds: parallel.sp_size=N splits each over N processes (DeepSpeed Ulysses, under
a DeepSpeed config); --plan says what fits (configs/recipes/llama3-8b-yarn-64k-sp4.yaml: Llama-3-8B at 64k).

Mixed-window fine-tuning (LongRoPE2, --mixed-window, recipe section mixed_window): a fraction of the
micro-batches (--short-fraction, spread evenly by index) holds the same packed tokens cut into sequences of at
most the original length L (--short-length, default L); those train with the model's original rotary, the
others at seq_len with the patched rotary, to keep short-context quality. The model is meant to run the
same way: the original rotary within L, the patched one past it (adapter/ctxext.yaml says how to load it so).
"""

EPILOG = """\
examples:
  ctxext finetune --recipe configs/recipes/tiny-cpu.yaml output_dir=outputs/tiny train.max_steps=50
  ctxext finetune --recipe configs/recipes/pi-llama-7b-8k.yaml method.method=yarn lora.r=16
  ctxext finetune --recipe configs/recipes/tiny-cpu.yaml output_dir=outputs/tiny --resume
  ctxext finetune --recipe configs/recipes/tiny-cpu.yaml output_dir=outputs/tiny --report-to tensorboard
  ctxext finetune --show-keys
  ctxext finetune --recipe configs/recipes/pi-llama-7b-8k.yaml --plan seq_len=65536 parallel.sp_size=4 --zero 3
  ctxext finetune --recipe configs/recipes/tiny-cpu.yaml output_dir=outputs/tiny-mixed --mixed-window --short-fraction 0.5
"""


FORMATTER_CLASS = HelpFormatter  # wraps prose, keeps the examples one a line


def add_arguments(parser) -> None:
    parser.add_argument("--recipe", metavar="RECIPE.yaml", help="the recipe (configs/recipes/*.yaml)")
    parser.add_argument(
        "-o", "--output", metavar="DIR", help="the run's directory (the same as output_dir=DIR; default: the recipe's)"
    )
    parser.add_argument(
        "overrides",
        nargs="*",
        metavar="key=value",
        help="recipe overrides with dotted keys, e.g. lora.r=16 train.max_steps=10 method.factor=8",
    )
    parser.add_argument("--resume", action="store_true", help="continue the run in output_dir from its last checkpoint")
    parser.add_argument("--show-keys", action="store_true", help="list every recipe key with its default, and exit")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    parser.add_argument(
        "--mixed-window",
        action="store_true",
        help="mixed-window fine-tuning (LongRoPE2): short micro-batches (sequences of at most the original length "
        "L) train with the original rotary, long ones (seq_len) with the patched rotary, to keep short-context "
        "quality; the same as mixed_window.enabled=true",
    )
    parser.add_argument(
        "--short-fraction",
        metavar="F",
        help="with --mixed-window: the fraction of micro-batches that are short, in [0, 1] (default 0.5); "
        "the same as mixed_window.short_fraction=F",
    )
    parser.add_argument(
        "--short-length",
        metavar="N",
        help="with --mixed-window: tokens per short sequence, at most L (default L); "
        "the same as mixed_window.short_length=N",
    )
    parser.add_argument(
        "--report-to",
        metavar="TRACKERS",
        default="none",
        help="also log the metrics to experiment trackers, comma-separated: tensorboard (event files in "
        "OUTPUT/trackers/), wandb, mlflow; default none (metrics.jsonl is always written)",
    )
    add_plan_arguments(parser)
    add_alias(parser, "--config", "--recipe")


def add_plan_arguments(parser) -> None:
    """--plan and the settings only it reads: --tp, --zero, --json."""
    parser.add_argument(
        "--plan",
        action="store_true",
        help="print the estimated per-device memory of the recipe (weights, adapters, gradients, optimizer, "
        "activations, attention, logits) and which sp x tp settings fit an 80 GB and a 141 GB GPU, and exit "
        "without training; reads only the model's config.json (docs/guides/memory-plan.md)",
    )
    parser.add_argument(
        "--tp",
        metavar="N",
        default="1",
        help="with --plan: the tensor-parallel degree (weights split N ways); default 1",
    )
    parser.add_argument(
        "--zero", metavar="STAGE", default="0", help="with --plan: the DeepSpeed ZeRO stage, 0, 2 or 3; default 0"
    )
    parser.add_argument(
        "--json",
        metavar="FILE",
        nargs="?",
        const="-",
        help="with --plan: the plan as JSON, to FILE or, without one, to stdout instead of the table",
    )


def run(args) -> int:
    if args.show_keys:
        print(describe_keys())
        return 0
    if args.recipe is None and not args.overrides:
        raise CtxextError("give a recipe with --recipe RECIPE.yaml (see configs/recipes/), or key=value settings")
    if args.plan:
        return run_plan(args)
    if args.json is not None or args.tp != "1" or args.zero != "0":
        raise CtxextError("--tp, --zero and --json go with --plan")
    output = {"output_dir": args.output} if args.output is not None else {}
    recipe = load_recipe(args.recipe, {**parse_overrides(args.overrides), **mixed_window_overrides(args), **output})
    from ..train.loop import finetune

    setup, records = finetune(recipe, resume=args.resume, progress=not args.no_progress, report_to=args.report_to)
    if setup.runtime.is_main:
        print(summary(setup, records))
    return 0


# The plan reads the model's shape and the training settings; the run's output and data are not needed.
PLAN_PLACEHOLDERS = {"output_dir": "unused-by-plan", "data.dataset": "unused", "data.text_files": [], "eval.every": 0}


def run_plan(args) -> int:
    """--plan: the memory estimate of the recipe (ctxext.train.memory_plan), printed or as JSON; no training."""
    import json

    from ..train.memory_plan import memory_plan, read_model_shape, render_plan, settings_from_recipe
    from ..validate import whole_number

    overrides = {**parse_overrides(args.overrides), **mixed_window_overrides(args), **PLAN_PLACEHOLDERS}
    recipe = load_recipe(args.recipe, overrides)
    tp = whole_number("--tp", parse_value(args.tp))
    zero = whole_number("--zero", parse_value(args.zero), minimum=0)
    plan = memory_plan(read_model_shape(recipe.model), settings_from_recipe(recipe, tp, zero), recipe.model)
    if args.json is None:
        print(render_plan(plan))
    elif args.json == "-":
        print(json.dumps(plan, indent=2))
    else:
        from ..outputs import write_json

        write_json(args.json, plan)
        print(render_plan(plan))
    return 0


def mixed_window_overrides(args) -> dict:
    """--mixed-window, --short-fraction and --short-length as recipe overrides (validated with the recipe)."""
    overrides = {"mixed_window.enabled": True} if args.mixed_window else {}
    if args.short_fraction is not None:
        overrides["mixed_window.short_fraction"] = parse_value(args.short_fraction)
    if args.short_length is not None:
        overrides["mixed_window.short_length"] = parse_value(args.short_length)
    return overrides


def summary(setup, records: list[dict]) -> str:
    evals = [r for r in records if r.get("kind") == "eval"]
    lines = [f"fine-tuned {setup.recipe.model} with {setup.recipe.method.label} at {setup.recipe.seq_len} tokens"]
    if setup.mixed_window:
        lines[0] += (
            f", mixed-window: {setup.recipe.mixed_window.short_fraction:g} of the micro-batches at "
            f"{setup.short_length} tokens with the original rotary (scored so at lengths <= {setup.method_length})"
        )
    base = [r for r in records if r.get("kind") == "base_reference"]
    if base:
        lines.append(f"  base model at {base[0]['length']}: perplexity {base[0]['perplexity']:.2f}")
    if evals:
        lengths = list(evals[0]["perplexity"])
        lines.append("  step  " + "".join(f"{'ppl@' + n:>12}" for n in lengths))
        for r in evals:
            lines.append(f"  {r['step']:>4}  " + "".join(f"{r['perplexity'][n]:>12.2f}" for n in lengths))
    lines.append(f"  wrote {setup.output}/ (metrics.jsonl, metrics.png, adapter/, merged/, checkpoints/)")
    if setup.runtime.trackers:
        lines.append(f"  logged to {', '.join(setup.runtime.trackers)} as well")
    if "tensorboard" in setup.runtime.trackers:
        lines.append(f"  view: tensorboard --logdir {setup.output / 'trackers'}")
    return "\n".join(lines)
