"""What `ctxext eval` and `ctxext passkey` share once they run: the methods to compare, the model with its
runtime, BOS, and the provenance written to results.json. Imported by their `run` only (it loads torch)."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

from ..errors import CtxextError
from .common import method_mappings


def build_methods(args, model) -> list:
    """EvalMethods in order: the `none` baseline first (unless --no-baseline), then the ones asked for."""
    from ..config import MethodConfig
    from ..eval.runner import EvalMethod
    from ..patching.rope_types import stateless_method_for

    rope = dict(getattr(model.config, "rope_parameters", None) or {})
    loaded_is_plain = rope.get("rope_type", "default") == "default"
    # A scaled checkpoint records the pre-training length; methods must scale from it, not from L*s.
    loaded_original = rope.get("original_max_position_embeddings")

    mappings = method_mappings(args)
    methods = []
    if mappings is None:
        if loaded_is_plain:
            methods.append(EvalMethod("none", None, {"method": "none", "as_loaded": True}))
        else:
            factor = rope.get("factor")
            label = f"as loaded ({rope.get('rope_type')}{f' x{factor:g}' if factor else ''})"
            stateless = stateless_method_for(rope)
            if stateless is None:
                methods.append(EvalMethod(label, None, {"as_loaded": True, "rope_parameters": rope}))
            else:
                # Each window at its own length, whatever came before (see stateless_method_for).
                name, params = stateless
                config = MethodConfig.from_mapping(
                    {
                        "method": name,
                        **params,
                        "original_max_position_embeddings": int(
                            loaded_original or model.config.max_position_embeddings
                        ),
                    }
                )
                methods.append(
                    EvalMethod(
                        label, config, {"as_loaded": True, "rope_parameters": rope, "computed_as": config.to_dict()}
                    )
                )
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
        baseline = (
            EvalMethod("none", None, {"method": "none", "as_loaded": True})
            if loaded_is_plain
            else EvalMethod("none", MethodConfig("none"), MethodConfig("none").to_dict())
        )
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


def resolve_runtime(args, processes) -> dict:
    """device, dtype and attention implementation from --device/--dtype/--attn-implementation (ctxext.runtime)."""
    from ..runtime import inference_runtime

    return inference_runtime(args.device, args.dtype, args.attn_implementation, processes)


def bos_choice(args, tokenizer) -> tuple[int | None, dict]:
    from ..eval.data import tokenizer_adds_bos

    adds = tokenizer_adds_bos(tokenizer)
    want = adds if args.bos == "auto" else args.bos == "yes"
    if want and tokenizer.bos_token_id is None:
        raise CtxextError("--bos yes, but the tokenizer has no BOS token")
    bos_id = tokenizer.bos_token_id if want else None
    return bos_id, {
        "tokenizer_adds_bos": adds,
        "setting": args.bos,
        "windows_start_with_bos": want,
        "bos_token_id": bos_id,
        "bos_scored": False,
        "note": "each window is BOS + (window - 1) text tokens; BOS is context only"
        if want
        else "windows are text tokens only; the first token of a document is never scored",
    }


def load(args, processes):
    """(model, tokenizer, runtime) for args.model on the device, dtype and attention the runtime picks."""
    from ..loading import check_model_source, load_model, load_tokenizer

    check_model_source(args.model)
    runtime = resolve_runtime(args, processes)
    tokenizer = load_tokenizer(args.model)
    model = load_model(
        args.model, dtype=runtime["dtype"], device=runtime["device"], attn_implementation=runtime["attn_implementation"]
    )
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
        "dtype": str(runtime["dtype"]).removeprefix("torch."),
        "dtype_reason": runtime["dtype_reason"],
        "device": str(runtime["device"]),
        "attn_implementation": runtime["attn_implementation"],
    }


def _rotary_dim(config) -> int | None:
    from ..patching import rotary_dim

    try:
        return rotary_dim(config)
    except (AttributeError, TypeError, ZeroDivisionError):
        return None


def original_length(model) -> int | None:
    """L as patch() reads it; for a model ctxext cannot patch (evaluated as loaded), its max_position_embeddings."""
    from .. import patching

    try:
        return patching.original_length(model)
    except CtxextError:
        return getattr(model.config, "max_position_embeddings", None)


def progress_bar(args, processes, total: int, unit: str):
    if args.no_progress or not processes.is_main:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, unit=unit, unit_scale=True, dynamic_ncols=True, file=sys.stderr)


def command_line() -> str:
    return " ".join(shlex.quote(a) for a in sys.argv)


def arguments(args) -> dict:
    return dict(vars(args))


def check_outputs(args) -> list:
    """The inputs the output directory must not overlap; a bad output directory fails here, early."""
    from ..outputs import check_output_dir

    protected = [args.model] if Path(args.model).exists() else []
    protected += [p for p in (args.text_file or []) if Path(p).exists()]
    if args.dataset and Path(args.dataset).exists():
        protected.append(args.dataset)
    check_output_dir(args.output, protected, args.overwrite)
    return protected
