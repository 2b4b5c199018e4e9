"""The longest context each serving engine derives from a config.json, and what to pass it to serve N tokens.

An engine does not serve `max_position_embeddings` as such: each derives its own maximum from the config, and a
checkpoint that runs in transformers can be served shorter, or refused past a length, elsewhere. The rules below
were read from the engines' source (evidence "read": vLLM and SGLang are not installed here, and nothing here runs
their length code; benchmarks/engine_parity.py and engine_rope.py run their rotary code, not this):

- vLLM 18ec6629 (same logic at 0052a5b8; moved, unchanged, into model_arch_config_convertor.py at ee92a6f3):
  vllm/config/model.py `_get_and_verify_max_len`: the smallest of the length keys, then, unless "gemma3" is in the
  model type, times the rope `factor` of any type but su/longrope/llama3, from `original_max_position_embeddings`
  for yarn. That is the most `--max-model-len` may ask (more raises, unless VLLM_ALLOW_LONG_MAX_MODEL_LEN=1); the
  length served without the flag is the same, but for longrope: the config's top-level
  `original_max_position_embeddings` (Phi-3/Phi-4-mini: 4096) where it has one.
- SGLang 2aa2e2d0: python/sglang/srt/utils/hf_transformers_utils.py `get_context_length` (the first length key,
  times `rope_scaling["factor"]` unless the scaling records `original_max_position_embeddings` or is llama3) and
  configs/model_config.py `_derive_context_length` (001adf56: a longer `--context-length` raises, unless
  SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1).
- llama.cpp: convert_hf_to_gguf.py (0024aa74) `TextModel.set_gguf_parameters` writes `context_length` from
  `max_position_embeddings` (Phi3MiniModel from n_positions / max_position_embeddings), which is `n_ctx_train`;
  tools/server/server-context.cpp (fb402660) caps every slot at n_ctx_train whatever `--ctx-size` says, so a
  longer context also needs `--override-kv ARCH.context_length=int:N`; common/common.h (001d906a) leaves the
  context at n_ctx_train when `--ctx-size` is not given, which `--fit` may shrink to fit memory.
- transformers 5.24 (installed): no maximum; it rotates any position. Both vLLM and SGLang read the config as
  transformers 5 loads it (`standardize_rope_params`, modeling_rope_utils.py): `rope_scaling` is
  `rope_parameters`, a legacy `type` becomes `rope_type`, llama3/yarn/longrope always carry
  `original_max_position_embeddings` (the top-level one where the config has it, else max_position_embeddings),
  and Gemma 3's rope_scaling + rope_local_base_freq become parameters nested by layer type.

Each engine's rules are an ordered table of small functions, first match wins, each commented with the source line
it reflects. `engine_lengths(config, N)` gives one row per engine; `serve_lines` the lines `ctxext patch` prints.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, replace

from ..errors import CtxextError
from ..patching.families import is_nested
from .engines import GGUF_ARCH
from .forms import text_config_of

# the source read for each engine's rules (see the module's text)
READ = {"vllm": "vLLM 18ec6629", "sglang": "SGLang 2aa2e2d0", "llama.cpp": "llama.cpp 0024aa74, fb402660"}
EVIDENCE = {
    "transformers": "read: transformers 5.24 (installed): no maximum, max_position_embeddings as written",
    "vllm": f"read: {READ['vllm']} vllm/config/model.py _get_and_verify_max_len",
    "sglang": f"read: {READ['sglang']} hf_transformers_utils.get_context_length, model_config._derive_context_length",
    "llama.cpp": f"read: {READ['llama.cpp'].replace(', ', ' convert_hf_to_gguf.py, ')} server-context.cpp",
}
NAMES = {"transformers": "transformers", "vllm": "vLLM", "sglang": "SGLang", "llama.cpp": "llama.cpp"}
# transformers model_type -> llama.cpp's architecture name, the prefix of its GGUF keys (--override-kv)
LLAMA_CPP_ARCH = {**GGUF_ARCH, "gemma3": "gemma3", "gpt_oss": "gpt-oss"}
SCALED_TYPES = ("llama3", "yarn", "longrope")  # those transformers 5 gives an original_max_position_embeddings


@dataclass(frozen=True)
class Loaded:
    """config.json as the engines see it once transformers 5 has loaded it: the text model's keys (a multimodal
    config's text_config merged over its top level, as vLLM's and SGLang's hf_text_config and llama.cpp's
    converter take it) and its rope parameters standardized (flat, nested by layer type, or None)."""

    model_type: str
    values: dict
    rope: dict | None


@dataclass(frozen=True)
class EngineLength:
    """One engine's length for a config: what it serves given no flag (`derived`), the longest it accepts without
    an override (`limit`), and what to pass to serve `target` tokens."""

    engine: str
    derived: int
    limit: int
    target: int
    flags: tuple = ()  # command-line flags that serve `target`
    env: tuple = ()  # NAME=VALUE settings those flags need
    why: str = ""  # the rule that decided, as the engine's source has it
    evidence: str = ""
    servable: bool = True  # False: no flag serves `target` with the config as written
    capped: bool = True  # False: the engine has no maximum (transformers)

    @property
    def reaches(self) -> bool:
        """Whether the engine serves `target` tokens with no flag at all."""
        return not self.capped or self.derived >= self.target

    @property
    def to_pass(self) -> str:
        """The environment and flags to give, '' for none."""
        return " ".join((*self.env, *self.flags))


def engine_lengths(config: dict, target: int) -> list[EngineLength]:
    """One row per engine (transformers, vLLM, SGLang, llama.cpp) for `config` (config.json as a dict) and a
    target of `target` tokens."""
    if not isinstance(config, dict):
        raise CtxextError(f"engine lengths read a config.json dict, got {type(config).__name__}")
    if isinstance(target, bool) or not isinstance(target, int) or target < 1:
        raise CtxextError(f"the target length must be a whole number of tokens, got {target!r}")
    loaded = load(config)
    return [_transformers(loaded, target), _vllm(loaded, target), _sglang(loaded, target), _llama_cpp(loaded, target)]


# ------------------------------------------------------------------------- config.json as transformers 5 loads it
def load(config: dict) -> Loaded:
    """`Loaded` of a config.json dict."""
    values = {**config, **text_config_of(config)}
    model_type = str(values.get("model_type") or "")
    return Loaded(model_type, values, standardized_rope(values, model_type))


def standardized_rope(values: dict, model_type: str) -> dict | None:
    """The rope parameters transformers 5 holds for these config values (modeling_rope_utils.py
    `standardize_rope_params`), or None for a config without RoPE."""
    rope = values.get("rope_parameters") or values.get("rope_scaling")
    theta = values.get("rope_theta")
    if not rope and theta is None:
        return None
    rope = copy.deepcopy(rope or {})
    if "gemma3" in model_type and not is_nested(rope):  # Gemma3TextConfig: one scaling + rope_local_base_freq
        local = {"rope_type": "default", "rope_theta": values.get("rope_local_base_freq", 10000.0)}
        rope = {"full_attention": {**rope, "rope_theta": theta}, "sliding_attention": local}
    if is_nested(rope):
        return {key: _standardized(dict(layer), values, top_level=False) for key, layer in rope.items()}
    return _standardized(rope, values, top_level=True)


def _standardized(rope: dict, values: dict, top_level: bool) -> dict:
    # rope_parameters.setdefault("rope_type", rope_parameters.get("type", "default"))
    rope.setdefault("rope_type", rope.get("type", "default"))
    if rope["rope_type"] in SCALED_TYPES:
        # "Phi3 ... save `original_max_position_embeddings` outside rope parameters ... we give priority to" it
        if top_level and "original_max_position_embeddings" in values:
            rope["original_max_position_embeddings"] = values["original_max_position_embeddings"]
        # else: rope_parameters.setdefault("original_max_position_embeddings", self.max_position_embeddings)
        rope.setdefault("original_max_position_embeddings", values.get("max_position_embeddings"))
    return rope


def _layers(loaded: Loaded) -> list[dict]:
    """The rope parameters of each layer type (the one set where the config does not nest them)."""
    if loaded.rope is None:
        return []
    return list(loaded.rope.values()) if is_nested(loaded.rope) else [loaded.rope]


# ----------------------------------------------------------------------------------------------- transformers
def _transformers(loaded: Loaded, target: int) -> EngineLength:
    length = int(loaded.values.get("max_position_embeddings") or 0)
    why = f"max_position_embeddings {length}, not a limit: it rotates any position it is given"
    return EngineLength(
        "transformers", length, length, target, why=why, evidence=EVIDENCE["transformers"], capped=False
    )


# ------------------------------------------------------------------------------------------------------- vLLM
# possible_keys = ["max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "model_max_length",
#                  "max_target_positions", "max_sequence_length", "max_seq_length", "seq_len"]
VLLM_KEYS = (
    "max_position_embeddings",
    "n_positions",
    "max_seq_len",
    "seq_length",
    "model_max_length",
    "max_target_positions",
    "max_sequence_length",
    "max_seq_length",
    "seq_len",
)


def _vllm_keys(loaded: Loaded) -> tuple[float, str]:
    """vLLM's length before rope scaling, and the key it came from."""
    present = {key: loaded.values[key] for key in VLLM_KEYS if loaded.values.get(key) is not None}
    # if tmp_max_len := getattr(hf_config, "model_max_length", None): derived_max_model_len = tmp_max_len
    if loaded.values.get("model_max_length"):
        return loaded.values["model_max_length"], "model_max_length"
    if not present:  # default_max_len = 2048
        return 2048, "no length key: 2048"
    # "Choose the smallest "max_length" from the possible keys"
    key = min(present, key=present.get)
    return present[key], key


