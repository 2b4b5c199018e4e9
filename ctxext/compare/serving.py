"""Which engines serve a compared row exactly, read from `ctxext.serving.engines.engine_table` for the checkpoint
ctxext would write for the row's method (no weights written or loaded), and the commands that serve it."""

from __future__ import annotations

import copy
import shlex
from pathlib import Path

from ..errors import CtxextError
from ..methods import get_method
from ..patching.applicable import skeleton
from ..patching.families import rotary_host
from ..patching.forms import model_rope_form, rope_form
from ..patching.patch import patch
from ..patching.record import rope_record
from ..serving.engines import ServedModel, engine_table

TARGETS = ("ctxext", "vllm", "sglang", "llama.cpp")
TARGET_NAMES = {"ctxext": "ctxext runtime", "vllm": "vLLM", "sglang": "SGLang", "llama.cpp": "llama.cpp"}


def compare_form(config: dict, model_config, L: int):
    """The rope form (ctxext.patching.forms.RopeForm) `ctxext patch` writes for `config` (a method mapping) on a model
    with `model_config`, counting from L, on the full-attention layers' base and rotated width (the rope record)."""
    return _written(config, model_config, L)[0]


def _written(config: dict, model_config, L: int):
    """(the RopeForm `ctxext patch` writes, the config.json dict it writes it in, whether it is composed). Where the
    model ships a scaling the method composes with it (ctxext.patching.compose): the form is then read from the
    model patched on the meta device (`skeleton`, its rotary real), as `ctxext patch` writes it."""
    spec = get_method(config["method"])
    values = _method_values(config)
    full = rope_record(model_config).full  # the full-attention layers: what an extension scales
    if not full.scaled:
        form = rope_form(spec, spec.make_params(**values), full.rotary_dim, full.base, L, full.partial_rotary_factor)
        return form, model_config.to_dict(), False
    model = skeleton(copy.deepcopy(model_config))
    patch(model, config["method"], original_max_position_embeddings=L, logn=bool(config.get("logn")), **values)
    host = rotary_host(model)
    return model_rope_form(model, "native"), host.config.to_dict(), bool(host.rotary_emb.composed_keys)


def _method_values(config: dict) -> dict:
    return {k: v for k, v in config.items() if k not in ("method", "original_max_position_embeddings", "logn")}


def engine_support(config: dict, model_config, L: int) -> dict[str, dict]:
    """{engine: {"level": exact|approximate|no, "how": ...}} for the checkpoint `ctxext patch` writes for `config`
    (a method mapping) on a model with `model_config`: the written rope form, the method's record, the family."""
    form, written_config, composed = _written(config, model_config, L)
    record = {
        **_method_values(config),
        "method": config["method"],
        "logn": bool(config.get("logn")),
        "original_max_position_embeddings": L,
        "rope_parameters": {"rope_theta": rope_record(model_config).full.base},
        "written_as": {"composed": composed},
        "source_rope": {"rope_parameters": copy.deepcopy(model_config.rope_parameters)},
    }
    served = ServedModel(
        Path("."), "checkpoint", model_config.model_type, form.rope_parameters, None, record, written_config
    )
    table = {s.engine: {"level": s.level, "how": s.how} for s in engine_table(served)}
    table["ctxext"] = {"level": "exact", "how": "ctxext's own runtime: `import ctxext` before loading the checkpoint"}
    return table


def serves_exactly(support: dict, target: str) -> bool:
    return target == "ctxext" or support.get(target, {}).get("level") == "exact"


def serve_commands(target: str, model: str, method_file: str, length: int, written: str) -> list[str]:
    """The commands that serve a row on `target`: patch `model` with the method YAML, then the engine's own."""
    q = shlex.quote
    patch = f"ctxext patch {q(model)} --config {q(method_file)} -o {q(written)}"
    if target == "ctxext":
        return [patch, f"ctxext serve {q(written)}  # OpenAI-compatible; every method ctxext runs"]
    if target == "vllm":
        return [patch, f"vllm serve {q(written)} --max-model-len {length}"]
    if target == "sglang":
        return [patch, f"python -m sglang.launch_server --model-path {q(written)} --context-length {length}"]
    if target == "llama.cpp":
        gguf = f"{Path(written).name}.gguf"
        return [
            f"python convert_hf_to_gguf.py {q(model)} --outfile model.gguf  # llama.cpp's converter, unpatched model",
            f"ctxext patch model.gguf --config {q(method_file)} -o {q(gguf)}",
            f"llama-server -m {q(gguf)} -c {length}",
        ]
    raise CtxextError(f"unknown serving target '{target}'; choose one of: {', '.join(TARGETS)}")
