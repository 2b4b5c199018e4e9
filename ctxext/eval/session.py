"""One model loaded to be evaluated, what eval, passkey and tasks do before they score and record after: the model
and tokenizer loaded on their runtime, the method rows (ctxext.eval.rows) checked against its config first, BOS, the
description of the model written to results.json, and what names its weights in each cell's key."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import sys
from dataclasses import dataclass
from pathlib import Path

from tqdm.auto import tqdm

from .. import patching
from ..compat import hub_commit
from ..dispatch import Placement, check_tensor_parallel_model, input_device, placement_summary
from ..errors import CtxextError
from ..loading import check_model_source, load_config, load_model, load_tokenizer
from ..outputs import content_fingerprint
from ..patching.applicable import skeleton
from ..patching.families import rotary_wavelengths
from ..patching.record import RopeRecord
from ..run_options import RuntimeOptions
from ..runtime import Processes, cpu_processes, inference_runtime
from .data import tokenizer_adds_bos
from .options import check_bos
from .rows import MethodSelection, beyond_training_notes, method_rows, rows_for_record, shipped_record


@dataclass
class EvalSession:
    name: str
    model: object
    tokenizer: object
    runtime: dict  # ctxext.runtime.inference_runtime's answer
    options: RuntimeOptions
    processes: object  # ctxext.runtime.Processes
    methods: list
    bos_id: int | None
    bos_info: dict
    record: RopeRecord | None  # the loaded model's rope record, built once (None: no RoPE ctxext reads)

    @classmethod
    def open(cls, name: str, selection: MethodSelection, options: RuntimeOptions, processes=None) -> EvalSession:
        check_methods_apply(name, selection)
        if options.tp > 1:  # before anything is launched: a model that cannot be split is refused here
            check_tensor_parallel_model(options.tp, load_config(name))
        processes = processes or Processes(cpu=cpu_processes(options.device), tp=options.tp)
        if getattr(processes, "tp", 1) != options.tp:
            raise CtxextError(
                f"--tp {options.tp}, but these processes were set up without it (ctxext.runtime.Processes)"
            )
        model, tokenizer, runtime = load_model_and_tokenizer(name, options, processes)
        record = shipped_record(model.config)  # the model as loaded: unpatched
        rows = rows_for_record(selection, record)
        methods = [dataclasses.replace(m, kept_keys=options.kept_keys) for m in rows]
        bos_id, bos_info = bos_choice(options.bos, tokenizer)
        return cls(name, model, tokenizer, runtime, options, processes, methods, bos_id, bos_info, record)

    def runtime_line(self) -> str:
        runtime, world, tp = self.runtime, self.processes.world_size, self.processes.tp
        placed = placement_summary(self.model)
        return (
            f"{runtime['dtype']} ({runtime['dtype_reason']}) on {runtime['device']}, "
            f"{runtime['attn_implementation']}{f', {world} processes' if world > 1 else ''}"
            f"{f', tensor parallel over {tp} processes' if tp > 1 else ''}"
            f"{f'; {placed}' if placed else ''}"
        )

    def beyond_training_notes(self, lengths: list[int]) -> list[str]:
        C = model_lengths(self.record, self.model.config)["trained_context"]
        return beyond_training_notes(self.methods, lengths, C, rotary_wavelengths(self.model))

    def description(self) -> dict:
        return model_description(self.name, self.model, self.runtime, self.record)

    def progress(self, total: int, unit: str):
        return progress_bar(self.options, self.processes, total, unit)

    def cell_context(self, short_docs: str) -> dict:
        """What every cell of this session depends on besides its method, length and tokens."""
        return {
            "model": model_identity(self.name, self.model),
            "dtype": str(self.runtime["dtype"]).removeprefix("torch."),
            "device": self.runtime["device"].type,
            "attn_implementation": self.runtime["attn_implementation"],
            "short_docs": short_docs,
            "protocol": "ctxext sliding-window perplexity v1",
        }


def check_methods_apply(name: str, selection: MethodSelection) -> None:
    """Refuse, in the one line `patch` would (prefixed with the row's label), a method the model cannot take: a
    layer type it does not have, a method its layout or its shape cannot take. Asked of the model's config alone, on
    a meta-device skeleton (ctxext.patching.applicable), before any weights load or any cell is computed, as
    `ctxext patch` asks before it writes anything (ctxext.checkpoint.check_source)."""
    config = load_config(name)
    rows = [row for row in method_rows(selection, config) if row.config is not None]
    if not rows:  # the model as loaded: nothing is patched in (a model without RoPE is evaluated so)
        return
    model = skeleton(config)
    for row in rows:
        try:
            row.config.plan(model)
        except CtxextError as error:
            raise CtxextError(f"{row.label}: {error}") from None


def load_model_and_tokenizer(name: str, runtime: RuntimeOptions, processes) -> tuple:
    """(model, tokenizer, runtime dict) for a checkpoint or hub id on the device, dtype and attention the
    runtime picks (ctxext.runtime.inference_runtime)."""
    check_model_source(name)
    resolved = inference_runtime(
        runtime.device, runtime.dtype, runtime.attn_implementation, processes, runtime.placement
    )
    tokenizer = load_tokenizer(name)
    model = load_model(
        name,
        dtype=resolved["dtype"],
        device=resolved["device"],
        attn_implementation=resolved["attn_implementation"],
        progress=runtime.progress,
        placement=runtime.placement,
        tp=resolved["tp"],
    )
    return model, tokenizer, resolved


def bos_choice(bos: str, tokenizer) -> tuple[int | None, dict]:
    """(the BOS id each window starts with or None, the protocol's description of that choice)."""
    adds = tokenizer_adds_bos(tokenizer)
    want = adds if check_bos(bos) == "auto" else bos == "yes"
    if want and tokenizer.bos_token_id is None:
        raise CtxextError("--bos yes, but the tokenizer has no BOS token")
    bos_id = tokenizer.bos_token_id if want else None
    return bos_id, {
        "tokenizer_adds_bos": adds,
        "setting": bos,
        "windows_start_with_bos": want,
        "bos_token_id": bos_id,
        "bos_scored": False,
        "note": "each window is BOS + (window - 1) text tokens; BOS is context only"
        if want
        else "windows are text tokens only; the first token of a document is never scored",
    }


def model_lengths(record: RopeRecord | None, config) -> dict:
    """L0 as `pretraining_length` and C as `trained_context`, from the rope record (the config's
    max_position_embeddings for both where ctxext reads no RoPE)."""
    if record is None:
        reach = getattr(config, "max_position_embeddings", None)
        return {"pretraining_length": reach, "trained_context": reach}
    return {"pretraining_length": record.pretraining_length, "trained_context": record.trained_context}


def model_description(name: str, model, runtime: dict, record: RopeRecord | None) -> dict:
    """results.json's `model` block, with the model's lengths (`model_lengths`); the old key
    `original_max_position_embeddings` (which held C) is kept for older readers."""
    config = model.config
    lengths = model_lengths(record, config)
    return {
        "path": str(Path(name).resolve()) if Path(name).exists() else name,
        "model_type": getattr(config, "model_type", None),
        "architecture": type(model).__name__,
        "parameters": sum(p.numel() for p in model.parameters()),
        "max_position_embeddings": getattr(config, "max_position_embeddings", None),
        **lengths,
        "original_max_position_embeddings": lengths["trained_context"],
        "rotary_dim": _rotary_dim(config),
        "rope_parameters": rope_parameters(record),
        "dtype": str(runtime["dtype"]).removeprefix("torch."),
        "dtype_reason": runtime["dtype_reason"],
        "device": str(runtime["device"]),
        "attn_implementation": runtime["attn_implementation"],
        **placement_description(model, runtime.get("placement")),
        **({"tensor_parallel": runtime["tp"]} if runtime.get("tp", 1) > 1 else {}),
    }


def placement_description(model, placement: Placement | None) -> dict:
    """For a model accelerate placed (--device-map): the placement asked for and the map it placed (a strategy that
    found room on one device places the whole model there: {"": device}); {} without a placement."""
    if placement is None:
        return {}
    placed = getattr(model, "hf_device_map", None) or {"": str(input_device(model))}
    return {"placement": {**placement.describe(), "placed": dict(placed)}}


def rope_parameters(record: RopeRecord | None) -> dict:
    """The rope parameters as the model's rope record reads them (one dict, or one per layer type: Gemma 3); {}
    for a model without RoPE (evaluated as loaded)."""
    if record is None:
        return {}
    if None in record.types:
        return record.types[None].parameters
    return {key: rope.parameters for key, rope in record.types.items()}


def _rotary_dim(config) -> int | None:
    try:
        return patching.rotary_dim(config)
    except (AttributeError, TypeError, ZeroDivisionError):
        return None


def progress_bar(runtime: RuntimeOptions, processes, total: int, unit: str):
    if not runtime.progress or not processes.is_main:
        return None
    return tqdm(total=total, unit=unit, unit_scale=True, dynamic_ncols=True, file=sys.stderr)


def model_identity(name: str, model) -> dict:
    """What names the weights an eval cell was computed with: a local checkpoint's content (ctxext.outputs.
    content_fingerprint), else `model_files_key`."""
    path = Path(name)
    if path.is_dir() and any(path.glob("*.safetensors")):
        return {"content": content_fingerprint(path)}
    return model_files_key(name, model)


def tokenizer_identity(name: str) -> str:
    """What a task's prompts depend on besides the weights: for a local checkpoint, the sha256 of the bytes of its
    files other than the weights and config.json (tokenizer, chat template, generation config), so the same
    files at another path, in another checkout or on another machine name the same cells; a hub id as it is."""
    path = Path(name)
    if not path.is_dir():
        return name
    digest = hashlib.sha256()
    for file in sorted(f for f in path.rglob("*") if f.is_file() and f.suffix not in WEIGHT_SUFFIXES):
        if file.name != "config.json":
            digest.update(f"{file.relative_to(path)}:{file.stat().st_size}:".encode())
            digest.update(file.read_bytes())
    return digest.hexdigest()


WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


def model_files_key(name_or_path: str, model) -> dict:
    """The model without reading the weights: a local checkpoint's path and the stamp of its files
    (`checkpoint_file_stamp`), or a hub id with the commit transformers resolved (`model_identity`'s fallback
    where there are no safetensors to fingerprint)."""
    path = Path(name_or_path)
    if path.is_dir():
        return {"path": str(path.resolve()), "files_sha256": checkpoint_file_stamp(path)}
    return {"hub_id": name_or_path, "commit": hub_commit(name_or_path, model.config)}


def checkpoint_file_stamp(path: Path) -> str:
    """A hash of a folder's file names, sizes and modification times: changes when any file is rewritten,
    without reading the files (not their content: the same weights saved again get another stamp)."""
    files = sorted(
        (str(f.relative_to(path)), f.stat().st_size, f.stat().st_mtime_ns) for f in path.rglob("*") if f.is_file()
    )
    return hashlib.sha256(json.dumps(files).encode()).hexdigest()
