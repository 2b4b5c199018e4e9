"""Which engines serve a patched model, and how: the table of `ctxext export MODEL --check`.

Each row is exact (the engine computes what ctxext computes), approximate (it runs, and `how` says what differs),
or no (with what to do instead). What each engine reads was taken from its source: transformers 5.24, vLLM 0.33
(and 0.11-0.25), SGLang 0.5.23, llama.cpp as vendored by llama-cpp-python 0.3.36 (docs/METHODS.md, "Serving").
The vLLM and SGLang rows for rope types were run: benchmarks/engine_parity.py runs their own rotary code (vLLM
0.33.0 and SGLang 0.5.23 from their wheels; `get_rope` built from the config.json `ctxext patch` wrote, as their
model code builds it, started as `serving` says) against plain transformers' load of the same checkpoint, for every
static frequency method at its defaults and other parameters, integer and float factors, longrope with short !=
long factors, and dynamic NTK, on LLaMA and Qwen2; it fails when a row here says exact and the run does not (the
table: docs/guides/serving.md). `ctxext export --check` runs the same comparison where vLLM or SGLang is installed.
Not run: their attention-level rows (dual chunk attention is CUDA only), the 'proportional' rows, and what their
multimodal-RoPE and DeepSeek code does with a rope type (`_type_the_family_code_builds`, read from their source).
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import CtxextError
from ..methods import compute_inv_freq, get_method
from ..methods.remapping import RemapParams
from ..outputs import atomic_output_dir, check_output_dir
from ..patching.families import is_nested, own_partial_rotary_factor
from ..patching.forms import for_engines, rope_form
from ..record_file import read_record, write_record
from .forms import text_config_of, with_both_spellings, with_text_config
from .gguf import composition_refusal, describe, gguf_rope, is_gguf, read_gguf, self_extend_flags

ENGINES = ("transformers", "vllm", "sglang", "llama.cpp")
SERVED_BY_CTXEXT = "serve it with ctxext itself: ctxext serve DIR (OpenAI-compatible), or ctxext.patch then generate"
# How each engine's verdict is known, in the docs' evidence words: tested (a test of the default or slow tier),
# measured (a benchmark run, in BENCHMARKS.md), read (from the engine's source at a named version).
READ_FROM = {
    "vllm": "vLLM 0.33.0's source",
    "sglang": "SGLang 0.5.23's source",
    "llama.cpp": "llama.cpp as vendored by llama-cpp-python 0.3.36",
}
MEASURED_BY = {
    "vllm": "vLLM 0.33.0's own rotary code on the written config (benchmarks/engine_parity.py; its server not run)",
    "sglang": "SGLang 0.5.23's own rotary code on the written config (benchmarks/engine_parity.py; its server not run)",
    "llama.cpp": "llama.cpp's perplexity on the GGUF ctxext wrote (benchmarks/llamacpp_parity.py)",
}


def evidence(engine: str, level: str) -> str:
    """How the verdict `level` of `engine` is known: transformers' is tested; another engine's 'no' is read from
    its source; its 'exact' and 'approximate' are measured with its own code."""
    if engine == "transformers":
        return "tested: a fresh process reloads each written form with the patched logits (tests/test_roundtrip.py)"
    if level == "no":
        return f"read: {READ_FROM[engine]}"
    return f"measured: {MEASURED_BY[engine]}"


VLLM_SGLANG_TYPES = ("default", "linear", "dynamic", "yarn", "llama3", "longrope")
# transformers model_type -> the GGUF architecture llama.cpp's converter writes for it (ctxext.serving.gguf)
GGUF_ARCH = {
    "llama": "llama",
    "mistral": "llama",
    "mixtral": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "qwen2_moe": "qwen2moe",
    "qwen3_moe": "qwen3moe",
    "gemma": "gemma",
    "gemma2": "gemma2",
    "gemma3_text": "gemma3",
    "phi3": "phi3",
    "olmo2": "olmo2",
    "granite": "granite",
    "starcoder2": "starcoder2",
    "stablelm": "stablelm",
    "smollm3": "smollm3",
}


@dataclass
class Support:
    engine: str
    level: str  # exact | approximate | no
    how: str
    checked: str = "not run here"


@dataclass(frozen=True)
class Serving:
    """How `ctxext export` says to start vLLM or SGLang on a checkpoint: the longest sequence it serves (L x factor)
    and what makes the engine's rotary code reach it."""

    engine: str
    length: int
    hf_overrides: dict = field(default_factory=dict)  # vLLM's --hf-overrides
    env: dict = field(default_factory=dict)  # environment variables SGLang needs

    def flags(self) -> str:
        if self.engine == "vllm":
            overrides = f" --hf-overrides '{json.dumps(self.hf_overrides)}'" if self.hf_overrides else ""
            return f"--max-model-len {self.length}{overrides}"
        return f"--context-length {self.length}"


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
        config = text_config_of(self.config)
        head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
        return int(head_dim * (own_partial_rotary_factor(self.rope_parameters) or 1.0))

    @property
    def logn(self) -> bool:
        return bool((self.attention or {}).get("logn") or (self.record or {}).get("logn"))

    @property
    def query_scaling(self) -> str | None:
        """What ctxext's attention does to queries here that no engine option runs, or None."""
        if self.logn:
            return "log-n scaling"
        recorded = (self.attention or {}).get("query_temperature")
        return None if recorded is None else "the query temperature (ctxext_attention.query_temperature)"

    @property
    def nested(self) -> bool:
        """rope_parameters nested by layer type (Gemma 3)."""
        return is_nested(self.rope_parameters)


