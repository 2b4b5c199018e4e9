"""The parity checks `ctxext export --check` can run on this machine.

- transformers: the checkpoint loaded in a subprocess that never imports ctxext, against the same weights with
  the recorded method applied by `ctxext.patch` in this process; logits in fp32.
- llama.cpp (when llama-cpp-python is installed): llama.cpp's perplexity of the GGUF file against transformers'
  load of the same file with the recorded method applied by `ctxext.patch`.
Both run on seeded random token ids: every position past the first rotates by every pair's frequency, so a wrong
frequency shows at any length (a dynamic method's growth past L is not exercised at lengths below L).
- vLLM, SGLang (when installed): their own rotary code on the checkpoint's config.json against plain transformers',
  q and k rotated below L, at L and L+1, at 3L and in mixed batches (ctxext.verification.engine_rope, child processes).
"""

from __future__ import annotations

import copy
import functools
import math
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Callable
from pathlib import Path

import gguf
import torch
import transformers
from huggingface_hub import try_to_load_from_cache
from transformers import AutoConfig, AutoModelForCausalLM

from ..auto_classes import auto_model_class
from ..config import EXTENSION_KEYS, load_method_config
from ..errors import CtxextError, first_line
from ..patching.record import LayerTypeRope, RopeRecord, rope_record
from ..serving.engines import ServedModel
from .engine_rope import ENGINES, engine_importable, run_parity, target_for
from .llamacpp import llama_cpp_nll

# fp32 logits agree to float32 rounding of the frequencies (ctxext and transformers order the float32 operations
# differently; one ulp of a frequency, through 30 layers of SmolLM2, moves logits by about 6e-5 where the method
# itself moves them by about 4). Agreement: within 1e-5 plus 1e-3 of the method's own change.
LOGIT_TOLERANCE = (1e-5, 1e-3)
# llama.cpp multiplies quantised weights in quantised arithmetic (8-bit activations), which transformers' load of
# the file (dequantised to fp32) does not: on SmolLM2's Q4_1 file that alone moves perplexity by about 2%.
PERPLEXITY_TOLERANCE = {"float": 0.005, "quantised": 0.05}
PLAIN_LOGITS = textwrap.dedent("""
    import sys, torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    ids = torch.load(sys.argv[2], weights_only=True)
    causal = AutoConfig.from_pretrained(sys.argv[1]).model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    auto_class = AutoModelForCausalLM if causal else AutoModelForImageTextToText
    model = auto_class.from_pretrained(sys.argv[1], dtype=torch.float32).eval()
    with torch.no_grad():
        torch.save(model(ids).logits, sys.argv[3])
    print("ctxext imported" if "ctxext" in sys.modules else "ctxext not imported")
""")


def _random_ids(vocab_size: int, n_tokens: int):
    return torch.randint(0, vocab_size, (1, n_tokens), generator=torch.Generator().manual_seed(0))


def _method_config(model: ServedModel):
    """The method as `ctxext patch` applied it: its parameters, L, and the layer types and extension it was asked
    for (ctxext.yaml's `layer_types`, `replace_shipped`, `target_length`)."""
    spec, params = model.method_and_params()
    values = {k: v for k, v in params.to_dict().items() if v is not None and k not in spec.forced}
    L = model.record["original_max_position_embeddings"]
    asked = {k: model.record[k] for k in ("layer_types", *EXTENSION_KEYS) if model.record.get(k) not in (None, False)}
    return load_method_config(
        None, {"method": spec.name, **values, **asked, "logn": model.logn, "original_max_position_embeddings": L}
    )


def _unscaled(config, model: ServedModel) -> str:
    """Put the config back to the source's rope for `ctxext.patch` to apply the method; what the reference is.

    The source's rope as shipped where its config is readable here (`source_rope`): a scaling it shipped (Gemma 3's
    linear x8) is what the method composed with. Else plain RoPE at L, each layer type at its recorded base (Gemma
    3: the sliding layers' 1e4, the full layers' 1e6)."""
    if model.record.get("source_scaling"):  # a GGUF whose own rope_freqs the method composed with
        return _shipped_rope_freqs(config, model)
    source = source_rope(config, model)
    if source is not None:
        config.rope_parameters = rope_parameters_of(source, lambda rope: copy.deepcopy(rope.parameters))
        config.max_position_embeddings = source.max_position_embeddings
        if hasattr(config, "original_max_position_embeddings"):  # Phi-3's top-level L0
            config.original_max_position_embeddings = source.pretraining_length
        return f"the source's rope as shipped ({source.describe()})"
    config.rope_parameters = rope_parameters_of(recorded_rope(config, model), plain_rope)
    config.max_position_embeddings = int(model.record["original_max_position_embeddings"])
    return "plain RoPE at the recorded bases (neither ctxext.yaml nor the source's config says how it shipped)"


