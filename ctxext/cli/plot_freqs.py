"""`ctxext plot-freqs`: θ'_i/θ_i per pair for one or more methods, as a PNG (no model needed)."""

from __future__ import annotations

from pathlib import Path

from ..config import MethodConfig
from ..errors import CtxextError
from .aliases import add_alias
from .common import add_method_arguments, method_mappings

HELP = "plot theta'_i/theta_i per pair for one or more methods"
DEFAULT_ORIGINAL_LENGTH = 4096  # L when neither --original-max-position-embeddings nor a method YAML gives one
DESCRIPTION = (
    "Save a PNG of the per-pair frequency ratio of each method: 1 = extrapolated (kept), 1/s = "
    "interpolated, in between = ramped. No model needed. The methods come from --method (repeated) "
    "and --config (a method YAML, or a sweep YAML with 'methods:', as for 'ctxext eval'); L is "
    "--original-max-position-embeddings (default 4096)."
)


def add_arguments(parser) -> None:
    parser.add_argument("--head-dim", type=int, default=128, help="rotary dimension d (default 128)")
    parser.add_argument("--base", type=float, default=10000.0, help="RoPE base (default 10000)")
    parser.add_argument("-o", "--output", default="freqs.png", help="PNG path (default freqs.png)")
    add_method_arguments(parser, multiple=True)
    add_alias(parser, "--original-length", "--original-max-position-embeddings")


def run(args) -> int:
    from ..freqplot import frequency_ratios, plot_frequency_ratios

    mappings = method_mappings(args)
    if mappings is None:
        raise CtxextError("give at least one --method, or a --config")
    configs = [MethodConfig.from_mapping(m) for m in mappings]
    if args.head_dim <= 2 or args.head_dim % 2:
        raise CtxextError(f"--head-dim must be an even number > 2, got {args.head_dim}")
    given = {c.original_max_position_embeddings for c in configs} - {None}
    if len(given) > 1:
        raise CtxextError(
            f"the methods name different original lengths ({', '.join(map(str, sorted(given)))}); "
            "plot them separately or set --original-max-position-embeddings"
        )
    L = given.pop() if given else DEFAULT_ORIGINAL_LENGTH
    output = Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    plot_frequency_ratios(configs, args.head_dim, args.base, L, output)
    for config in configs:
        ratio = frequency_ratios(config, args.head_dim, args.base, L)
        kept = int((ratio > 0.999).sum())
        interpolated = int((ratio < 1.001 / config.factor).sum()) if config.factor > 1 else 0
        print(
            f"{config.label:<16} kept {kept:3d}, interpolated by s {interpolated:3d}, "
            f"in between {len(ratio) - kept - interpolated:3d} of {len(ratio)} pairs"
        )
    print(f"saved {output}")
    return 0