def read_served_model(path) -> ServedModel:
    """Describe a checkpoint directory or a GGUF file, or a one-line CtxextError."""
    path = Path(path)
    if is_gguf(path):
        model = describe(read_gguf(path), path)
        return ServedModel(path, "gguf", model.arch, {}, None, model.record)
    if not (path / "config.json").is_file():
        raise CtxextError(f"'{path}' is neither a checkpoint directory (with config.json) nor a GGUF file")
    config = json.loads((path / "config.json").read_text())
    text = text_config_of(config)
    rope = text.get("rope_parameters") or {
        **(text.get("rope_scaling") or {"rope_type": "default"}),
        "rope_theta": text.get("rope_theta", 10000.0),
    }
    written = read_record(path)
    record = None if written is None else written.values
    return ServedModel(
        path, "checkpoint", config.get("model_type", "?"), dict(rope), text.get("ctxext_attention"), record, config
    )


def declared_max_position_embeddings(model: ServedModel) -> int:
    """config.json's max_position_embeddings (a vision-language model's text model's)."""
    return int(text_config_of(model.config).get("max_position_embeddings") or 0)


def served_length(model: ServedModel) -> int:
    """The context the checkpoint declares: config.json's max_position_embeddings, or L x factor from ctxext.yaml
    (the length the method was chosen for) where that is longer (dynamic NTK keeps L in the config)."""
    declared = declared_max_position_embeddings(model)
    if model.record and model.record.get("factor"):
        chosen = int(round(model.record["original_max_position_embeddings"] * float(model.record["factor"])))
        return max(chosen, declared)
    return declared


def serving(model: ServedModel, engine: str) -> Serving:
    """The context vLLM or SGLang is started with, and the overrides it needs where config.json's
    max_position_embeddings stops short of it (dynamic NTK keeps L there, which transformers' 'dynamic' scales from):
    vLLM's cos/sin cache ends at max_position_embeddings, and SGLang refuses a longer --context-length."""
    length = served_length(model)
    short = (declared_max_position_embeddings(model) or length) < length
    if engine == "vllm":
        return Serving(engine, length, {"max_position_embeddings": length} if short else {})
    return Serving(engine, length, env={"SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN": "1"} if short else {})


def engine_table(model: ServedModel) -> list[Support]:
    """Each engine's verdict on `model`: the first rule of the engine's ordered table (ENGINE_RULES) that speaks
    for it; each table's last rule always does."""
    return [next(row for rule in ENGINE_RULES[engine] if (row := rule(model, engine))) for engine in ENGINES]


def _attention_method(model: ServedModel) -> str | None:
    return (model.attention or {}).get("method") or (model.method if _is_remapping(model.method) else None)


def _is_remapping(method: str) -> bool:
    return issubclass(get_method(method).params_cls, RemapParams)


def _transformers_gguf(model: ServedModel, engine: str) -> Support | None:
    if model.kind != "gguf":
        return None
    if model.method == "none" or get_method(model.method).new_base is not None:
        return Support(engine, "exact", "its GGUF loader reads rope.freq_base, all this file changes")
    return Support(
        engine,
        "no",
        "its GGUF loader reads only rope.freq_base, not the scaling keys or "
        "rope_freqs; load the patched checkpoint directory instead",
    )


def _transformers_nested_types_it_knows(model: ServedModel, engine: str) -> Support | None:
    if not model.nested or _attention_method(model) or model.query_scaling:
        return None
    types = {name: values.get("rope_type", "default") for name, values in model.rope_parameters.items()}
    if any(t.startswith("ctxext_") for t in types.values()):
        return None
    listed = ", ".join(f"{name}: {t}" for name, t in types.items())
    return Support(engine, "exact", f"reads rope_parameters nested by layer type ({listed})")