def _shipped_rope_freqs(config, model: ServedModel) -> str:
    """The GGUF's own scaling before the patch, which transformers' GGUF loader does not read, as the longrope
    transformers computes the same way: per-pair factors (llama.cpp divides pair i's frequency by rope_freqs, as
    longrope by its long factors) at the file's context C, its attn_factor the attention factor; the method composes
    with it as `ctxext patch` composes a checkpoint's shipped scaling. Its switch (original_max_position_embeddings)
    is 1, so that transformers rotates every position of a sequence with the long set, as llama.cpp rotates every
    position with rope_freqs (the short set, which the composition keeps, would serve sequences up to the switch)."""
    shipped = model.record["source_scaling"]
    C = int(model.record["original_max_position_embeddings"])
    config.rope_parameters = {
        "rope_type": "longrope",
        "rope_theta": float(model.record["rope_theta"]),
        "short_factor": list(shipped["rope_freqs"]),
        "long_factor": list(shipped["rope_freqs"]),
        "factor": 1.0,
        "attention_factor": float(shipped["attn_factor"]),
        "original_max_position_embeddings": 1,
    }
    config.max_position_embeddings = C
    return f"the file's own rope_freqs as shipped, at C = {C}"


def source_rope(config, model: ServedModel) -> RopeRecord | None:
    """The rope record of the source as shipped: what ctxext.yaml recorded of it (`source_rope`), else its config
    where it is on this machine (a local checkpoint, or the hub cache: nothing is downloaded) and of the same
    family; else None."""
    if model.record.get("source_rope"):
        return rope_record(config, model.record["source_rope"])
    source = model.record.get("source_model")
    if not source:  # a GGUF's record, or a checkpoint written without its source's name
        return None
    folder = Path(str(source)).expanduser()
    if not (folder / "config.json").is_file():
        try:
            cached = try_to_load_from_cache(str(source), "config.json")
        except ValueError:  # not a hub id either
            cached = None
        if not isinstance(cached, str):
            return None
        folder = Path(cached).parent
    try:
        shipped = transformers.AutoConfig.from_pretrained(folder)
        record = rope_record(shipped)
    except (OSError, ValueError, KeyError, CtxextError):
        return None
    return record if shipped.model_type == config.model_type else None


def recorded_rope(config, model: ServedModel) -> RopeRecord:
    """The rope record of what ctxext patched: ctxext.yaml's `rope_parameters` (each layer type with its own base),
    or, for a GGUF (whose record keeps one `rope_theta`, the base before a base change), the config's own with that
    base on the full-attention layers."""
    saved = model.record.get("rope_parameters")
    if saved is None:
        loaded = rope_record(config)
        base = float(model.record["rope_theta"])
        saved = rope_parameters_of(
            loaded, lambda rope: {**rope.parameters, "rope_theta": base} if rope is loaded.full else rope.parameters
        )
    return rope_record(config, {"rope_parameters": saved})


def rope_parameters_of(record: RopeRecord, parameters: Callable[[LayerTypeRope], dict]) -> dict:
    """Rope parameters in the record's shape, `parameters(rope)` for each layer type: one flat dict, or one per
    layer type (Gemma 3)."""
    if None in record.types:
        return parameters(record.types[None])
    return {key: parameters(rope) for key, rope in record.types.items()}


def plain_rope(rope: LayerTypeRope) -> dict:
    """Plain RoPE at a layer type's base, rotating the share of each head it rotates."""
    values = {"rope_type": "default", "rope_theta": float(rope.base)}
    if "partial_rotary_factor" in rope.parameters:
        values["partial_rotary_factor"] = rope.parameters["partial_rotary_factor"]
    return values


