"""Writing a patched checkpoint: what `ctxext patch` does, shared with `ctxext search` (its best result)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .errors import CtxextError
from .loading import load_config, load_model, load_tokenizer
from .outputs import atomic_output_dir, check_output_dir
from .patching import applied_method
from .patching.applicable import skeleton
from .patching.families import rotary_host
from .patching.forms import FORMATS, RopeForm
from .patching.pair_selection import select_pairs, selection_record
from .patching.patch import check_not_shorter, recorded_rope_parameters, shipped_rope
from .patching.record import SOURCE_KEY, recorded_source
from .record_file import CtxextRecord, read_record, write_record
from .serving.forms import write_config_for_serving

NO_TOKENIZER = "none in the source (no tokenizer files), none written"  # ctxext.yaml's `tokenizer` then


@dataclass
class PatchedCheckpoint:
    """What was written, for the caller to report."""

    output: Path
    label: str
    rope_parameters: dict
    max_position_embeddings_before: int
    max_position_embeddings: int
    applied: dict
    form: RopeForm  # how the rope parameters were written (native form or ctxext's type)
    tokenizer: bool = True  # False: the source had no tokenizer files, and none was written
    model: str = ""  # what the source's rope record says: L0, C, the shipped scaling
    context: str = ""  # what the patch does to the context, e.g. 'yarn x2 composes with the shipped llama3 x8: ...'

    @property
    def loads_in_plain_transformers(self) -> str:
        if self.applied["attention"]:  # log-n / remapping live in patched attention layers, re-installed by ctxext
            return (
                "the frequencies only; log-n/ReRoPE need `import ctxext` first"
                if self.form.native
                else "after `import ctxext`"
            )
        return "yes" if self.form.native else "after `import ctxext`"


def write_patched_checkpoint(
    source: str,
    method_config,
    output: str | Path,
    overwrite: bool = False,
    written_by: str = "ctxext patch",
    extra_record: dict | None = None,
    format: str = "native",
    pair_selection: tuple[str, int] | None = None,
) -> PatchedCheckpoint:
    """Load `source` in its own dtype on the CPU, apply `method_config`, and write a complete checkpoint (weights,
    config, the tokenizer where the source has one, ctxext.yaml recording what was applied) to `output`,
    atomically. A source without tokenizer files (a training checkpoint) is written without them, and ctxext.yaml
    says so (`tokenizer: none in the source`); DPE's `pair_selection` needs one. The source is never
    written to; an existing non-empty `output` needs `overwrite`. config.json gets the method's exact native
    rope form where one exists (`format='native'`, see ctxext.patching.forms), in both config spellings.
    `pair_selection` (calibration text file, k): DPE's selected pairs, the top k per layer by |q||k| on the text
    (ctxext.patching.pair_selection), measured on the unpatched model and recorded with the method."""
    if format not in FORMATS:
        raise CtxextError(f"unknown --format '{format}'; choose one of: {', '.join(FORMATS)}")

    protected = [source] if Path(source).exists() else []
    check_output_dir(output, protected, overwrite)
    plan = check_source(source, method_config)

    tokenizer = load_tokenizer(source, optional=True)  # patch only copies it: a checkpoint may have none
    check_tokenizer_for_pairs(tokenizer, pair_selection, source)
    model = load_model(source, dtype="auto", device="cpu")
    with_source_rope(rotary_host(model).config, source)
    trained_context = plan.record.trained_context
    extra_record = dict(extra_record or {})
    if tokenizer is None:
        extra_record["tokenizer"] = NO_TOKENIZER
    planned = plan  # what check_source decided on the skeleton is carried out, not decided again
    if pair_selection is not None:  # the pairs selected change the method's parameters: it is planned anew
        method_config, extra_record["pair_selection"] = with_selected_pairs(
            model, tokenizer, method_config, pair_selection, trained_context
        )
        planned = None
    method_config.apply(model, planned)
    applied = applied_method(model)

    fields = method_config.to_dict()
    record = lambda form: checkpoint_record(source, fields, model, applied, format, form, extra_record)
    form = save_checkpoint(model, tokenizer, output, protected, overwrite, format, record, written_by)
    return PatchedCheckpoint(
        Path(output).resolve(),
        method_config.label,
        form.rope_parameters,
        plan.record.max_position_embeddings,
        rotary_host(model).config.max_position_embeddings,
        applied,
        form,
        tokenizer is not None,
        plan.record.describe(),
        plan.describe(),
    )


def check_tokenizer_for_pairs(tokenizer, pair_selection: tuple[str, int] | None, source: str) -> None:
    """DPE's pair selection reads a text: refuse a source without tokenizer files before anything loads."""
    if tokenizer is None and pair_selection is not None:
        raise CtxextError(
            f"--select-pairs needs a tokenizer to turn '{pair_selection[0]}' into tokens, and '{source}' has no "
            f"tokenizer files; add the base model's tokenizer files to it, or give the pairs as selected_pairs"
        )


