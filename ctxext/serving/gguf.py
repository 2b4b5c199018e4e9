"""GGUF in, GGUF out: a method written into a llama.cpp model file as the rope keys and tensor llama.cpp reads.

What llama.cpp does with them (its source, vendored in llama-cpp-python 0.3.36; docs/METHODS.md has the detail):

- `{arch}.rope.freq_base`: the base b. A base change (`ntk`, `theta`) is exactly a new base.
- `{arch}.rope.scaling.type` 'linear' / 'yarn' with `.factor` s and `.original_context_length` L: linear
  divides every frequency by s; yarn is transformers' yarn at beta_fast 32, beta_slow 1 with floor/ceil ends
  (llama, qwen2 and qwen3 read no beta keys), cos/sin scaled by (0.1 ln s + 1) * `.attn_factor`.
- `rope_freqs.weight`, F32, one value per pair: pair i's frequency is divided by it (how Llama 3.1's factors are
  stored). Only the llama architecture (LLaMA, Mistral, Mixtral) loads it; the others pass no factors to their
  rope (or, phi3, only its own rope_factors_long/short pair).
- `{arch}.rope.scaling.attn_factor` multiplies cos and sin for every architecture and scaling type.

Those keys are read for every architecture (llama_model::load_hparams, before its per-architecture part), and the
graphs of the architectures in ARCHITECTURES pass them unchanged to ggml_rope_ext on every layer, except the
sliding-window layers of two (SLIDING_LAYERS_UNSCALED): gemma3 rotates them at base 10000, unscaled, whatever the
file says (Gemma 3's own layout); olmo2 files with a sliding window (OLMo 3) rotate them at the file's freq_base,
unscaled, with attn_factor 1. gemma2's sliding layers read the same keys as its full ones. Source:
ggml-org/llama.cpp, src/llama-model.cpp and src/models/<arch>.cpp (read 2025-2026; docs/guides/serving.md).

Every tensor and key not named above is copied byte for byte (`--outtype same`), or dequantised to f16/f32.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import gguf
import numpy as np
import torch
from tqdm import tqdm

from ..errors import CtxextError
from ..methods import Method, MethodParams, composed_per_pair_factors, get_method, per_pair_factors, rope_inv_freq
from ..methods.frequency import yarn_mscale
from ..methods.remapping import RemapParams
from ..outputs import atomic_file
from ..patching.compose import factor_for
from ..patching.forms import no_native_form

# GGUF names (gguf.MODEL_ARCH_NAMES): LLaMA, Mistral and Mixtral files say "llama"
ARCHITECTURES = (
    "llama",
    "qwen2",
    "qwen3",
    "qwen2moe",
    "qwen3moe",
    "gemma",
    "gemma2",
    "gemma3",
    "phi3",
    "olmo2",
    "granite",
    "starcoder2",
    "stablelm",
    "smollm3",
)
PER_PAIR_ARCHITECTURES = ("llama",)  # the ones whose llama.cpp graph reads rope_freqs
# architecture -> how llama.cpp rotates its sliding-window layers, which it never scales
SLIDING_LAYERS_UNSCALED = {"gemma3": "at base 10000", "olmo2": "at the file's freq_base"}
# per-pair factor tensors: a file that has one is already scaled (phi3's longrope keeps two)
FACTOR_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")
OUTTYPES = ("same", "f16", "f32")
ROPE_FREQS = "rope_freqs.weight"
RECORD_KEY = "ctxext.patch"  # JSON: what ctxext applied (method, parameters, L), for `ctxext export --check`
GGUF_MAGIC = b"GGUF"


@dataclass
class GgufRope:
    """The rope keys (name -> value, `{arch}` filled in) and per-pair factors a method needs in a GGUF file."""

    keys: dict = field(default_factory=dict)
    rope_freqs: list[float] | None = None
    how: str = ""
    composed_with: dict | None = None  # the file's own scaling the method composed with (rope_freqs, attn_factor)


def self_extend_flags(params) -> str:
    """The llama.cpp command line that runs (its approximation of) SelfExtend at group size G and window W."""
    G, W = int(params.group_size), int(params.window)
    W = max(G, W - W % G)  # llama.cpp asserts that the width is a multiple of G
    return f"llama-completion -m MODEL.gguf --grp-attn-n {G} --grp-attn-w {W}"


def refuse_what_llama_cpp_cannot_run(method: Method, params: MethodParams, logn: bool) -> None:
    """A one-line CtxextError naming the nearest thing llama.cpp can express, for what it cannot run at all."""
    name = method.name
    if logn:
        raise CtxextError(
            "llama.cpp has no log-n query scaling; write the method without --logn "
            "(the nearest it can express), or serve with ctxext (ctxext.patch + model.generate)"
        )
    if name == "self_extend":
        raise CtxextError(
            f"self_extend is not stored in a GGUF file: llama.cpp runs an approximation of it at run "
            f"time ({self_extend_flags(params)}; llama-cli in older builds, not llama-server); its "
            f"width is a chunk size, not SelfExtend's neighbour window"
        )
    reason = no_native_form(method, params)
    if reason is not None:
        nearest = {
            "dynamic_yarn": "yarn",
            "rerope": "yarn",
            "leaky_rerope": "yarn",
            "dual_chunk": "yarn",
            "string": "yarn",
            "dpe": "yarn",
            "gali": "yarn",
        }.get(name, name.removeprefix("dynamic_"))
        raise CtxextError(
            f"llama.cpp cannot run {name} ({reason}); the nearest it can express is static "
            f"'{nearest}' (ctxext patch MODEL.gguf --method {nearest} ...)"
        )
    if name == "dynamic_ntk":
        raise CtxextError(
            "llama.cpp has no dynamic scaling; the nearest it can express is static 'ntk' "
            "at the same factor (--method ntk)"
        )


def gguf_rope(
    method: Method,
    params: MethodParams,
    arch: str,
    rotary_dim: int,
    base: float,
    method_length: int,
    logn: bool = False,
    sliding: bool = False,
) -> GgufRope:
    """The GGUF keys and tensor that make llama.cpp compute `method` exactly, or a one-line CtxextError naming
    the nearest thing llama.cpp can express. `sliding`: the file has sliding-window layers."""
    rope = _gguf_rope(method, params, arch, rotary_dim, base, method_length, logn)
    if not (sliding and arch in SLIDING_LAYERS_UNSCALED) or not (rope.keys or rope.rope_freqs):
        return rope
    return _on_full_attention_layers_only(rope, arch)


def _on_full_attention_layers_only(rope: GgufRope, arch: str) -> GgufRope:
    """`rope` for an architecture whose sliding layers llama.cpp rotates unscaled: what reaches them too is
    refused (it would change layers that a full-attention-only patch leaves alone)."""
    kept = SLIDING_LAYERS_UNSCALED[arch]
    if arch == "gemma3" and "rope.scaling.attn_factor" in rope.keys:
        raise CtxextError(
            f"llama.cpp's gemma3 multiplies its sliding layers' cos/sin by rope.scaling.attn_factor too, which "
            f"rotate {kept}, unscaled; write the method at its default attention factor"
        )
    if arch == "olmo2" and "rope.freq_base" in rope.keys:
        raise CtxextError(
            "llama.cpp's olmo2 rotates its sliding layers at the file's freq_base too, so a base change would "
            "reach them; the nearest it can express on the full-attention layers only is 'yarn' or 'linear'"
        )
    return GgufRope(rope.keys, rope.rope_freqs, f"{rope.how}, on the full-attention layers (sliding: {kept})")


def _gguf_rope(method, params, arch, rotary_dim, base, method_length, logn) -> GgufRope:
    refuse_what_llama_cpp_cannot_run(method, params, logn)
    name = method.name
    L = int(method_length)
    s = float(params.factor)
    scaled = {"rope.scaling.original_context_length": L}
    if name == "none" or s == 1 and method.new_base is None:
        return GgufRope({}, None, "plain RoPE")
    if method.new_base is not None:
        new_base = float(method.new_base(rotary_dim, base, params))
        return GgufRope({"rope.freq_base": new_base}, None, f"a base change: freq_base {base:g} -> {new_base:g}")
    if name == "linear":
        return GgufRope(
            {**scaled, "rope.scaling.type": "linear", "rope.scaling.factor": s}, None, "llama.cpp's linear scaling"
        )
    _, attention_factor = method.inv_freq_fn(rotary_dim, base, L, params)
    llama_cpp_yarn = (
        name == "yarn"
        and params.ramp == "index"
        and params.truncate
        and params.beta_fast == 32
        and params.beta_slow == 1
    )
    if llama_cpp_yarn:
        keys = {**scaled, "rope.scaling.type": "yarn", "rope.scaling.factor": s}
        if not math.isclose(attention_factor, yarn_mscale(s), rel_tol=1e-9):
            keys["rope.scaling.attn_factor"] = attention_factor / yarn_mscale(s)
        return GgufRope(keys, None, "llama.cpp's yarn")
    pairs = rotary_dim // 2
    if name == "longrope" and list(params.short_factor or [1.0] * pairs) != list(params.long_factor or [s] * pairs):
        raise CtxextError(
            "llama.cpp switches longrope's factor sets by context size only for Phi-3 files; the "
            "nearest it can express is one set: --short-factor equal to --long-factor"
        )
    if arch not in PER_PAIR_ARCHITECTURES:
        near = "'yarn' at beta_fast 32, beta_slow 1" if name in ("yarn", "ntk_by_parts") else "'yarn' or 'ntk'"
        raise CtxextError(
            f"llama.cpp reads per-pair frequency factors (rope_freqs) only for the llama architecture "
            f"(LLaMA, Mistral, Mixtral), not {arch}, so {name} cannot be written exactly; the nearest it can "
            f"express is {near}"
        )
    keys = dict(scaled)
    if not math.isclose(attention_factor, 1.0, rel_tol=1e-12):
        keys["rope.scaling.attn_factor"] = float(attention_factor)
    factors = per_pair_factors(method, params, rotary_dim, base, L)
    return GgufRope(keys, factors, "per-pair factors in rope_freqs (llama.cpp divides pair i's frequency by them)")


# ------------------------------------------------------------------------------------------- reading
def is_gguf(path) -> bool:
    path = Path(path)
    return path.suffix.lower() == ".gguf" or (path.is_file() and _magic(path) == GGUF_MAGIC)


def _magic(path: Path) -> bytes:
    with open(path, "rb") as f:
        return f.read(4)


def read_gguf(path):
    """A gguf.GGUFReader over `path`, or a one-line CtxextError for a missing, truncated or non-GGUF file."""
    path = Path(path)
    if not path.is_file():
        raise CtxextError(f"GGUF file '{path}' does not exist")
    if _magic(path) != GGUF_MAGIC:
        raise CtxextError(f"'{path}' is not a GGUF file (it does not start with the GGUF magic)")
    try:
        return gguf.GGUFReader(path, "r")
    except (ValueError, IndexError, OSError, KeyError) as error:
        raise CtxextError(f"'{path}' is not a readable GGUF file (truncated or damaged?): {error}") from None


def field_value(reader, key: str, default=None):
    found = reader.get_field(key)
    return found.contents() if found is not None else default


@dataclass
class GgufModel:
    """What ctxext needs to know of a GGUF model: architecture, rope sizes and what a patch recorded."""

    arch: str
    rotary_dim: int
    base: float
    context_length: int
    scaling_type: str | None
    has_rope_freqs: bool
    record: dict | None
    sliding_window: int | None = None

    @property
    def native_length(self) -> int:
        """L: the length before ctxext's patch (or the file's context length if unpatched)."""
        return int(self.record["original_max_position_embeddings"]) if self.record else self.context_length


def describe(reader, path) -> GgufModel:
    arch = field_value(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise CtxextError(
            f"GGUF '{path}' is a '{arch}' model; ctxext supports the GGUF architectures "
            f"{', '.join(ARCHITECTURES)} (LLaMA, Mistral and Mixtral files are 'llama')"
        )
    heads = field_value(reader, f"{arch}.attention.head_count")
    head_dim = (
        field_value(reader, f"{arch}.attention.key_length") or field_value(reader, f"{arch}.embedding_length") // heads
    )
    record = field_value(reader, RECORD_KEY)
    return GgufModel(
        arch=arch,
        rotary_dim=int(field_value(reader, f"{arch}.rope.dimension_count", head_dim)),
        base=float(field_value(reader, f"{arch}.rope.freq_base", 10000.0)),
        context_length=int(field_value(reader, f"{arch}.context_length")),
        scaling_type=field_value(reader, f"{arch}.rope.scaling.type"),
        has_rope_freqs=any(t.name in FACTOR_TENSORS for t in reader.tensors),
        record=json.loads(record) if record else None,
        sliding_window=field_value(reader, f"{arch}.attention.sliding_window") or None,
    )


def scaled_layers(arch: str, sliding: bool) -> str:
    """Which layers llama.cpp scales from a file's rope keys: 'full' (its sliding layers stay unscaled) or 'all'."""
    return "full" if sliding and arch in SLIDING_LAYERS_UNSCALED else "all"