def _transformers_needs_ctxext(model: ServedModel, engine: str) -> Support | None:
    if not (model.nested or _rope_type(model).startswith("ctxext_") or _attention_method(model) or model.query_scaling):
        return None
    what = model.query_scaling if model.query_scaling and not _attention_method(model) else f"'{model.method}'"
    return Support(
        engine, "no", f"{what} runs only with ctxext: `import ctxext` before loading (it re-installs the method)"
    )


def _transformers_reads_the_type(model: ServedModel, engine: str) -> Support:
    return Support(
        engine,
        "exact",
        f"reads rope type '{_rope_type(model)}' (rope_parameters in 5.x, rope_scaling + rope_theta in 4.x)",
    )


def _vllm_or_sglang_reads_the_type(model: ServedModel, engine: str) -> Support:
    return Support(
        engine,
        "exact",
        f"reads rope type '{_rope_type(model)}' with the keys written; serve with {serving(model, engine).flags()}",
    )


def _rope_type(model: ServedModel) -> str:
    return model.rope_parameters.get("rope_type", "default")


def _rewrite_hint(engine: str) -> str:
    return f"rewrite with `ctxext export MODEL --engine {engine} -o OUT`"


def _gguf_file(model: ServedModel, engine: str) -> Support | None:
    if model.kind == "gguf":
        return Support(engine, "no", "serve the patched checkpoint directory (ctxext patch on it), not the GGUF file")
    return None


def _sglang_dual_chunk_on_qwen2(model: ServedModel, engine: str) -> Support | None:
    if not (_attention_method(model) == "dual_chunk" and engine == "sglang" and model.family == "qwen2"):
        return None
    if "dual_chunk_attention_config" in text_config_of(model.config):
        return Support(
            engine,
            "approximate",
            "its Dual Chunk Attention (dual_chunk_attention_config); it also "
            "scales keys by 0.1 ln(len/L) + 1, which ctxext does not; CUDA only; not run here",
        )
    return Support(
        engine,
        "approximate",
        "after `ctxext export MODEL --engine sglang --allow-approximate -o OUT`, which writes "
        "dual_chunk_attention_config; SGLang also scales keys by 0.1 ln(len/L) + 1; not run here",
    )


def _dual_chunk_elsewhere(model: ServedModel, engine: str) -> Support | None:
    if _attention_method(model) != "dual_chunk":
        return None
    where = (
        "vLLM's Dual Chunk Attention went with its V0 backends"
        if engine == "vllm"
        else f"SGLang's Dual Chunk Attention is for the Qwen2 family, not {model.family}"
    )
    return Support(engine, "no", f"{where}; {SERVED_BY_CTXEXT}")


def _other_attention_method(model: ServedModel, engine: str) -> Support | None:
    attention = _attention_method(model)
    if not (attention or model.query_scaling):
        return None
    return Support(engine, "no", f"no {engine} option runs {attention or model.query_scaling}; {SERVED_BY_CTXEXT}")


def _nested(model: ServedModel, engine: str) -> Support | None:
    return _nested_by_layer_type(model, engine) if model.nested else None


def _unknown_type(model: ServedModel, engine: str) -> Support | None:
    if _rope_type(model) in VLLM_SGLANG_TYPES:
        return None
    return Support(
        engine,
        "no",
        f"'{_rope_type(model)}' is not a type {engine} knows (it refuses to load); rewrite it "
        f"with `ctxext export MODEL --engine {engine} -o OUT` if the method has a native form",
    )


def _integer_linear_factor(model: ServedModel, engine: str) -> Support | None:
    factor = model.rope_parameters.get("factor")
    if not (_rope_type(model) == "linear" and isinstance(factor, int)):
        return None
    return Support(
        engine,
        "no",
        f"its linear rope takes a float factor (anything else for a list): the integer {factor} fails "
        f"to load ('int' object is not iterable); {_rewrite_hint(engine)} (written as a float)",
    )


def _dynamic(model: ServedModel, engine: str) -> Support | None:
    return _dynamic_ntk(model, engine) if _rope_type(model) == "dynamic" else None


def _longrope_attention_factor(model: ServedModel, engine: str) -> Support | None:
    rope = model.rope_parameters
    if not (_rope_type(model) == "longrope" and "attention_factor" in rope and "short_mscale" not in rope):
        return None
    return Support(
        engine,
        "approximate",
        f"it ignores attention_factor and computes its own cos/sin scale; {_rewrite_hint(engine)} "
        "(adds short_mscale/long_mscale)",
    )


def _longrope(model: ServedModel, engine: str) -> Support | None:
    return _longrope_switch(model, engine) if _rope_type(model) == "longrope" else None