def checkpoint_record(source: str, method: dict, model, applied: dict, format: str, form: RopeForm, extra: dict):
    """What ctxext.yaml records (ctxext.record_file): the source, the method (`method`: the method config's
    fields, or the applied method's name for a patch made in memory) and every parameter as applied, defaults
    included, the lengths, how it was written.

    `factor` is the one applied (with `--target-length N` that is N over the L it counts from, the target kept
    beside it), so that L x factor is the length asked for; `written_as.composed` says that config.json holds the
    method composed with the model's shipped scaling (which `ctxext export` then keeps, not rebuilds)."""
    scaled = rotary_host(model).rotary_emb
    applied_factor = applied["params"].get("factor")
    return {
        "source_model": source,
        **method,
        **applied["params"],
        **({} if applied_factor is None else {"factor": float(applied_factor)}),
        "original_max_position_embeddings": applied["original_max_position_embeddings"],
        "rope_parameters": recorded_rope_parameters(model),
        "max_position_embeddings": rotary_host(model).config.max_position_embeddings,
        "written_as": {
            "format": format,
            "rope_type": applied["rope_type"],
            "how": form.how,
            "composed": bool(getattr(scaled, "composed_keys", ())),
        },
        "source_rope": shipped_rope(model),  # the rope the method was applied to (composed with, or replaced)
        **extra,
    }


def check_source(source: str, method_config):
    """What the source's config alone refuses (an unsupported family, a layer type it does not have, a method its
    layout cannot take, a shape the method cannot take), before any weights load: `patch`'s own checks, asked of
    a meta-device skeleton of the model; and a result shorter than the model's trained context, unless asked for.
    The plan (ctxext.patching.patch.PatchPlan), which says what the patch does to the model's context."""
    plan = method_config.plan(skeleton(with_source_rope(load_config(source), source)))
    check_not_shorter(plan, method_config.allow_shorter)
    return plan


def with_source_rope(config, source: str):
    """`config`, given the `source_rope` of the source's ctxext.yaml as its SOURCE_KEY where config.json records
    none (a checkpoint ctxext wrote before config.json carried it): replacing that checkpoint's patch then starts
    from the rope ctxext changed, not from the base its native form raised (ctxext.patching.patch._rope_to_patch)."""
    written = read_record(source) if Path(source).is_dir() else None
    if recorded_source(config) is None and written is not None:
        recorded = written.values.get("source_rope")
        if isinstance(recorded, dict) and isinstance(recorded.get("rope_parameters"), dict):
            setattr(config, SOURCE_KEY, recorded)
    return config


def with_selected_pairs(model, tokenizer, method_config, pair_selection: tuple[str, int], trained_context: int):
    """(`method_config` with DPE's `selected_pairs` measured on the unpatched `model`, the record of how)."""
    text, k = pair_selection
    how = selection_record(text, k, method_config.original_max_position_embeddings or trained_context)
    chosen = select_pairs(model, tokenizer, Path(text).read_text(encoding="utf-8"), k, how["max_tokens"])
    method_config = dataclasses.replace(method_config, params={**method_config.params, "selected_pairs": chosen})
    return method_config, how


def save_checkpoint(
    model, tokenizer, output, protected: list, overwrite: bool, format: str, record: Callable, written_by: str
) -> RopeForm:
    """Write weights, config.json in `format`, tokenizer (unless None) and ctxext.yaml (`record(form)`) to
    `output`, atomically; the rope form written."""
    with atomic_output_dir(output, protected, overwrite) as staging:
        model.save_pretrained(staging)
        form = write_config_for_serving(model, staging, format)
        if tokenizer is not None:
            tokenizer.save_pretrained(staging)
        write_record(staging, CtxextRecord("checkpoint", written_by, record(form)))
    return form


def save_pretrained(model, output: str | Path, tokenizer=None, overwrite: bool = False, format: str = "native"):
    """Save a model patched in memory (`ctxext.patch`) as `ctxext patch` writes a checkpoint: config.json in the
    method's native rope form where one exists (so vLLM, SGLang and plain transformers load it; `format='ctxext'`
    keeps ctxext's own type), the tokenizer when given, and ctxext.yaml saying what was applied; atomically.
    `model.save_pretrained` instead writes the in-memory form, ctxext's own `ctxext_*` types for most methods.
    Returns the rope form written (ctxext.patching.forms.RopeForm)."""
    if format not in FORMATS:
        raise CtxextError(f"unknown format '{format}'; choose one of: {', '.join(FORMATS)}")
    applied = applied_method(model)
    if applied is None:
        raise CtxextError("the model is not patched by ctxext (ctxext.patch); save it with model.save_pretrained")
    source = getattr(model.config, "_name_or_path", "") or "a model in memory"

    record = lambda form: checkpoint_record(source, {"method": applied["method"]}, model, applied, format, form, {})
    return save_checkpoint(model, tokenizer, output, [], overwrite, format, record, "ctxext.save_pretrained")
