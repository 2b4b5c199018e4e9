"""`ctxext patch`: apply a method to a checkpoint and save the patched checkpoint."""

from __future__ import annotations

from .common import add_method_arguments

HELP = "apply a method to a checkpoint and save the patched checkpoint"
DESCRIPTION = ("Load MODEL, apply a scaling method, and write a complete checkpoint (weights, config, tokenizer, "
               "ctxext.yaml) to --output, atomically. The source is never modified. Method parameters are flags "
               "named like the YAML keys, e.g. --beta-fast 32, --beta 0.625.")


def add_arguments(parser) -> None:
    parser.add_argument("model", help="a local checkpoint directory or a hub id")
    parser.add_argument("-o", "--output", required=True, help="directory to write the patched checkpoint to")
    parser.add_argument("--overwrite", action="store_true", help="replace --output if it already exists")
    parser.add_argument("--format", choices=("native", "ctxext"), default="native",
                        help="native (default): write the method as transformers' own rope type wherever an exact "
                             "form exists (ntk/theta as a base change, per-pair methods as 'longrope'), so that "
                             "vLLM, SGLang and plain transformers load it; ctxext: ctxext's own types "
                             "(loading needs `import ctxext`)")
    add_method_arguments(parser)


def run(args) -> int:
    from ..checkpoint import write_patched_checkpoint
    from .common import method_config_from_args

    method_config = method_config_from_args(args)
    written = write_patched_checkpoint(args.model, method_config, args.output, args.overwrite, format=args.format)
    print(f"patched {args.model} with {written.label}")
    print(f"  written as: {written.form.how}")
    print(f"  rope_parameters: {_short(written.rope_parameters)}")
    print(f"  max_position_embeddings: {written.max_position_embeddings_before} -> {written.max_position_embeddings}")
    if written.applied["attention"]:  # log-n / ReRoPE live in patched attention layers, re-installed by `import ctxext`
        print(f"  attention: {written.applied['attention']}")
    print(f"  loads in plain transformers: {written.loads_in_plain_transformers}")
    print(f"  saved to {written.output}")
    return 0


def _short(rope_parameters: dict) -> dict:
    """The parameters with per-pair lists summarised (a 64-pair list is not worth a screenful)."""
    return {k: (f"[{len(v)} per-pair values, {min(v):.4g}..{max(v):.4g}]" if isinstance(v, list) else v)
            for k, v in rope_parameters.items()}