def _yarn_attention_factor(model: ServedModel, engine: str) -> Support | None:
    rope = model.rope_parameters
    if not (_rope_type(model) == "yarn" and rope.get("attention_factor") is not None and "attn_factor" not in rope):
        return None
    return Support(
        engine,
        "approximate" if engine == "sglang" else "exact",
        "SGLang and vLLM before 0.33 ignore yarn's attention_factor (attn_factor is what they read)",
    )


# Read from the engines' source, not run (benchmarks/engine_parity.py runs the Llama and Qwen2 code only):
# - get_rope (vLLM 0.33.0 vllm/model_executor/layers/rotary_embedding/__init__.py, SGLang 0.5.23
#   sglang/srt/layers/rotary_embedding/factory.py) builds multimodal RoPE (mrope_section: Qwen2-VL, Qwen3.5, ...) for
#   the 'default' and 'yarn' types only; any other type gets a one-position rotary, which the family's 3-row
#   positions do not fit.
# - their DeepSeek V2/V3 code (models/deepseek_v2.py in both) rewrites every rope type but 'default' to DeepSeek's yarn
#   (vLLM: 'deepseek_llama_scaling' where attention_factor is 1.0) before get_rope, so only yarn is served as written.
MROPE_TYPES = ("default", "yarn")
DEEPSEEK_CODE = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "DeepseekV32ForCausalLM")


def _type_the_family_code_builds(model: ServedModel, engine: str) -> Support | None:
    """A 'no' where the engine's code for this family builds another rope than the type written, else None."""
    rope = model.rope_parameters
    rope_type = rope.get("rope_type", "default")
    if "mrope_section" in rope and rope_type not in MROPE_TYPES:
        return Support(
            engine,
            "no",
            f"its get_rope builds multimodal RoPE (mrope_section) for the {' and '.join(MROPE_TYPES)} types only, and "
            f"'{rope_type}' as a one-position rotary (read from its source); {SERVED_BY_CTXEXT}",
        )
    if not set(model.config.get("architectures") or ()) & set(DEEPSEEK_CODE):
        return None
    if rope_type not in ("default", "yarn"):
        return Support(
            engine,
            "no",
            f"its DeepSeek code serves every scaled rope type as DeepSeek's yarn, so '{rope_type}' would run as yarn "
            f"(read from its source); {SERVED_BY_CTXEXT}",
        )
    if engine == "vllm" and rope_type == "yarn" and rope.get("attention_factor") == 1.0:
        return Support(
            engine,
            "no",
            f"its DeepSeek code serves a yarn whose attention_factor is 1.0 as 'deepseek_llama_scaling', not yarn (read "
            f"from its source); {SERVED_BY_CTXEXT}",
        )
    return None


def _vllm_gpt_oss_builds_yarn(model: ServedModel, engine: str) -> Support | None:
    """vLLM's gpt_oss code (vllm/model_executor/models/gpt_oss.py, OAIAttention; read from its source as of its
    rope_parameters API, not run) builds rope type 'yarn' from the config's factor, original length, beta_fast and
    beta_slow whatever type is written; SGLang's passes the config's rope_scaling to get_rope as written."""
    rope_type = _rope_type(model)
    if not (engine == "vllm" and model.family == "gpt_oss" and rope_type != "yarn"):
        return None
    return Support(
        engine,
        "no",
        f"its gpt_oss code builds yarn from the config's factor and beta keys whatever type is written, so "
        f"'{rope_type}' would not load as written (read from its source); serve it with SGLang, transformers, or "
        f"{SERVED_BY_CTXEXT.split(': ', 1)[0].removeprefix('serve it with ')}",
    )


# Read from the engines' model code (vLLM 0.33.0 vllm/model_executor/models/gemma3.py: get_rope per layer from
# rope_parameters[layer_type]; SGLang 0.5.23 sglang/srt/models/gemma3_causal.py: rope_type "default" on every
# layer, only each type's rope_theta read). Other families with nested rope parameters were not read.
NESTED_READERS = {("vllm", "gemma3_text"), ("vllm", "gemma3")}
NESTED_IGNORED = {("sglang", "gemma3_text"), ("sglang", "gemma3")}


