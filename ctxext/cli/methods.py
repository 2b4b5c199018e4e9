"""`ctxext methods`: the scaling methods and their parameters; with --model, which of them apply to that model."""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import CtxextError
from .common import HelpFormatter

HELP = "list the scaling methods and their parameters (--model: which apply to a model, and its rope layout)"
DESCRIPTION = (
    "List every scaling method with its parameters; -v adds each parameter's default and meaning, and "
    "each method's source. --model MODEL (a checkpoint directory or hub id; only its config is read, no weights) "
    "prints the model's rope layout as ctxext sees it (layer types, RoPE and NoPE layers, sliding windows, "
    "rotated channels, bases) and, for each method, whether it applies or the one line `ctxext patch` would "
    "refuse it with."
)
FORMATTER_CLASS = HelpFormatter  # wraps prose, keeps the examples one a line
EPILOG = (
    "examples:\n  ctxext methods -v\n  ctxext methods --model ./gemma-3-1b\n"
    "  ctxext methods --model ./gemma-3-1b --layer-types all --json layout.json\n"
    "  ctxext methods --model meta-llama/Llama-3.1-8B --target-length 256k"
)


def add_arguments(parser) -> None:
    parser.add_argument("-v", "--verbose", action="store_true", help="show every parameter with its default")
    parser.add_argument("--model", metavar="MODEL", help="say which methods apply to MODEL (its config only)")
    parser.add_argument(
        "--layer-types",
        metavar="TYPES",
        help="with --model: the layer types a frequency method would scale (full, the default; all; or names)",
    )
    parser.add_argument("--json", metavar="FILE", help="with --model: also write the layout and the verdicts")
    parser.add_argument(
        "--target-length",
        dest="target_length",
        metavar="N",
        help="with --model: also what N tokens cost it (e.g. 256k): the KV cache a sequence, the prefill FLOPs, "
        "the data that holds an N-token window (from config.json alone)",
    )


def run(args) -> int:
    if args.model is None:
        if args.layer_types or args.json or args.target_length:
            raise CtxextError("--layer-types, --json and --target-length describe a model: add --model MODEL")
        return _list_methods(args.verbose)
    code = _describe_model(args.model, args.layer_types, args.json)
    if args.target_length:
        _print_cost(args.model, args.target_length)
    return code


def _print_cost(model_name: str, target_length: str) -> None:
    from ..cost import context_cost, render_cost
    from ..eval.options import parse_length
    from ..loading import load_config

    tokens = parse_length(target_length, "--target-length")
    print("")
    print("\n".join(render_cost(model_name, context_cost(load_config(model_name), tokens))))


def _list_methods(verbose: bool) -> int:
    from ..methods import METHODS

    for method in METHODS.values():
        print(f"{method.name:<13} {method.summary}")
        if verbose:
            print(f"{'':13} source: {method.source}")
            for name, default, help_text in method.param_help():
                print(f"{'':15}--{name.replace('_', '-'):<18} (default {default!r}) {help_text}")
        else:
            print(f"{'':13} parameters: {', '.join(name for name, _, _ in method.param_help())}")
    print("\nAny method also takes --logn (YAML 'logn: true'): log-n query scaling, max(1, ln n / ln L).")
    if not verbose:
        print("Run 'ctxext methods -v' for each parameter's default and meaning, and each method's source.")
    return 0


def _multimodal_lines(model, layout) -> list[str]:
    """What a vision-language model's description adds: which part ctxext patches, and what MRoPE's lengths count."""
    from ..patching.families import SECTION_NAMES, language_model_of

    lines = []
    if language_model_of(model) is not None:
        lines.append(
            f"the language model of {model.config.model_type} is patched (its vision encoder keeps its own RoPE)"
        )
    if layout.sections is not None:
        pairs = ", ".join(f"{name} {layout.sections.count(i)}" for i, name in enumerate(SECTION_NAMES))
        lines.append(
            f"multimodal RoPE (rotary pairs per section: {pairs}): L0 and C count position ids, not tokens; over "
            "an image or video they advance more slowly than tokens (h x w merged patches: h*w tokens, max(h, w) "
            "positions), so a context of C position ids holds more than C tokens of images and video"
        )
    return lines


def _describe_model(model_name: str, layer_types, json_path) -> int:
    from ..loading import load_config
    from ..outputs import atomic_write_text
    from ..patching.applicable import applicable_methods, skeleton
    from ..patching.cards import card_length_note
    from ..patching.families import rope_layout, rotary_host
    from ..patching.patch import plan_patch
    from ..patching.record import model_rope_record

    model = skeleton(load_config(model_name))
    layout = rope_layout(model)
    layout.select_types(layer_types)  # a wrong --layer-types is refused before anything is printed
    record = model_rope_record(model)
    verdicts = applicable_methods(model, layer_types=layer_types)
    rotary = "one set of frequencies per layer type" if layout.per_type_rotary else "one set for every layer"
    print(
        f"{model_name} ({layout.model_type}): {len(layout.layer_types)} layers; rotary: {rotary}, angles {layout.angles}"
    )
    print(f"  {record.describe()}; --factor s counts from C")
    card = card_length_note(rotary_host(model).config)
    if card:
        print(f"  note: {card}")
    for line in _multimodal_lines(model, layout):
        print(f"  {line}")
    rows = [
        {**row, "shipped": _shipped(record, row["layer_type"] if layout.per_type_rotary else None)}
        for row in layout.describe()
    ]
    header = f"  {'layer type':<22} {'layers':>6} {'RoPE':>5} {'NoPE':>5} {'window':>7} {'rotary dim':>10} {'base':>10}"
    print(header + "  shipped scaling")
    for row in rows:
        window = row["sliding_window"] or "-"
        base = "-" if row["rope_theta"] is None else f"{row['rope_theta']:g}"
        dim = "-" if row["rotary_dim"] is None else row["rotary_dim"]
        print(
            f"  {row['layer_type']:<22} {row['layers']:>6} {row['rope_layers']:>5} {len(row['nope_layers']):>5} "
            f"{window:>7} {dim:>10} {base:>10}  {row['shipped']}"
        )
    print(f"\nmethods on this model at x2 (--layer-types {layer_types or 'full'}):")
    what = {}
    for name, reason in verdicts.items():
        if reason is None:
            plan = plan_patch(model, name, 2.0, layer_types=layer_types)
            what[name] = plan.extension.how
        applies = "applies" + (f" ({what[name]})" if what.get(name) else "")
        print(f"  {name:<13} {applies if reason is None else 'no: ' + reason}")
    if json_path:
        written = {
            "model": model_name,
            "original_max_position_embeddings": record.pretraining_length,
            "trained_context": record.trained_context,
            "shipped_scaling": {str(key): text for key, text in record.shipped_scaling.items()},
            "layout": rows,
            "methods": verdicts,
            "at_x2": what,
        }
        written.update(per_type_rotary=layout.per_type_rotary, angles=layout.angles, layer_types=layer_types or "full")
        atomic_write_text(Path(json_path), json.dumps(written, indent=2) + "\n")
    return 0


def _shipped(record, layer_type) -> str:
    """The scaling a layer type's rope parameters ship with, e.g. 'yarn x4', or 'none'."""
    rope = record.of(layer_type)
    return "none" if rope.rope_type == "default" else rope.describe()
