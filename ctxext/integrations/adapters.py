"""The patch an adapter was trained under, written beside it and applied again where it loads.

PEFT saves an adapter as adapter_config.json (whose `base_model_name_or_path` is the model's directory, patched in
memory or not) and the LoRA weights: nothing in them says that the base was patched, so a reload runs the adapter on
the unpatched base. ctxext writes `ctxext.yaml` beside adapter_config.json when the base is patched in memory
(`ctxext.patch`): the call itself (`patch`, kept on the patched rotary by `ctxext.patching.patch`), the rope it
gives, and the rope it was applied to. Loading the adapter after `import ctxext` reads it and, on a base that
carries the source rope, makes the same call before the adapter goes on (`carry_patch`); a base that already
carries the patched rope (loaded from a patched checkpoint) is left as it is, and any other base is refused in
one line. The hooks that call these on PEFT's and transformers' save and load are in ctxext.integrations.peft.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from huggingface_hub import hf_hub_download
from huggingface_hub.errors import EntryNotFoundError, LocalEntryNotFoundError, RepositoryNotFoundError

from ..errors import CtxextError
from ..patching import ScaledRotaryEmbedding, applied_method, patch, rotary_host
from ..patching.attention import CONFIG_KEY
from ..patching.forms import model_rope_form
from ..patching.patch import recorded_rope_parameters, shipped_rope
from ..record_file import RECORD_FILE, CtxextRecord, read_record, write_record

WRITTEN_BY = "ctxext's hook on a PEFT save of an adapter on a base patched in memory (ctxext.patch)"


def patch_call(model) -> dict | None:
    """The `ctxext.patch` call that patched `model` in memory (method and keyword arguments), or None."""
    scaled = rotary_host(model).rotary_emb
    if not isinstance(scaled, ScaledRotaryEmbedding):
        return None
    return plain(getattr(scaled, "patch_call", None))


def adapter_record(model) -> dict | None:
    """What ctxext.yaml beside an adapter of `model` records, or None where `model` is not patched in memory."""
    call = patch_call(model)
    if call is None:
        return None
    host = rotary_host(model)
    return plain(
        {
            "source_model": getattr(host.config, "_name_or_path", "") or "a model in memory",
            "patch": call,
            "rope_parameters": recorded_rope_parameters(model),
            "native_rope_parameters": native_rope_parameters(model),
            "attention": applied_method(model)["attention"],
            "max_position_embeddings": host.config.max_position_embeddings,
            "source_rope": shipped_rope(model),
        }
    )


def native_rope_parameters(model) -> dict | None:
    """The patched rope in transformers' own form (what `ctxext.save_pretrained` writes), or None without one."""
    try:
        form = model_rope_form(model, "native")
    except CtxextError:
        return None
    return form.rope_parameters if form.native else None


def write_adapter_record(model, folder: str | Path) -> None:
    """ctxext.yaml beside the adapter in `folder` when `model` is patched in memory; where it is not, a record of
    an earlier save in the same folder is removed (it would patch a base this adapter was not trained on)."""
    record = adapter_record(model)
    if record is None:
        earlier = read_record(folder)
        if earlier is not None and is_adapter_record(earlier.values):
            (Path(folder) / RECORD_FILE).unlink()
        return
    write_record(folder, CtxextRecord("adapter", WRITTEN_BY, record))


def is_adapter_record(record) -> bool:
    return isinstance(record, dict) and isinstance(record.get("patch"), dict) and "source_rope" in record


def read_adapter_record(adapter, options: dict | None = None) -> dict | None:
    """The record beside the adapter at `adapter` (a directory, or a Hub repository), or None where there is none;
    `options` are the loader's keyword arguments, of which subfolder, revision, cache_dir and token are read."""
    if adapter is None:
        return None
    options = options or {}
    subfolder = options.get("subfolder") or ""
    if Path(adapter).is_dir():
        path = Path(adapter) / subfolder / RECORD_FILE
    else:
        hub = {key: options[key] for key in ("revision", "cache_dir", "token") if options.get(key) is not None}
        try:
            path = Path(hf_hub_download(str(adapter), RECORD_FILE, subfolder=subfolder or None, **hub))
        except (EntryNotFoundError, LocalEntryNotFoundError, RepositoryNotFoundError, OSError):
            return None
    record = read_record(path)
    return record.values if record is not None and is_adapter_record(record.values) else None


def carry_patch(model, record: dict, where: str) -> None:
    """Make `model` the base the adapter at `where` was trained on: nothing on a base that carries the patched rope
    already (patched in memory the same way, or loaded from a patched checkpoint); the record's `patch` call on an
    unpatched base with the record's source rope; a one-line CtxextError for any other base."""
    if carries_patched_rope(model, record):
        return
    wanted, current = record["patch"], patch_call(model)
    if current is not None:
        raise CtxextError(
            f"the adapter at {where} was trained on the base patched with {describe(wanted)}, and this base is "
            f"patched with {describe(current)}; load it on the unpatched base (ctxext patches it) or "
            f"`ctxext.patch` the base as its ctxext.yaml says"
        )
    if numbers_as_floats(shipped_rope(model)) != numbers_as_floats(record["source_rope"]):
        raise CtxextError(
            f"the adapter at {where} was trained on a base with rope {record['source_rope']} patched with "
            f"{describe(wanted)}; this base has rope {shipped_rope(model)}, neither that nor the patched one: load "
            f"it on {record.get('source_model', 'the base it was trained on')}"
        )
    patch(model, **wanted)


def carries_patched_rope(model, record: dict) -> bool:
    """Whether `model` carries the rope (and attention settings) the record's patch gives."""
    config = rotary_host(model).config
    rope = numbers_as_floats(dict(config.rope_parameters or {}))
    patched = [numbers_as_floats(record[key]) for key in ("rope_parameters", "native_rope_parameters") if record[key]]
    return (
        rope in patched
        and config.max_position_embeddings == record["max_position_embeddings"]
        and plain(getattr(config, CONFIG_KEY, None)) == record["attention"]
    )


def apply_adapter_record(model, adapter, options: dict | None = None) -> None:
    """`carry_patch` with the record beside the adapter at `adapter`, where it has one (`read_adapter_record`)."""
    record = read_adapter_record(adapter, options)
    if record is not None:
        carry_patch(model, record, os.fspath(Path(adapter) / ((options or {}).get("subfolder") or "")))


def describe(call: dict) -> str:
    """A patch call in a few words, e.g. 'yarn (factor=4)' (the arguments left at None or False unsaid)."""
    rest = ", ".join(f"{key}={value}" for key, value in call.items() if key != "method" and value not in (None, False))
    return f"{call.get('method')} ({rest})" if rest else str(call.get("method"))


def plain(value):
    """`value` as JSON has it (tuples as lists, keys as strings): what a record written and read back holds."""
    return None if value is None else json.loads(json.dumps(value, default=str))


def numbers_as_floats(value):
    """`value` with every number a float: 4 and 4.0 are the same factor, as transformers reads them."""
    if isinstance(value, dict):
        return {key: numbers_as_floats(item) for key, item in value.items()}
    if isinstance(value, list):
        return [numbers_as_floats(item) for item in value]
    if isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    return value