def _nested_by_layer_type(model: ServedModel, engine: str) -> Support:
    """rope_parameters nested by layer type: what each engine's model code for this family does with them."""
    types = {name: values.get("rope_type", "default") for name, values in model.rope_parameters.items()}
    scaled = {name: t for name, t in types.items() if t != "default"}
    if (engine, model.family) in NESTED_IGNORED and scaled:
        return Support(
            engine,
            "no",
            f"its {model.family} code builds plain RoPE on every layer from each type's rope_theta alone, so the "
            f"scaling of {', '.join(scaled)} is silently dropped (read from its source); {SERVED_BY_CTXEXT}",
        )
    if (engine, model.family) not in NESTED_READERS | NESTED_IGNORED:
        return Support(
            engine,
            "no",
            f"rope_parameters nested by layer type: how {engine}'s {model.family} code reads them was not checked; "
            f"{SERVED_BY_CTXEXT}",
        )
    unknown = sorted(t for t in types.values() if t not in VLLM_SGLANG_TYPES)
    if unknown:
        return Support(engine, "no", f"'{unknown[0]}' is not a type {engine} knows (it refuses to load)")
    listed = ", ".join(f"{name}: {t}" for name, t in types.items())
    return Support(
        engine,
        "exact",
        f"its {model.family} code builds each layer's rope from its type's entry ({listed}; read from its source, "
        f"per-type rotary math as run for flat configs); serve with {serving(model, engine).flags()}",
    )


def _dynamic_ntk(model: ServedModel, engine: str) -> Support:
    """vLLM and SGLang compute dynamic NTK's base once, for the longest length; vLLM needs the flags that take it past
    L and the key that scales it (benchmarks/engine_parity.py: both fail or serve plain RoPE without them)."""
    serve = serving(model, engine)
    s = float(model.rope_parameters.get("factor", 1.0))
    if engine == "vllm" and "max_trained_positions" not in model.rope_parameters:
        return Support(
            engine,
            "no",
            "its dynamic NTK scales the base by max_position_embeddings / max_trained_positions, which this "
            "config.json lacks (it would serve plain RoPE); rewrite with `ctxext export MODEL --engine vllm -o OUT`",
        )
    if engine == "vllm":
        start = f"`{serve.flags()}` (else its cos/sin cache ends at max_position_embeddings: IndexError past it)"
    elif serve.env:
        env = " ".join(f"{name}={value}" for name, value in serve.env.items())
        start = f"`{serve.flags()}` and `{env}` (else it refuses a context past max_position_embeddings)"
    else:
        start = f"`{serve.flags()}`"
    return Support(
        engine,
        "approximate",
        f"its dynamic NTK fixes the base at every length to transformers' for {serve.length} tokens "
        f"(b x ({s:g}^2 - {s:g} + 1)^(d/(d-2))), where transformers' grows with each sequence past L: every shorter "
        f"sequence differs (measured |dq| up to 8 on unit q, at positions below {serve.length}); serve with {start}",
    )


def _longrope_switch(model: ServedModel, engine: str) -> Support | None:
    """The row for a longrope whose short/long switch the engine makes differently from transformers (which picks
    the set per sequence: short up to L tokens, long past), or None where it cannot matter (measured by
    benchmarks/engine_parity.py: vLLM 0.33, SGLang 0.5.23)."""
    rope = model.rope_parameters
    L = int(rope["original_max_position_embeddings"])
    length = serving(model, engine).length
    if rope.get("short_factor") != rope.get("long_factor"):
        if engine == "vllm":
            how = (
                f"it picks one factor set per server, by --max-model-len: above L = {L} (as at {length}) the long "
                f"set at every position, where transformers uses the short set for sequences up to L tokens"
            )
        else:
            how = (
                f"it picks the long set for a whole batch once any position in it passes L = {L} (a short request "
                f"beside a long one gets the long set), and rotates the token at position L as position 0 when no "
                f"position past L is in its batch"
            )
        return Support(engine, "approximate", f"{how}; the sets' difference, |dq| up to 9 on unit q, is the error")
    if engine == "sglang" and length > L:
        return Support(
            engine,
            "approximate",
            f"exact except at position L = {L}, which it rotates as position 0 when no position past L is in its "
            f"batch (its index runs from its short cos/sin cache into the long one): |dq| up to 2|q| there; "
            f"`ctxext export MODEL --engine sglang -o OUT` writes a copy it serves exactly",
        )
    return None


# vLLM's and SGLang's verdict, first match wins, in this order: a GGUF file; ctxext's attention methods (Dual Chunk
# where SGLang has it, Dual Chunk elsewhere, any other); rope nested by layer type; what the family's code builds
# instead of the type written; a type they do not know; then the written type's known traps (linear with an integer
# factor, dynamic NTK's length, longrope's attention factor and short/long switch, yarn's attention factor).
VLLM_SGLANG_RULES = (
    _gguf_file,
    _sglang_dual_chunk_on_qwen2,
    _dual_chunk_elsewhere,
    _other_attention_method,
    _nested,
    _type_the_family_code_builds,
    _vllm_gpt_oss_builds_yarn,
    _unknown_type,
    _integer_linear_factor,
    _dynamic,
    _longrope_attention_factor,
    _longrope,
    _yarn_attention_factor,
)


def _llama_cpp_gguf(model: ServedModel, engine: str) -> Support | None:
    if model.kind != "gguf":
        return None
    how = (model.record or {}).get("written_as", "unpatched")
    return Support(engine, "exact", f"{how}; run it with a context (-c) up to the file's context_length")


