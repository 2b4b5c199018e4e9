"""`ctxext patch`: apply a method to a checkpoint (or a GGUF file) and save the patched copy."""

from __future__ import annotations

from ..errors import CtxextError
from .common import HelpFormatter, add_method_arguments, add_pair_selection_arguments, method_config_from_args

HELP = "apply a method to a checkpoint and save the patched checkpoint"
DESCRIPTION = (
    "Load MODEL, apply a scaling method, and write a complete checkpoint (weights, config, tokenizer, "
    "ctxext.yaml) to --output, atomically; a MODEL without tokenizer files (a training checkpoint) is written "
    "without them. The source is never modified. Method parameters are flags "
    "named like the YAML keys, e.g. --beta-fast 32, --beta 0.625. config.json gets the method's exact "
    "native rope type wherever one exists, so vLLM, SGLang and plain transformers load it. "
    "A .gguf MODEL (llama.cpp, Ollama, LM Studio) is written as a .gguf file with the rope keys "
    "llama.cpp reads."
)
FORMATTER_CLASS = HelpFormatter  # wraps prose, keeps the examples one a line
EPILOG = (
    "examples:\n"
    "  ctxext patch ./llama-4k --method yarn --factor 4 -o ./llama-16k\n"
    "  ctxext patch model.gguf --method yarn --factor 4 -o model-32k.gguf\n"
    "  ctxext patch model.gguf --method ntk_by_parts --factor 2 --outtype f16 -o model-16k.gguf"
)


def add_arguments(parser) -> None:
    parser.add_argument("model", help="a local checkpoint directory, a hub id, or a .gguf file")
    parser.add_argument(
        "-o",
        "--output",
        required=True,
        help="directory to write the patched checkpoint to (a .gguf file for a GGUF input)",
    )
    parser.add_argument("--overwrite", action="store_true", help="replace --output if it already exists")
    parser.add_argument(
        "--format",
        choices=("native", "ctxext"),
        default="native",
        help="native (default): write the method as transformers' own rope type wherever an exact "
        "form exists (ntk/theta as a base change, per-pair methods as 'longrope'), so that "
        "vLLM, SGLang and plain transformers load it; ctxext: ctxext's own types "
        "(loading needs `import ctxext`)",
    )
    parser.add_argument(
        "--outtype",
        choices=("same", "f16", "f32"),
        default="same",
        help="GGUF input only: keep every tensor's type (same, default), or write f16 / f32 "
        "(dequantised; 1-D tensors stay f32)",
    )
    add_pair_selection_arguments(parser)
    add_method_arguments(parser)


def run(args) -> int:
    from ..patching.pair_selection import check_pair_selection
    from ..serving.gguf import is_gguf

    method_config = method_config_from_args(args)
    pair_selection = check_pair_selection(args.select_pairs, args.top_pairs, method_config.method, method_config.params)
    if is_gguf(args.model):
        if args.format != "native":
            raise CtxextError("--format applies to checkpoint directories; a GGUF file gets llama.cpp's rope keys")
        return _patch_gguf(args, method_config)
    if args.outtype != "same":
        raise CtxextError(
            f"--outtype applies to GGUF files; '{args.model}' is not one (write a checkpoint "
            f"directory in another dtype by loading and saving it with transformers)"
        )

    from ..checkpoint import write_patched_checkpoint
    from ..loading import load_config
    from ..patching.cards import card_length_note

    written = write_patched_checkpoint(
        args.model, method_config, args.output, args.overwrite, format=args.format, pair_selection=pair_selection
    )
    print(f"patched {args.model} with {written.label}")
    print(f"  model: {written.model}")
    card = card_length_note(load_config(args.model), method_config.original_max_position_embeddings)
    if card:
        print(f"  note: {card}")
    print(f"  context: {written.context}")
    print(f"  written as: {written.form.how}")
    print(f"  rope_parameters: {_short(written.rope_parameters)}")
    print(f"  max_position_embeddings: {written.max_position_embeddings_before} -> {written.max_position_embeddings}")
    if written.applied["attention"]:  # log-n / ReRoPE live in patched attention layers, re-installed by `import ctxext`
        print(f"  attention: {_short(written.applied['attention'])}")
    print(f"  loads in plain transformers: {written.loads_in_plain_transformers}")
    if not written.tokenizer:
        print(f"  tokenizer: none in {args.model} (no tokenizer files), none written")
    print(f"  saved to {written.output}")
    _print_serving(written)
    return 0


def _print_serving(written) -> None:
    """How to start vLLM, SGLang and llama.cpp on the written checkpoint for its max_position_embeddings
    (ctxext.serving.lengths: only the flags each engine needs)."""
    from ..serving.engines import declared_max_position_embeddings, engine_table, read_served_model, served_length
    from ..serving.lengths import serve_lines

    model = read_served_model(written.output)
    target = declared_max_position_embeddings(model)
    reason = (
        "its rope type needs `import ctxext`"
        if not written.form.native
        else "its attention runs with ctxext only"
        if written.applied["attention"]
        else "max_position_embeddings stays L"
        if served_length(model) != target
        else None
    )
    if not written.form.native or written.applied["attention"]:  # no other engine serves it
        print(f"  serve: ctxext serve {written.output}  ({reason}; other engines: `ctxext export` says which)")
        return
    if reason:
        print(f"  serve: `ctxext export {written.output}` prints how ({reason})")
        return
    print(f"  serve {target} tokens:")
    llama_cpp = next(row for row in engine_table(model) if row.engine == "llama.cpp")
    for line in serve_lines(model.config, target, written.output):  # llama.cpp's only where a GGUF can carry it
        no = line.startswith("  llama.cpp:") and llama_cpp.level == "no"
        print(f"  llama.cpp: no exact GGUF ({llama_cpp.how})" if no else line)


def _patch_gguf(args, method_config) -> int:
    from ..serving.gguf import patch_gguf

    written = patch_gguf(args.model, method_config, args.output, args.overwrite, args.outtype)
    print(f"patched {args.model} with {written.label}")
    print(f"  written as: {written.rope.how}")
    for key, value in written.rope.keys.items():
        print(f"  {key}: {value}")
    if written.rope.rope_freqs is not None:
        print(f"  rope_freqs.weight: {_short({'': written.rope.rope_freqs})['']}")
    print(f"  context_length: {written.context_length_before} -> {written.context_length}")
    print(f"  tensors: {written.outtype}")
    print(f"  saved to {written.output}")
    return 0


def _short(values: dict) -> dict:
    """The values with long lists summarised (64 per-pair factors, or a list of pairs per layer)."""

    def short(v):
        if not isinstance(v, list) or len(v) <= 8:
            return v
        if all(isinstance(x, (int, float)) for x in v):
            return f"[{len(v)} per-pair values, {min(v):.4g}..{max(v):.4g}]"
        return f"[{len(v)} lists]"

    return {k: short(v) for k, v in values.items()}