def _vllm_gemma3(loaded: Loaded, base: float, key: str):
    # if rope_parameters is not None and "gemma3" not in hf_config.model_type:  (Gemma3's 128K is already scaled)
    if "gemma3" in loaded.model_type:
        return base, f"{key} {base:g}; gemma3: no rope factor applied"
    return None


def _vllm_no_rope(loaded: Loaded, base: float, key: str):
    # rope_parameters = getattr(hf_config, "rope_parameters", None)  -> None: nothing scales
    if loaded.rope is None:
        return base, f"{key} {base:g}"
    return None


def _vllm_rope_factor(loaded: Loaded, base: float, key: str):
    # for rp in rope_parameters.values():
    #     if rope_type not in ("su", "longrope", "llama3"):
    #         scaling_factor = rp.get("factor", scaling_factor)
    #         if rope_type == "yarn": derived_max_model_len = rp["original_max_position_embeddings"]
    # derived_max_model_len *= scaling_factor
    factor, why = 1.0, f"{key} {base:g}"
    for rope in _layers(loaded):
        rope_type = rope["rope_type"]
        if rope_type not in ("su", "longrope", "llama3"):
            factor = rope.get("factor", factor)
            if rope_type == "yarn":
                base = rope["original_max_position_embeddings"]
                why = f"yarn: original_max_position_embeddings {base:g}"
    return base * factor, why if factor == 1.0 else f"{why} x factor {factor:g}"


