"""What TRL gives no hook for: the model directory GRPO's vLLM starts from.

TRL's GRPOTrainer with `use_vllm=True, vllm_mode="colocate"` starts `vllm.LLM(model=model.name_or_path,
max_model_len=args.vllm_max_model_length)` (trl 1.16 trl/generation/vllm_generation.py, `LLM(` near line 347)
and then pushes the trained weights into it: vLLM's rope is the one config.json in that directory names. After an
in-memory `ctxext.patch`, `model.name_or_path` is the unpatched directory, so vLLM would generate with the
unpatched rope. `vllm_model_dir` writes the patched model there first (`ctxext.save_pretrained`, native form)
and points the model at it; it refuses in one line what vLLM does not run exactly (attention-level methods,
methods without a native form, the rope forms ctxext's engine table marks inexact for vLLM) and says the length
to give GRPO (`vllm_max_model_length`). TRL itself is not imported here.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from ..checkpoint import save_pretrained
from ..errors import CtxextError
from ..patching import applied_method
from ..patching.forms import model_rope_form
from ..serving.engines import engine_table, read_served_model, serving


@dataclass(frozen=True)
class VllmModelDir:
    """Where vLLM reads the patched model, and the length to give it (GRPOConfig's `vllm_max_model_length`)."""

    path: Path
    max_model_length: int
    how: str  # the rope form written, as ctxext.save_pretrained says it


def vllm_model_dir(model, output: str | Path, tokenizer=None, overwrite: bool = False) -> VllmModelDir:
    """Write the patched `model` (a transformers model or a PEFT model around one) to `output` in the native rope
    form vLLM reads, and set its `name_or_path` to `output`, which GRPO hands vLLM; a one-line CtxextError for a
    method vLLM cannot run."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    check_vllm_runs(base)
    form = save_pretrained(base, output, tokenizer=tokenizer, overwrite=overwrite, format="native")
    served = read_served_model(output)
    launch = serving(served, "vllm")
    refusal = vllm_refusal(served, launch)
    if refusal is not None:
        shutil.rmtree(output)  # written just now; nothing of it serves
        raise CtxextError(f"GRPO's vLLM cannot generate with {applied_method(base)['method']}: {refusal}")
    base.name_or_path = str(Path(output).resolve())
    return VllmModelDir(Path(output).resolve(), launch.length, form.how)


def vllm_refusal(served, launch) -> str | None:
    """Why vLLM, started as GRPO starts it, would not run the written checkpoint exactly (None: it would)."""
    row = next(row for row in engine_table(served) if row.engine == "vllm")
    if row.level != "exact":
        return f"vLLM does not run it exactly: {row.how}"
    if launch.hf_overrides:
        return f"vLLM needs --hf-overrides {launch.hf_overrides}, which GRPO does not pass"
    return None


def check_vllm_runs(model) -> None:
    """A one-line CtxextError, before anything is written, for a model vLLM cannot generate with as patched."""
    applied = applied_method(model)
    if applied is None:
        raise CtxextError(
            "the model is not patched by ctxext (ctxext.patch); GRPO hands vLLM its own directory as it is"
        )
    if applied["attention"]:
        what = applied["attention"].get("method") or "its query scaling (log-n or temperature)"
        raise CtxextError(
            f"vLLM cannot run {what}: it lives in ctxext's attention wrapper, which vLLM's engine does not have; "
            f"train GRPO with use_vllm=False (generation in transformers, patched), or with a frequency method"
        )
    form = model_rope_form(model, "native")
    if not form.native:
        raise CtxextError(f"vLLM cannot run {applied['method']}: it has no rope type vLLM reads ({form.how})")