def _llama_cpp_architecture(model: ServedModel, engine: str) -> Support | None:
    if model.family in GGUF_ARCH:
        return None
    return Support(engine, "no", f"ctxext writes GGUF rope keys for {', '.join(GGUF_ARCH)}, not {model.family}")


def _llama_cpp_nested(model: ServedModel, engine: str) -> Support | None:
    if not model.nested:
        return None
    return Support(
        engine,
        "no",
        f"rope parameters nested by layer type are not claimed for llama.cpp here; patch the unpatched "
        f"model's GGUF with `ctxext patch MODEL.gguf` (llama.cpp's {GGUF_ARCH[model.family]} scales what "
        f"docs/guides/serving.md says)",
    )


def _llama_cpp_no_record(model: ServedModel, engine: str) -> Support | None:
    if model.record is not None:
        return None
    return Support(
        engine,
        "no",
        "no ctxext.yaml here, so the method is unknown; patch the model's GGUF with `ctxext patch MODEL.gguf ...`",
    )


def _llama_cpp_self_extend(model: ServedModel, engine: str) -> Support | None:
    spec, params = model.method_and_params()
    if spec.name != "self_extend":
        return None
    return Support(
        engine,
        "approximate",
        f"at run time, with {self_extend_flags(params)} (its window is a "
        "chunk width, and keys are shifted in the cache, not re-rotated)",
    )


def _llama_cpp_keys(model: ServedModel, engine: str) -> Support:
    """The GGUF keys `ctxext patch MODEL.gguf` writes for the method, or why there are none."""
    spec, params = model.method_and_params()
    L = int(model.record["original_max_position_embeddings"])
    base = float((model.record.get("rope_parameters") or model.rope_parameters)["rope_theta"])
    try:
        rope = gguf_rope(spec, params, GGUF_ARCH[model.family], model.rotary_dim, base, L, logn=model.logn)
    except CtxextError as error:
        return Support(engine, "no", str(error))
    return Support(
        engine,
        "exact",
        f"{rope.how}: convert the source model with llama.cpp's "
        f"convert_hf_to_gguf.py, then `ctxext patch MODEL.gguf` with the same method",
    )


def _llama_cpp_composed(model: ServedModel, engine: str) -> Support | None:
    """llama.cpp's row for a method composed with a shipped scaling: what `ctxext patch MODEL.gguf` does with the
    GGUF llama.cpp's converter writes of the source (gguf.composition_refusal): Llama 3.1's llama3 becomes
    per-pair rope_freqs, which the composition extends exactly on the llama architecture; anything else is refused."""
    if not is_composed(model):
        return None
    arch = GGUF_ARCH[model.family]
    shipped = ((model.record.get("source_rope") or {}).get("rope_parameters") or {}).get("rope_type", "default")
    kind = {"llama3": "rope_freqs", "longrope": "longrope"}.get(shipped, shipped)
    reason = composition_refusal(arch, kind)
    if reason is not None:
        return Support(engine, "no", reason)
    return Support(
        engine,
        "exact",
        f"per-pair factors in rope_freqs: llama.cpp's convert_hf_to_gguf.py stores the shipped {shipped} as rope_freqs, "
        f"and `ctxext patch MODEL.gguf` with the same method composes with them",
    )


# ------------------------------------------------------------- methods that zero frequencies (p-RoPE, CoPE)
ZEROING_METHODS = ("proportional", "cope")
PROPORTIONAL_READERS = "vLLM and SGLang read 'proportional' with their Gemma 4 rotary"


def _zeroed_frequencies_row(model: ServedModel, engine: str) -> Support | None:
    """The row for `proportional` or `cope` where it differs from the generic one (None: keep that).

    transformers 5.24 computes 'proportional' itself. vLLM (rotary_embedding/gemma4_rope.py) and SGLang
    (rotary_embedding factory) keep int(p * head_dim) // 2 pairs with exponents over head_dim and zero the rest,
    as transformers does, but take no `factor`: exact at factor 1 only (read from their source, not run here). A
    zero frequency is an infinite per-pair divisor (rope_freqs), which llama.cpp is not known to run. `cope` has
    no rope type of its own: config.json holds it as 'longrope' with infinite factors for the zeroed pairs, which
    Python's json reads but strict JSON parsers refuse; the generic longrope rows apply.
    """
    if model.kind != "checkpoint" or model.method not in ZEROING_METHODS:
        return None
    if engine == "llama.cpp":
        return Support(
            "llama.cpp",
            "no",
            f"'{model.method}' sets some pairs' frequency to 0 (an infinite rope_freqs factor), which llama.cpp is "
            f"not known to run; {SERVED_BY_CTXEXT}",
        )
    if model.rope_parameters.get("rope_type") != "proportional":
        return None
    if engine == "transformers":
        return Support("transformers", "exact", "reads rope type 'proportional' (rope_parameters; transformers 5.24)")
    factor = float(model.rope_parameters.get("factor", 1.0))
    if factor == 1.0:
        return Support(engine, "exact", f"{PROPORTIONAL_READERS}: the same kept and zeroed pairs; not run here")
    return Support(
        engine,
        "no",
        f"{PROPORTIONAL_READERS}, which takes no factor: it would serve p-RoPE with frequencies not divided by "
        f"{factor:g}; serve it with transformers or ctxext",
    )


