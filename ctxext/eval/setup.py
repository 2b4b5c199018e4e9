"""What the evaluation workflows share before and after they score: the runtime options, the loaded model, BOS,
the data options, the description of the model written to results.json, and the invocation recorded with it."""

from __future__ import annotations

import shlex
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tqdm.auto import tqdm

from .. import patching
from ..dispatch import Placement, input_device
from ..errors import CtxextError
from ..loading import check_model_source, load_model, load_tokenizer
from ..patching.record import rope_record
from ..runtime import inference_runtime
from .data import load_documents, tokenizer_adds_bos
from .options import check_bos


@dataclass
class RuntimeOptions:
    """device, dtype and attention implementation ('auto': ctxext.runtime picks), BOS in front of each window
    ('auto': when the tokenizer adds one), whether to show a progress bar, and whether attention-level methods
    keep their rotated keys between decode steps (False: less memory, slower decoding, the same results).
    `placement` (--device-map/--max-memory, ctxext.dispatch): accelerate spreads the model over devices, CPU and
    disk instead of putting it on `device`. `tp` > 1 (`--tp N`, under a launcher of N processes): transformers'
    tensor parallelism splits every layer over the processes, which all run the same work (ctxext.runtime.Processes).
    """

    device: str = "auto"
    dtype: str = "auto"
    attn_implementation: str = "auto"
    bos: str = "auto"
    progress: bool = True
    kept_keys: bool = True
    placement: Placement | None = None
    tp: int = 1


@dataclass
class DataOptions:
    """The documents: text files/folders or a dataset (exactly one), as `ctxext.eval.data.load_documents` reads."""

    text_files: list[str] | None = None
    dataset: str | None = None
    split: str | None = None
    dataset_config: str | None = None
    text_field: str | None = None
    max_docs: int | None = None
    min_doc_tokens: int = 0

    def load(self, tokenizer):
        return load_documents(tokenizer, **asdict(self))

    def local_paths(self) -> list[str]:
        """The inputs on disk, which an output directory must not overlap."""
        paths = [p for p in (self.text_files or []) if Path(p).exists()]
        return paths + ([self.dataset] if self.dataset and Path(self.dataset).exists() else [])


@dataclass
class Invocation:
    """How a workflow was asked for, recorded at the top of results.json (the command line, its arguments)."""

    command: str = field(default_factory=lambda: " ".join(shlex.quote(a) for a in sys.argv))
    arguments: dict = field(default_factory=dict)


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


def model_description(name: str, model, runtime: dict) -> dict:
    config = model.config
    return {
        "path": str(Path(name).resolve()) if Path(name).exists() else name,
        "model_type": getattr(config, "model_type", None),
        "architecture": type(model).__name__,
        "parameters": sum(p.numel() for p in model.parameters()),
        "max_position_embeddings": getattr(config, "max_position_embeddings", None),
        "pretraining_length": pretraining_length_of(model),  # L0
        "trained_context": trained_context_of(model),  # C
        "rotary_dim": _rotary_dim(config),
        "rope_parameters": rope_parameters(config),
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


def rope_parameters(config) -> dict:
    """The config's rope parameters as its rope record reads them (one dict, or one per layer type: Gemma 3); {}
    for a model without RoPE (evaluated as loaded)."""
    try:
        record = rope_record(config)
    except CtxextError:
        return {}
    if None in record.types:
        return record.types[None].parameters
    return {key: rope.parameters for key, rope in record.types.items()}


def _rotary_dim(config) -> int | None:
    try:
        return patching.rotary_dim(config)
    except (AttributeError, TypeError, ZeroDivisionError):
        return None


def trained_context_of(model) -> int | None:
    """C, the trained context patch() counts from by default; for a model ctxext cannot patch (evaluated as
    loaded), its max_position_embeddings."""
    try:
        return patching.trained_context_of(model)
    except CtxextError:
        return getattr(model.config, "max_position_embeddings", None)


def pretraining_length_of(model) -> int | None:
    """L0, the pre-training length of the model's rope record; for a model ctxext cannot patch (evaluated as
    loaded), its max_position_embeddings."""
    try:
        return patching.model_rope_record(model).pretraining_length
    except CtxextError:
        return getattr(model.config, "max_position_embeddings", None)


def progress_bar(runtime: RuntimeOptions, processes, total: int, unit: str):
    if not runtime.progress or not processes.is_main:
        return None
    return tqdm(total=total, unit=unit, unit_scale=True, dynamic_ncols=True, file=sys.stderr)