def check_layer_types(arch: str, sliding: bool, layer_types: str | None) -> None:
    """A one-line CtxextError where --layer-types asks for other layers than llama.cpp scales in this file."""
    if layer_types is None:
        return
    scaled = scaled_layers(arch, sliding)
    asked = layer_types.strip()
    accepted = {"full": {"full", "full_attention"}, "all": {"all"} | (set() if sliding else {"full"})}[scaled]
    if asked not in accepted:
        what = "its full-attention layers only" if scaled == "full" else "every layer"
        raise CtxextError(
            f"llama.cpp scales {what} of this {arch} file from its rope keys, so --layer-types {asked} cannot "
            f"be written; use --layer-types {scaled}"
        )


# ------------------------------------------------------------------------------------------- writing
@dataclass
class PatchedGguf:
    output: Path
    label: str
    rope: GgufRope
    context_length_before: int
    context_length: int
    outtype: str


def patch_gguf(source, method_config, output, overwrite: bool = False, outtype: str = "same") -> PatchedGguf:
    """Write a copy of the GGUF file `source` with `method_config` in its rope keys (and rope_freqs), atomically.
    The source is never written to."""
    if outtype not in OUTTYPES:
        raise CtxextError(f"unknown --outtype '{outtype}'; choose one of: {', '.join(OUTTYPES)}")
    source, output = Path(source), Path(output)
    _check_gguf_output(source, output, overwrite)
    reader = read_gguf(source)
    model = describe(reader, source)
    if method_config.query_temperature is not None:
        raise CtxextError(
            "llama.cpp has no query temperature (--query-temperature); write the method without it, or serve "
            "with ctxext (ctxext.patch + model.generate)"
        )
    spec = get_method(method_config.method)
    scaled = model.record or model.has_rope_freqs or model.scaling_type not in (None, "none")
    if scaled:
        check_composable(reader, model, source, method_config)
    L = int(method_config.original_max_position_embeddings or model.context_length)
    factor = factor_for(method_config.target_length, method_config.factor, L)
    params = spec.make_params(factor=factor, **method_config.params)
    sliding = model.sliding_window is not None
    check_layer_types(model.arch, sliding, method_config.layer_types)
    if scaled:
        rope = composed_gguf_rope(reader, model, spec, params, method_config.logn)
    else:
        rope = gguf_rope(spec, params, model.arch, model.rotary_dim, model.base, L, method_config.logn, sliding)
    new_length = int(round(L * float(params.factor)))

    arch = model.arch
    changed = {f"{arch}.{key}": value for key, value in rope.keys.items()}
    changed[f"{arch}.context_length"] = new_length
    record = {
        "method": spec.name,
        "params": _json_params(params),
        "original_max_position_embeddings": L,
        "rope_theta": model.base,
        "logn": bool(method_config.logn),
        "written_as": rope.how,
        "layers": scaled_layers(arch, sliding),
    }
    if rope.composed_with is not None:  # what `ctxext export --check`'s reference composes with again
        record["source_scaling"] = rope.composed_with
    changed[RECORD_KEY] = json.dumps(record, sort_keys=True)
    if outtype != "same":
        changed["general.file_type"] = int(
            gguf.LlamaFileType.ALL_F32 if outtype == "f32" else gguf.LlamaFileType.MOSTLY_F16
        )

    with atomic_file(output) as staging:
        _write(reader, staging, arch, changed, rope.rope_freqs, outtype)
    return PatchedGguf(output.resolve(), method_config.label, rope, model.context_length, new_length, outtype)


