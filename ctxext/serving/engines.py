"""Which engines serve a patched model, and how: the table of `ctxext export MODEL --check`.

Each row is exact (the engine computes what ctxext computes), approximate (it runs, and `how` says what differs),
or no (with what to do instead). What each engine reads was taken from its source: transformers 5.24, vLLM 0.33
(and 0.11-0.25), SGLang 0.5.23, llama.cpp as vendored by llama-cpp-python 0.3.36 (docs/METHODS.md, "Serving").
Only transformers and llama.cpp can be run here; the vLLM and SGLang rows are read from their code, not run.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import CtxextError
from ..methods import get_method

ENGINES = ("transformers", "vllm", "sglang", "llama.cpp")
SERVED_BY_CTXEXT = "serve it with ctxext itself: ctxext.patch(model, ...) then model.generate"
VLLM_SGLANG_TYPES = ("default", "linear", "dynamic", "yarn", "llama3", "longrope")
GGUF_ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}


@dataclass
class Support:
    engine: str
    level: str  # exact | approximate | no
    how: str
    checked: str = "not run here"


@dataclass
class ServedModel:
    """What `ctxext export` knows of MODEL: its kind, family, written rope parameters and what ctxext applied."""

    path: Path
    kind: str  # checkpoint | gguf
    family: str  # transformers model_type, or the GGUF architecture
    rope_parameters: dict  # as written (checkpoint) or {} (gguf)
    attention: dict | None  # ctxext_attention (log-n, remapping)
    record: dict | None  # ctxext.yaml / the GGUF's ctxext.patch: method, params, L, base
    config: dict = field(default_factory=dict)

    @property
    def method(self) -> str:
        return self.record["method"] if self.record else "none"

    def method_and_params(self):
        spec = get_method(self.method)
        # ctxext.yaml is flat (method, factor, parameters, notes); a GGUF's record keeps them under "params"
        values = (self.record if self.kind == "checkpoint" else self.record.get("params")) if self.record else None
        names = set(spec.params_cls.__dataclass_fields__)
        return spec, spec.make_params(**{k: v for k, v in (values or {}).items() if k in names})

    @property
    def rotary_dim(self) -> int:
        """Rotated channels per head, from config.json (a checkpoint's)."""
        config = self.config
        head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
        return int(head_dim * (self.rope_parameters.get("partial_rotary_factor") or 1.0))

    @property
    def logn(self) -> bool:
        return bool((self.attention or {}).get("logn") or (self.record or {}).get("logn"))


def read_served_model(path) -> ServedModel:
    """Describe a checkpoint directory or a GGUF file, or a one-line CtxextError."""
    from .gguf import describe, is_gguf, read_gguf

    path = Path(path)
    if is_gguf(path):
        model = describe(read_gguf(path), path)
        return ServedModel(path, "gguf", model.arch, {}, None, model.record)
    if not (path / "config.json").is_file():
        raise CtxextError(f"'{path}' is neither a checkpoint directory (with config.json) nor a GGUF file")
    config = json.loads((path / "config.json").read_text())
    rope = config.get("rope_parameters") or {
        **(config.get("rope_scaling") or {"rope_type": "default"}),
        "rope_theta": config.get("rope_theta", 10000.0),
    }
    record = None
    if (path / "ctxext.yaml").is_file():
        import yaml

        record = yaml.safe_load((path / "ctxext.yaml").read_text())
    return ServedModel(
        path, "checkpoint", config.get("model_type", "?"), dict(rope), config.get("ctxext_attention"), record, config
    )


def engine_table(model: ServedModel) -> list[Support]:
    return [_transformers(model), _vllm_or_sglang(model, "vllm"), _vllm_or_sglang(model, "sglang"), _llama_cpp(model)]


def _attention_method(model: ServedModel) -> str | None:
    return (model.attention or {}).get("method") or (model.method if _is_remapping(model.method) else None)


def _is_remapping(method: str) -> bool:
    from ..methods.remapping import RemapParams

    return issubclass(get_method(method).params_cls, RemapParams)


def _transformers(model: ServedModel) -> Support:
    if model.kind == "gguf":
        if model.method == "none" or get_method(model.method).new_base is not None:
            return Support("transformers", "exact", "its GGUF loader reads rope.freq_base, all this file changes")
        return Support(
            "transformers",
            "no",
            "its GGUF loader reads only rope.freq_base, not the scaling keys or "
            "rope_freqs; load the patched checkpoint directory instead",
        )
    rope_type = model.rope_parameters.get("rope_type", "default")
    if rope_type.startswith("ctxext_") or _attention_method(model) or model.logn:
        what = "log-n scaling" if model.logn and not _attention_method(model) else f"'{model.method}'"
        return Support(
            "transformers",
            "no",
            f"{what} runs only with ctxext: `import ctxext` before loading (it re-installs the method)",
        )
    return Support(
        "transformers",
        "exact",
        f"reads rope type '{rope_type}' (rope_parameters in 5.x, rope_scaling + rope_theta in 4.x)",
    )


def _vllm_or_sglang(model: ServedModel, engine: str) -> Support:
    if model.kind == "gguf":
        return Support(engine, "no", "serve the patched checkpoint directory (ctxext patch on it), not the GGUF file")
    attention = _attention_method(model)
    if attention == "dual_chunk" and engine == "sglang" and model.family == "qwen2":
        if "dual_chunk_attention_config" in model.config:
            return Support(
                engine,
                "approximate",
                "its Dual Chunk Attention (dual_chunk_attention_config); it also "
                "scales keys by 0.1 ln(len/L) + 1, which ctxext does not; CUDA only; not run here",
            )
        return Support(
            engine,
            "approximate",
            "after `ctxext export MODEL --engine sglang -o OUT`, which writes "
            "dual_chunk_attention_config; SGLang also scales keys by 0.1 ln(len/L) + 1; not run here",
        )
    if attention == "dual_chunk":
        where = (
            "vLLM's Dual Chunk Attention went with its V0 backends"
            if engine == "vllm"
            else f"SGLang's Dual Chunk Attention is for the Qwen2 family, not {model.family}"
        )
        return Support(engine, "no", f"{where}; {SERVED_BY_CTXEXT}")
    if attention or model.logn:
        return Support(engine, "no", f"no {engine} option runs {attention or 'log-n scaling'}; {SERVED_BY_CTXEXT}")
    rope = model.rope_parameters
    rope_type = rope.get("rope_type", "default")
    if rope_type not in VLLM_SGLANG_TYPES:
        return Support(
            engine,
            "no",
            f"'{rope_type}' is not a type {engine} knows (it refuses to load); rewrite it "
            f"with `ctxext export MODEL --engine {engine} -o OUT` if the method has a native form",
        )
    if rope_type == "dynamic":
        return Support(
            engine,
            "approximate",
            "its dynamic NTK computes the base once, for the longest length "
            "(max_position_embeddings x factor), not from each sequence's length as transformers does",
        )
    if rope_type == "longrope" and "attention_factor" in rope and "short_mscale" not in rope:
        return Support(
            engine,
            "approximate",
            "it ignores attention_factor and computes its own cos/sin scale; "
            "rewrite with `ctxext export MODEL --engine ... -o OUT` (adds short_mscale/long_mscale)",
        )
    if rope_type == "yarn" and rope.get("attention_factor") is not None and "attn_factor" not in rope:
        return Support(
            engine,
            "approximate" if engine == "sglang" else "exact",
            "SGLang and vLLM before 0.33 ignore yarn's attention_factor (attn_factor is what they read)",
        )
    note = (
        "; pass --max-model-len (it defaults to L for longrope)" if engine == "vllm" and rope_type == "longrope" else ""
    )
    return Support(engine, "exact", f"reads rope type '{rope_type}' with the keys written{note}; not run here")


def _llama_cpp(model: ServedModel) -> Support:
    from .gguf import gguf_rope

    if model.kind == "gguf":
        how = (model.record or {}).get("written_as", "unpatched")
        return Support("llama.cpp", "exact", f"{how}; run it with a context (-c) up to the file's context_length")
    arch = GGUF_ARCH.get(model.family)
    if arch is None:
        return Support(
            "llama.cpp", "no", f"ctxext writes GGUF rope keys for llama, mistral, qwen2, qwen3, not {model.family}"
        )
    if model.record is None:
        return Support(
            "llama.cpp",
            "no",
            "no ctxext.yaml here, so the method is unknown; patch the model's GGUF with `ctxext patch MODEL.gguf ...`",
        )
    spec, params = model.method_and_params()
    L = int(model.record["original_max_position_embeddings"])
    base = float((model.record.get("rope_parameters") or model.rope_parameters)["rope_theta"])
    if spec.name == "self_extend":
        from .gguf import self_extend_flags

        return Support(
            "llama.cpp",
            "approximate",
            f"at run time, with {self_extend_flags(params)} (its window is a "
            "chunk width, and keys are shifted in the cache, not re-rotated)",
        )
    try:
        rope = gguf_rope(spec, params, arch, model.rotary_dim, base, L, logn=model.logn)
    except CtxextError as error:
        return Support("llama.cpp", "no", str(error))
    return Support(
        "llama.cpp",
        "exact",
        f"{rope.how}: convert the source model with llama.cpp's "
        f"convert_hf_to_gguf.py, then `ctxext patch MODEL.gguf` with the same method",
    )


# ------------------------------------------------------------------------------------------- writing
def export_checkpoint(model: ServedModel, engine: str, output, overwrite: bool = False) -> str:
    """Write a copy of the checkpoint whose config.json `engine` reads exactly (or, for SGLang's Dual Chunk
    Attention, its own approximation); returns how. A method the engine cannot read is a one-line CtxextError
    that names what is possible."""
    import shutil

    from ..outputs import atomic_output_dir, check_output_dir
    from .forms import with_both_spellings

    check_exportable(model, engine)
    rope, extra, how = engine_rope(model, engine)
    check_output_dir(output, [model.path], overwrite)
    with atomic_output_dir(output, [model.path], overwrite) as staging:
        for item in model.path.iterdir():
            if item.is_file():
                shutil.copy2(item, staging / item.name)
        (staging / "config.json").write_text(
            json.dumps({**with_both_spellings(model.config, rope), **extra}, indent=2, sort_keys=True) + "\n"
        )
        if (staging / "ctxext.yaml").exists():
            with open(staging / "ctxext.yaml", "a") as f:
                f.write(f"exported_for: {engine}\n")
    return how


def check_exportable(model: ServedModel, engine: str) -> None:
    """A one-line CtxextError when `model` cannot be exported as a checkpoint directory for `engine` at all."""
    if engine not in ENGINES:
        raise CtxextError(f"unknown --engine '{engine}'; choose one of: {', '.join(ENGINES)}")
    if model.kind == "gguf":
        raise CtxextError(
            "MODEL is a GGUF file, which llama.cpp reads as it is; --engine/-o export checkpoint directories"
        )
    if engine == "llama.cpp":
        raise CtxextError(
            "a GGUF file is written from a GGUF file: convert the unpatched model with llama.cpp's "
            "convert_hf_to_gguf.py, then `ctxext patch MODEL.gguf --method ... -o OUT.gguf`"
        )
    if model.record is None:
        raise CtxextError(
            f"'{model.path}' has no ctxext.yaml, so ctxext does not know what was applied; patch the "
            f"original model with `ctxext patch`"
        )
    if model.logn:
        raise CtxextError(f"no serving engine runs log-n scaling; {SERVED_BY_CTXEXT}, or patch without --logn")


def engine_rope(model: ServedModel, engine: str) -> tuple[dict, dict, str]:
    """The rope parameters `engine` reads for the method recorded in `model`, any extra config keys, and how."""
    from .forms import rope_form

    spec, params = model.method_and_params()
    L = int(model.record["original_max_position_embeddings"])
    base = float(model.record["rope_parameters"]["rope_theta"])
    if spec.name == "dual_chunk" and engine == "sglang" and model.family == "qwen2":
        resolved = params.resolved(L)
        rope = {"rope_type": "default", "rope_theta": base}
        extra = {
            "dual_chunk_attention_config": {
                "chunk_size": int(resolved.chunk_size),
                "local_size": int(resolved.local_window),
                "original_max_position_embeddings": L,
            }
        }
        return (
            rope,
            extra,
            "SGLang's dual_chunk_attention_config (approximate: SGLang also scales keys by 0.1 ln(len/L) + 1)",
        )
    form = rope_form(
        spec, params, model.rotary_dim, base, L, model.rope_parameters.get("partial_rotary_factor"), "native"
    )
    if not form.native:
        hint = {
            "dual_chunk": "--engine sglang on a Qwen2-family model",
            "self_extend": "llama.cpp's --grp-attn-n/--grp-attn-w on a GGUF",
        }.get(spec.name, SERVED_BY_CTXEXT)
        raise CtxextError(f"{engine} cannot serve {spec.name} exactly: {form.how.split(': ', 1)[-1]}; possible: {hint}")
    return form.rope_parameters, {}, form.how