VLLM_LIMIT_RULES = (_vllm_gemma3, _vllm_no_rope, _vllm_rope_factor)


def _vllm_longrope_default(loaded: Loaded, limit: int):
    # if any(rp["rope_type"] == "longrope" ...):
    #     max_model_len = int(getattr(hf_config, "original_max_position_embeddings", derived_max_model_len))
    if any(rope["rope_type"] == "longrope" for rope in _layers(loaded)):
        if "original_max_position_embeddings" in loaded.values:
            served = int(loaded.values["original_max_position_embeddings"])
            return served, f"longrope: defaults to the top-level original_max_position_embeddings {served}"
        return limit, "longrope without a top-level original_max_position_embeddings: the derived length"
    return None


def _vllm_derived_default(loaded: Loaded, limit: int):
    # else: max_model_len = int(derived_max_model_len)
    return limit, "the derived length"


VLLM_DEFAULT_RULES = (_vllm_longrope_default, _vllm_derived_default)


def _vllm(loaded: Loaded, target: int) -> EngineLength:
    base, key = _vllm_keys(loaded)
    limit, why = _first(VLLM_LIMIT_RULES, loaded, base, key)
    limit = int(limit)
    derived, default_why = _first(VLLM_DEFAULT_RULES, loaded, limit)
    row = EngineLength("vllm", derived, limit, target, why=f"{why}; {default_why}", evidence=EVIDENCE["vllm"])
    if derived >= target:
        return row
    flag = f"--max-model-len {target}"
    if limit >= target:
        return replace(row, flags=(flag,))
    if _vllm_yarn_limited(loaded):  # its yarn cos/sin cache ends at original x factor: nothing past it is served
        return replace(row, servable=False, why=f"{row.why}; its yarn cos/sin cache ends at {limit}")
    override = json.dumps({"max_position_embeddings": target})
    return replace(row, flags=(flag, f"--hf-overrides '{override}'"))