def composition_refusal(arch: str, shipped: str) -> str | None:
    """Why llama.cpp cannot compute a static frequency method composed with the scaling a GGUF file carries, or
    None where it can exactly. `shipped`: 'rope_freqs' (per-pair factors: llama.cpp's converter stores Llama 3.1's
    llama3 scaling so), 'longrope' (Phi-3's rope_factors_long/short), or the file's rope.scaling.type (yarn,
    linear). Only per-pair factors on an architecture whose graph reads rope_freqs compose exactly: the composition
    is again per-pair factors (ctxext.methods.composed_per_pair_factors) with an attention factor
    (rope.scaling.attn_factor, which every architecture reads); llama.cpp's yarn and linear take one factor, and a
    yarn composed with a yarn is not one yarn."""
    if shipped == "rope_freqs" and arch in PER_PAIR_ARCHITECTURES:
        return None
    if shipped == "longrope":
        what = "longrope's two factor sets (rope_factors_long/short), which llama.cpp switches by context size"
    elif shipped == "rope_freqs":
        what = f"per-pair rope_freqs, which llama.cpp's {arch} graph does not read"
    else:
        what = f"llama.cpp's {shipped} scaling, whose one factor cannot carry the composed per-pair factors"
    return (
        f"the file ships {what}, and the composition is per-pair factors that llama.cpp reads only as rope_freqs on "
        f"the llama architecture ({', '.join(PER_PAIR_ARCHITECTURES)}); serve the patched checkpoint with vLLM, "
        f"SGLang or transformers"
    )