# Each engine's verdict, first match wins (engine_table). Methods that zero frequencies come first everywhere: their
# row is not the generic one. Then transformers: a GGUF file, nested types it knows, what needs ctxext, the type it
# reads; vLLM and SGLang: VLLM_SGLANG_RULES, the type as written; llama.cpp: a GGUF file, an architecture ctxext
# writes no keys for, nested types, no record, a composition, self_extend's run-time flags, the keys written.
ENGINE_RULES = {
    "transformers": (
        _zeroed_frequencies_row,
        _transformers_gguf,
        _transformers_nested_types_it_knows,
        _transformers_needs_ctxext,
        _transformers_reads_the_type,
    ),
    "vllm": (_zeroed_frequencies_row, *VLLM_SGLANG_RULES, _vllm_or_sglang_reads_the_type),
    "sglang": (_zeroed_frequencies_row, *VLLM_SGLANG_RULES, _vllm_or_sglang_reads_the_type),
    "llama.cpp": (
        _zeroed_frequencies_row,
        _llama_cpp_gguf,
        _llama_cpp_architecture,
        _llama_cpp_nested,
        _llama_cpp_no_record,
        _llama_cpp_composed,
        _llama_cpp_self_extend,
        _llama_cpp_keys,
    ),
}


def _proportional_as_written(model: ServedModel, engine: str) -> tuple[dict, dict, str] | None:
    """For a checkpoint written as transformers' 'proportional': its rope parameters as they are (every engine that
    reads the type reads them so), or a one-line CtxextError where `engine` would not compute them; None otherwise."""
    rope = model.rope_parameters
    if model.method != "proportional" or rope.get("rope_type") != "proportional":
        return None
    row = _zeroed_frequencies_row(model, engine)
    if row is not None and row.level == "no":
        raise CtxextError(f"{engine} cannot serve proportional exactly: {row.how}")
    return dict(rope), {}, "transformers' own 'proportional' type, as written"


def is_composed(model: ServedModel) -> bool:
    """Whether config.json holds the method composed with the model's shipped scaling (ctxext.yaml's
    written_as.composed; for a checkpoint written before that key, its `how` says so)."""
    written_as = (model.record or {}).get("written_as") or {}
    if not isinstance(written_as, dict):
        return False
    return bool(written_as.get("composed", "composed with the model's shipped scaling" in str(written_as.get("how"))))


def _composed_as_written(model: ServedModel, engine: str) -> tuple[dict, dict, str] | None:
    """For a composed checkpoint (`is_composed`): the rope parameters config.json holds, which ctxext.yaml's method,
    factor and L do not rebuild (they name the method alone, counted from C), with the keys vLLM and SGLang read
    (`for_engines`: short/long_mscale); for SGLang, an equal-sets longrope's switch moved past the served length, as
    `_longrope_switch_past` does (transformers computes the same with either switch). None for any other."""
    if not is_composed(model):
        return None
    rope = for_engines(dict(model.rope_parameters))
    how = f"the composed '{rope['rope_type']}' config.json holds (the method with the model's shipped scaling)"
    L, length = int(rope.get("original_max_position_embeddings") or 0), served_length(model)
    if engine == "sglang" and _equal_factor_sets(rope) and length > L and "attention_factor" in rope:
        rope = {**rope, "original_max_position_embeddings": length}
        how += f", its switch moved from L = {L} to {length}, past every position SGLang serves"
    return rope, {}, how