def _vllm_yarn_limited(loaded: Loaded) -> bool:
    """Whether vLLM's limit comes from a yarn's original_max_position_embeddings x factor (which a larger
    max_position_embeddings does not move)."""
    return "gemma3" not in loaded.model_type and any(rope["rope_type"] == "yarn" for rope in _layers(loaded))


# ----------------------------------------------------------------------------------------------------- SGLang
# CONTEXT_LENGTH_KEYS = ["max_sequence_length", "seq_length", "max_seq_len", "model_max_length",
#                        "max_position_embeddings"]  ("The ordering here is important")
SGLANG_KEYS = ("max_sequence_length", "seq_length", "max_seq_len", "model_max_length", "max_position_embeddings")


def _sglang_no_scaling(rope_scaling: dict | None):
    # if rope_scaling: ... else: rope_scaling_factor = 1
    return (1, "no rope_scaling") if not rope_scaling else None


def _sglang_original_recorded(rope_scaling: dict):
    # if "original_max_position_embeddings" in rope_scaling: rope_scaling_factor = 1
    if "original_max_position_embeddings" in rope_scaling:
        return 1, "rope_scaling records original_max_position_embeddings: no factor"
    return None


def _sglang_llama3(rope_scaling: dict):
    # if rope_scaling.get("rope_type", None) == "llama3": rope_scaling_factor = 1
    return (1, "llama3: no factor") if rope_scaling.get("rope_type") == "llama3" else None


def _sglang_factor(rope_scaling: dict):
    # rope_scaling_factor = rope_scaling.get("factor", 1)  (a config nested by layer type has no top-level factor)
    factor = rope_scaling.get("factor", 1)
    return factor, f"x rope_scaling factor {factor:g}" if factor != 1 else "no top-level factor"


SGLANG_FACTOR_RULES = (_sglang_no_scaling, _sglang_original_recorded, _sglang_llama3, _sglang_factor)


def _sglang(loaded: Loaded, target: int) -> EngineLength:
    # for key in CONTEXT_LENGTH_KEYS: if val is not None: return int(rope_scaling_factor * val); return 2048
    key = next((key for key in SGLANG_KEYS if loaded.values.get(key) is not None), None)
    base = loaded.values[key] if key else 2048
    factor, why = _first(SGLANG_FACTOR_RULES, loaded.rope)
    derived = int(factor * base)
    row = EngineLength(
        "sglang", derived, derived, target, why=f"{key or 'no length key'} {base}, {why}", evidence=EVIDENCE["sglang"]
    )
    if derived >= target:
        return row
    # context_length > derived_context_len: ValueError "... set the env var SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1"
    return replace(row, flags=(f"--context-length {target}",), env=("SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1",))


# -------------------------------------------------------------------------------------------------- llama.cpp
def _llama_cpp_phi3(loaded: Loaded):
    # Phi3MiniModel: max_pos_embds = self.find_hparam(["n_positions", "max_position_embeddings"])
    return ("n_positions", "max_position_embeddings") if loaded.model_type == "phi3" else None