def shipped_scaling(model: GgufModel) -> str:
    """What scaling a GGUF file carries, in `composition_refusal`'s words."""
    if model.scaling_type not in (None, "none"):
        return str(model.scaling_type)
    return "rope_freqs" if model.has_rope_freqs and model.arch != "phi3" else "longrope"


def check_composable(reader, model: GgufModel, source: Path, method_config) -> None:
    """A one-line CtxextError where an already-scaled GGUF cannot be extended exactly in llama.cpp."""
    if model.record:
        raise CtxextError(
            f"'{source}' is already patched by ctxext ({model.record['method']}); patch the original model's GGUF"
        )
    if method_config.original_max_position_embeddings is not None or method_config.replace_shipped:
        raise CtxextError(
            f"'{source}' is already scaled ({_scaling_summary(model)}); replacing its scaling (an explicit L, "
            "--replace-shipped) is not written to GGUF: extend it from its context (--factor or --target-length)"
        )
    if any(t.name in FACTOR_TENSORS[1:] for t in reader.tensors):
        raise CtxextError(
            f"'{source}' cannot be extended exactly in llama.cpp: {composition_refusal(model.arch, 'longrope')}"
        )
    reason = composition_refusal(model.arch, shipped_scaling(model))
    if reason is not None:
        raise CtxextError(f"'{source}' cannot be extended exactly in llama.cpp: {reason}")


