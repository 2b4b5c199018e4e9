"""The parity checks `ctxext export --check` can run on this machine.

- transformers: the checkpoint loaded in a subprocess that never imports ctxext, against the same weights with
  the recorded method applied by `ctxext.patch` in this process; logits in fp32.
- llama.cpp (when llama-cpp-python is installed): llama.cpp's perplexity of the GGUF file against transformers'
  load of the same file with the recorded method applied by `ctxext.patch`.
Both run on seeded random token ids: every position past the first rotates by every pair's frequency, so a wrong
frequency shows at any length (a dynamic method's growth past L is not exercised at lengths below L).
- vLLM, SGLang (when installed): their own rotary code on the checkpoint's config.json against plain transformers',
  q and k rotated below L, at L and L+1, at 3L and in mixed batches (ctxext.serving.engine_rope, child processes).
"""

from __future__ import annotations

import functools
import math
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

from ..errors import CtxextError, first_line
from .engines import ServedModel

# fp32 logits agree to float32 rounding of the frequencies (ctxext and transformers order the float32 operations
# differently; one ulp of a frequency, through 30 layers of SmolLM2, moves logits by about 6e-5 where the method
# itself moves them by about 4). Agreement: within 1e-5 plus 1e-3 of the method's own change.
LOGIT_TOLERANCE = (1e-5, 1e-3)
# llama.cpp multiplies quantised weights in quantised arithmetic (8-bit activations), which transformers' load of
# the file (dequantised to fp32) does not: on SmolLM2's Q4_1 file that alone moves perplexity by about 2%.
PERPLEXITY_TOLERANCE = {"float": 0.005, "quantised": 0.05}
PLAIN_LOGITS = textwrap.dedent("""
    import sys, torch
    from transformers import AutoModelForCausalLM
    ids = torch.load(sys.argv[2], weights_only=True)
    model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32).eval()
    with torch.no_grad():
        torch.save(model(ids).logits, sys.argv[3])
    print("ctxext imported" if "ctxext" in sys.modules else "ctxext not imported")
""")


def _random_ids(vocab_size: int, n_tokens: int):
    import torch

    return torch.randint(0, vocab_size, (1, n_tokens), generator=torch.Generator().manual_seed(0))


def _method_config(model: ServedModel):
    from ..config import load_method_config

    spec, params = model.method_and_params()
    values = {k: v for k, v in params.to_dict().items() if v is not None and k not in spec.forced}
    L = model.record["original_max_position_embeddings"]
    return load_method_config(
        None, {"method": spec.name, **values, "logn": model.logn, "original_max_position_embeddings": L}
    )


def _unscaled(config, model: ServedModel) -> None:
    """Put the config back to plain RoPE at the source's base and L, for `ctxext.patch` to apply the method."""
    base = model.record.get("rope_theta") or model.record["rope_parameters"]["rope_theta"]
    config.rope_parameters = {"rope_type": "default", "rope_theta": float(base)}
    config.max_position_embeddings = int(model.record["original_max_position_embeddings"])


def transformers_parity(model: ServedModel, n_tokens: int) -> tuple[bool, str]:
    """(agrees, what was measured) for a checkpoint written by ctxext."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model.path)
    ids = _random_ids(config.vocab_size, n_tokens)
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
    _unscaled(config, model)
    reference = AutoModelForCausalLM.from_pretrained(model.path, config=config, dtype=torch.float32).eval()
    with torch.no_grad():
        unpatched = reference(ids).logits
        _method_config(model).apply(reference)
        expected = reference(ids).logits
    difference = float((plain - expected).abs().max())
    change = float((unpatched - expected).abs().max())
    absolute, relative = LOGIT_TOLERANCE
    return difference <= absolute + relative * change, (
        f"plain transformers (subprocess, no ctxext) vs ctxext.patch: max |logit diff| {difference:.1e} over "
        f"{n_tokens} tokens in fp32 (the method itself moves logits by up to {change:.2g})"
    )


def llama_cpp_parity(model: ServedModel, n_tokens: int) -> tuple[bool, str]:
    """(agrees, what was measured) for a GGUF written by ctxext, where llama-cpp-python is installed."""
    import torch
    from transformers import AutoModelForCausalLM

    from .llamacpp import llama_cpp_nll

    try:
        reference = AutoModelForCausalLM.from_pretrained(
            model.path.parent, gguf_file=model.path.name, dtype=torch.float32
        ).eval()
    except (OSError, ValueError, KeyError, RuntimeError) as error:
        raise CtxextError(f"transformers could not load '{model.path}' for the check: {first_line(error)}") from None
    ids = _random_ids(reference.config.vocab_size, n_tokens)
    lcpp_sum, n = llama_cpp_nll(model.path, ids[0].tolist())
    _unscaled(reference.config, model)
    _method_config(model).apply(reference)
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


def _quantised(path) -> bool:
    import gguf

    floats = (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.BF16)
    return any(t.tensor_type not in floats for t in gguf.GGUFReader(path).tensors)


def engine_rope_parity(model: ServedModel, row) -> tuple[bool | None, str]:
    """(agrees with the table's row, what was measured) for vLLM's or SGLang's own rotary code where that engine is
    installed here: ctxext.serving.engine_rope, in child processes, against plain transformers' load. (None, why)
    where nothing runs."""
    from .engine_rope import engine_importable

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
    from .engine_rope import ENGINES, engine_importable, run_parity, target_for

    engines = tuple(engine for engine in ENGINES if engine_importable(engine))
    with tempfile.TemporaryDirectory() as scratch:
        return run_parity([target_for(path, "model")], engines, scratch)["model"]