def _llama_cpp_text_model(loaded: Loaded):
    # TextModel: self.find_hparam(["max_position_embeddings", "n_ctx", "n_positions", "max_length",
    #                              "max_sequence_length", "model_max_length"], optional=True)
    return ("max_position_embeddings", "n_ctx", "n_positions", "max_length", "max_sequence_length", "model_max_length")


LLAMA_CPP_RULES = (_llama_cpp_phi3, _llama_cpp_text_model)


def _llama_cpp(loaded: Loaded, target: int) -> EngineLength:
    keys = _first(LLAMA_CPP_RULES, loaded)
    key = next((key for key in keys if key in loaded.values), None)  # find_hparam: the first key present
    n_ctx_train = int(loaded.values[key] or 0) if key else 0
    why = f"n_ctx_train = context_length = {key} {n_ctx_train}" if key else "no context_length key: n_ctx_train 0"
    # --ctx-size always: left unset, the context is n_ctx_train, which --fit may shrink to fit memory
    flags = (f"--ctx-size {target}",)
    if n_ctx_train < target:  # "the slot context (%d) exceeds the training context of the model (%d) - capping"
        arch = LLAMA_CPP_ARCH.get(loaded.model_type, "ARCH")
        flags += (f"--override-kv {arch}.context_length=int:{target}",)
    return EngineLength("llama.cpp", n_ctx_train, n_ctx_train, target, flags, why=why, evidence=EVIDENCE["llama.cpp"])


# ---------------------------------------------------------------------------------------------- what to print
def serve_lines(config: dict, target: int, path) -> list[str]:
    """'  vLLM: ...' lines saying how to start vLLM, SGLang and llama.cpp on the checkpoint at `path` for `target`
    tokens: only the flags needed, and where an engine derives it, that it does."""
    commands = {
        "vllm": f"vllm serve {path}",
        "sglang": f"python -m sglang.launch_server --model-path {path}",
        "llama.cpp": "llama-server -m MODEL.gguf",
    }
    lines = []
    for row in engine_lengths(config, target):
        if row.engine == "transformers":
            continue
        command = " ".join((*row.env, commands[row.engine], *row.flags))
        lines.append(f"  {NAMES[row.engine]}: {command}  ({_said(row)})")
    return lines


def _said(row: EngineLength) -> str:
    """Why the flags are what they are, in a few words."""
    if not row.servable:
        return f"cannot serve {row.target}: {row.why}"
    if row.engine == "llama.cpp":
        told = "" if row.reaches else "; llama-server caps every slot there unless overridden"
        return f"n_ctx_train {row.derived}, the GGUF's context_length{told}"
    if row.reaches:
        return f"derives {row.derived} itself"
    if row.limit >= row.target:
        return f"derives {row.limit}, but serves {row.derived} unless told"
    return f"derives {row.derived}"


def table_lines(config: dict, target: int) -> list[str]:
    """The 'lengths' table `ctxext export --check` prints: engine, derived length, serves N?, what to pass,
    evidence."""
    rows = engine_lengths(config, target)
    cells = [("engine", "derives", f"serves {target}?", "pass", "evidence")]
    for row in rows:
        derived = str(row.derived) + (f" (up to {row.limit})" if row.limit > row.derived else "")
        if not row.capped:
            derived = f"no maximum ({row.derived} written)"
        serves = "yes" if row.reaches else ("with flags" if row.servable else "no")
        cells.append((NAMES[row.engine], derived, serves, row.to_pass or "-", row.evidence))
    widths = [max(len(cell[i]) for cell in cells) for i in range(4)]
    return ["  " + "  ".join(c.ljust(w) for c, w in zip(cell, widths)) + "  " + cell[4] for cell in cells]


def _first(rules, *args):
    """The result of the first rule that matches (returns something other than None)."""
    for rule in rules:
        found = rule(*args)
        if found is not None:
            return found
    raise CtxextError("no length rule matched")  # unreachable: every table ends with a rule that always matches