def composed_gguf_rope(reader, model: GgufModel, method: Method, params: MethodParams, logn: bool) -> GgufRope:
    """The rope keys and rope_freqs of `method` composed with the file's per-pair rope_freqs (its trained frequencies
    at its context_length C, the plain ones divided by them), as `ctxext patch` composes a checkpoint's llama3 x8:
    pair i's factor is k_i D_i, the attention factor the file's rope.scaling.attn_factor times the method's at C."""
    refuse_what_llama_cpp_cannot_run(method, params, logn)
    if issubclass(method.params_cls, RemapParams) or method.is_dynamic(params):
        raise CtxextError(f"{method.name} does not compose with the file's rope_freqs; use a static frequency method")
    tensor = next(t for t in reader.tensors if t.name == ROPE_FREQS)
    shipped = torch.tensor(np.asarray(tensor.data, dtype=np.float64).reshape(-1))
    plain = rope_inv_freq(model.rotary_dim, model.base).double()
    factors, attention = composed_per_pair_factors(
        method, params, plain / shipped, model.rotary_dim, model.base, model.context_length
    )
    shipped_attention = float(field_value(reader, f"{model.arch}.rope.scaling.attn_factor", 1.0))
    attention *= shipped_attention
    keys = {} if math.isclose(attention, 1.0, rel_tol=1e-12) else {"rope.scaling.attn_factor": float(attention)}
    how = f"per-pair factors in rope_freqs: {method.name} composed with the file's rope_freqs (C = {model.context_length})"
    composed_with = {"rope_freqs": shipped.tolist(), "attn_factor": shipped_attention}
    return GgufRope(keys, factors, how, composed_with)