# ------------------------------------------------------------------------------------------- writing
def export_checkpoint(
    model: ServedModel, engine: str, output, overwrite: bool = False, allow_approximate: bool = False
) -> str:
    """Write a copy of the checkpoint whose config.json `engine` reads exactly; returns how. Where the engine has
    no exact form (its verdict on the copy is approximate: Phi-4's longrope with two factor sets, SGLang's Dual
    Chunk Attention) it is a one-line CtxextError unless `allow_approximate`, which writes the copy labelled; a
    method the engine cannot read at all is a one-line CtxextError that names what is possible."""
    check_exportable(model, engine)
    rope, extra, how = engine_rope(model, engine)
    how = _verdict_of_copy(model, engine, rope, extra, how, allow_approximate)
    check_output_dir(output, [model.path], overwrite)
    with atomic_output_dir(output, [model.path], overwrite) as staging:
        for item in model.path.iterdir():
            if item.is_file():
                shutil.copy2(item, staging / item.name)
        (staging / "config.json").write_text(
            json.dumps(_config_with(model.config, rope, extra), indent=2, sort_keys=True) + "\n"
        )
        written = read_record(staging)
        if written is not None:
            write_record(staging, written.with_values(exported_for=engine))
    return how


def _verdict_of_copy(
    model: ServedModel, engine: str, rope: dict, extra: dict, how: str, allow_approximate: bool
) -> str:
    """`how`, with the engine's verdict on the copy about to be written where it is not exact (the table's rule for
    that copy); a one-line CtxextError where the engine would not serve the copy at all (its row says no), or
    serve it only approximately and `allow_approximate` is not given."""
    config = _config_with(model.config, rope, extra)
    copy = ServedModel(model.path, model.kind, model.family, rope, model.attention, model.record, config)
    row = next(r for r in engine_table(copy) if r.engine == engine)
    if row.level == "no":
        raise CtxextError(f"{engine} has no exact form of this checkpoint: {row.how}")
    if row.level == "approximate" and not allow_approximate:
        raise CtxextError(
            f"{engine} has no exact form of this checkpoint, only an approximate one ({row.how}); pass "
            f"--allow-approximate to write that copy anyway, or serve with an engine whose row says exact"
        )
    return how if row.level == "exact" else f"{how} ({row.level} in {engine}: {row.how})"


def _config_with(config: dict, rope: dict, extra: dict) -> dict:
    """config.json with `rope` in both spellings and the `extra` keys, in a vision-language model's text_config."""
    return with_text_config(config, {**with_both_spellings(text_config_of(config), rope), **extra})


def _longrope_switch_past(form, spec, params, model: ServedModel, L: int, base: float) -> tuple[dict, dict, str]:
    """A longrope with equal factor sets, its switch (original_max_position_embeddings) moved from L to the served
    length: SGLang rotates the position it switches at as position 0, and with equal sets nothing else depends on it.
    The attention factor is written (and SGLang's short/long_mscale), as transformers computes it from L, so that
    transformers' load is the same."""
    length = served_length(model)
    attention = form.rope_parameters.get("attention_factor")
    if attention is None:
        _, attention = compute_inv_freq(spec, params, model.rotary_dim, base, L)
    scale = {"attention_factor": float(attention), "short_mscale": float(attention), "long_mscale": float(attention)}
    rope = {**form.rope_parameters, **scale, "original_max_position_embeddings": length}
    return rope, {}, f"{form.how}, its switch moved from L = {L} to {length}, past every position SGLang serves"


def _equal_factor_sets(rope: dict) -> bool:
    return rope.get("rope_type") == "longrope" and rope.get("short_factor") == rope.get("long_factor")


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
    if model.query_scaling:
        raise CtxextError(f"no serving engine runs {model.query_scaling}; {SERVED_BY_CTXEXT}, or patch without it")


def engine_rope(model: ServedModel, engine: str) -> tuple[dict, dict, str]:
    """The rope parameters `engine` reads for the method recorded in `model`, any extra config keys, and how."""
    if model.nested:  # one rope form per layer type (Gemma 3): the written config.json is what the engine reads
        raise CtxextError(
            f"{model.path} records rope parameters nested by layer type ({model.family}), which `export --engine` "
            f"would flatten into one; serve the checkpoint as written (`ctxext export {model.path} --check` says "
            f"whether {engine} reads it exactly)"
        )
    spec, params = model.method_and_params()
    as_written = _proportional_as_written(model, engine) or _composed_as_written(model, engine)
    if as_written is not None:
        return as_written
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
        spec, params, model.rotary_dim, base, L, own_partial_rotary_factor(model.rope_parameters), "native"
    )
    form = form.with_family_keys(model.rope_parameters)
    if engine == "sglang" and _equal_factor_sets(form.rope_parameters):
        return _longrope_switch_past(form, spec, params, model, L, base)
    if not form.native:
        hint = {
            "dual_chunk": "--engine sglang on a Qwen2-family model",
            "self_extend": "llama.cpp's --grp-attn-n/--grp-attn-w on a GGUF",
        }.get(spec.name, SERVED_BY_CTXEXT)
        raise CtxextError(f"{engine} cannot serve {spec.name} exactly: {form.how.split(': ', 1)[-1]}; possible: {hint}")
    return form.rope_parameters, {}, form.how