def transformers_parity(model: ServedModel, n_tokens: int) -> tuple[bool, str]:
    """(agrees, what was measured) for a checkpoint written by ctxext."""
    config = AutoConfig.from_pretrained(model.path)
    text_config = getattr(config, "text_config", None) or config  # a vision-language model's language model
    ids = _random_ids(text_config.vocab_size, n_tokens)
    with tempfile.TemporaryDirectory() as scratch:
        torch.save(ids, Path(scratch) / "ids.pt")
        result = subprocess.run(
            [
                sys.executable,
                "-c",
                PLAIN_LOGITS,
                str(model.path),
                str(Path(scratch) / "ids.pt"),
                str(Path(scratch) / "logits.pt"),
            ],
            capture_output=True,
            text=True,
        )
        if result.returncode != 0:
            lines = [line for line in result.stderr.splitlines() if line.strip()]
            return False, f"plain transformers failed to load it: {lines[-1] if lines else result.returncode}"
        if "ctxext not imported" not in result.stdout:
            return False, "the subprocess imported ctxext; the check is void"
        plain = torch.load(Path(scratch) / "logits.pt", weights_only=True)
    against = _unscaled(text_config, model)
    reference = auto_model_class(config).from_pretrained(model.path, config=config, dtype=torch.float32).eval()
    with torch.no_grad():
        unpatched = reference(ids).logits
        _method_config(model).apply(reference)
        expected = reference(ids).logits
    difference = float((plain - expected).abs().max())
    change = float((unpatched - expected).abs().max())
    absolute, relative = LOGIT_TOLERANCE
    return difference <= absolute + relative * change, (
        f"plain transformers (subprocess, no ctxext) vs ctxext.patch: max |logit diff| {difference:.1e} over "
        f"{n_tokens} tokens in fp32 (the method itself moves logits by up to {change:.2g}); reference: {against}"
    )


def llama_cpp_parity(model: ServedModel, n_tokens: int) -> tuple[bool, str]:
    """(agrees, what was measured) for a GGUF written by ctxext, where llama-cpp-python is installed."""
    try:
        reference = AutoModelForCausalLM.from_pretrained(
            model.path.parent, gguf_file=model.path.name, dtype=torch.float32
        ).eval()
    except (OSError, ValueError, KeyError, RuntimeError) as error:
        raise CtxextError(f"transformers could not load '{model.path}' for the check: {first_line(error)}") from None
    ids = _random_ids(reference.config.vocab_size, n_tokens)
    lcpp_sum, n = llama_cpp_nll(model.path, ids[0].tolist())
    repatched(reference, model)
    with torch.no_grad():
        logits = reference(ids).logits[0, :-1].double()
        expected = float(torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="sum"))
    ratio = math.exp((lcpp_sum - expected) / n) - 1
    weights = "quantised" if _quantised(model.path) else "float"
    note = ", quantised weights: --outtype f32 for a strict check" if weights == "quantised" else ""
    return abs(ratio) <= PERPLEXITY_TOLERANCE[weights], (
        f"llama.cpp vs ctxext.patch on transformers' load of the file: perplexity {100 * ratio:+.3f}% over "
        f"{n_tokens} tokens (within {100 * PERPLEXITY_TOLERANCE[weights]:g}%{note})"
    )


def repatched(reference, model: ServedModel):
    """`reference` (transformers' load of the GGUF file `model`, which reads only its base) put back to the file's
    rope before the patch, then patched as ctxext.yaml's record says: what llama.cpp should compute."""
    _unscaled(reference.config, model)
    _method_config(model).apply(reference)
    return reference


def _quantised(path) -> bool:
    floats = (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.BF16)
    return any(t.tensor_type not in floats for t in gguf.GGUFReader(path).tensors)


def engine_rope_parity(model: ServedModel, row) -> tuple[bool | None, str]:
    """(agrees with the table's row, what was measured) for vLLM's or SGLang's own rotary code where that engine is
    installed here: ctxext.verification.engine_rope, in child processes, against plain transformers' load. (None, why)
    where nothing runs."""
    if row.level == "no" or model.kind != "checkpoint":
        return None, "nothing to check"
    if model.record is None:
        return None, "not run: no ctxext.yaml, so L (where the methods differ) is unknown"
    if not engine_importable(row.engine):
        return None, (
            f"not run: {row.engine} is not installed here (benchmarks/engine_parity.py runs its rotary code from its "
            f"wheel on any machine)"
        )
    finding = _installed_engines_findings(str(model.path), (model.path / "config.json").read_text())[row.engine]
    if finding.level == "not run":
        return None, f"not run: {finding.error}"
    agrees = finding.level == "exact" if row.level == "exact" else finding.level != "fails"
    return agrees, f"{row.engine}'s own rotary code vs plain transformers (rotated q, k): {finding.describe()}"


@functools.lru_cache(maxsize=2)
def _installed_engines_findings(path: str, config_text: str) -> dict:
    """Every installed engine's finding on the checkpoint at `path`, in one run (config_text keys the cache)."""
    engines = tuple(engine for engine in ENGINES if engine_importable(engine))
    with tempfile.TemporaryDirectory() as scratch:
        return run_parity([target_for(path, "model")], engines, scratch)["model"]