def _write(reader, path: Path, arch: str, changed: dict, rope_freqs, outtype: str) -> None:
    writer = gguf.GGUFWriter(path, arch=arch, endianess=reader.endianess)
    alignment = field_value(reader, "general.alignment")
    if alignment is not None:
        writer.data_alignment = alignment
    pending = dict(changed)
    for found in reader.fields.values():
        if found.name == "general.architecture" or found.name.startswith("GGUF."):
            continue  # the writer writes these itself
        value_type = found.types[0]
        sub_type = found.types[-1] if value_type == gguf.GGUFValueType.ARRAY else None
        if found.name in pending:
            writer.add_key_value(found.name, pending.pop(found.name), value_type, sub_type=sub_type)
        else:
            writer.add_key_value(found.name, found.contents(), value_type, sub_type=sub_type)
    for key, value in pending.items():  # keys the source did not have
        writer.add_key_value(key, value, _value_type(value))

    kept = [t for t in reader.tensors if rope_freqs is None or t.name != ROPE_FREQS]  # a composed one replaces it
    tensors = [(t, _converted(t, outtype)) for t in kept]
    for tensor, data in tensors:
        if data is None:
            writer.add_tensor_info(
                tensor.name, tensor.data.shape, tensor.data.dtype, tensor.data.nbytes, tensor.tensor_type
            )
        else:
            writer.add_tensor_info(tensor.name, data.shape, data.dtype, data.nbytes)
    freqs = None if rope_freqs is None else np.asarray(rope_freqs, dtype=np.float32)
    if freqs is not None:
        writer.add_tensor_info(ROPE_FREQS, freqs.shape, freqs.dtype, freqs.nbytes)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    total = sum(int(t.n_bytes) for t in kept)
    with tqdm(total=total, unit="B", unit_scale=True, desc="writing GGUF", leave=False) as bar:
        for tensor, data in tensors:
            writer.write_tensor_data(tensor.data if data is None else data, tensor_endianess=reader.endianess)
            bar.update(int(tensor.n_bytes))
    if freqs is not None:
        writer.write_tensor_data(freqs, tensor_endianess=reader.endianess)
    writer.close()


def _converted(tensor, outtype: str):
    """None to copy the tensor's bytes, else its values as f32/f16 (1-D tensors stay f32, as llama.cpp's converter
    keeps norms)."""
    if outtype == "same":
        return None
    values = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
    if outtype == "f16" and len(tensor.shape) > 1:
        values = values.astype(np.float16)
    if values.dtype == tensor.data.dtype and tensor.tensor_type in (
        gguf.GGMLQuantizationType.F32,
        gguf.GGMLQuantizationType.F16,
    ):
        return None  # already in the asked type: copy the bytes
    return values


def _value_type(value):
    if isinstance(value, bool):
        return gguf.GGUFValueType.BOOL
    if isinstance(value, int):
        return gguf.GGUFValueType.UINT32
    if isinstance(value, float):
        return gguf.GGUFValueType.FLOAT32
    return gguf.GGUFValueType.STRING


def _json_params(params: MethodParams) -> dict:
    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in params.to_dict().items() if v is not None}


def _scaling_summary(model: GgufModel) -> str:
    if model.record:
        return f"ctxext patched it with {model.record['method']}"
    if model.scaling_type not in (None, "none"):
        return f"rope.scaling.type {model.scaling_type}"
    return "it carries per-pair rope factors"


def _check_gguf_output(source: Path, output: Path, overwrite: bool) -> None:
    if output.exists() and output.resolve() == source.resolve():
        raise CtxextError(f"--output '{output}' is the input file; write the patched GGUF to a new file")
    if output.is_dir():
        raise CtxextError(f"--output '{output}' is a directory; a GGUF input is written as one .gguf file")
    if output.exists() and not overwrite:
        raise CtxextError(f"--output '{output}' already exists; pass --overwrite to replace it")
