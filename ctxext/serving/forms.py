"""The rope parameters a patched checkpoint is written with: the exact native form of a method where one exists.

A serving engine (vLLM, SGLang, plain transformers) knows transformers' rope types and nothing of ctxext's.
Most static frequency methods still have an exact native form:

- a base change (`ntk`, `theta`) is rope type `default` with the new `rope_theta`;
- any other static per-pair rule (`ntk_fixed`, `ntk_mixed`, `ntk_by_parts`, yarn's 'ratio' ramp, searched or
  not) is `longrope` with short_factor = long_factor = theta_i / theta'_i per pair and an explicit attention
  factor: with equal factors, longrope's switch between its short and long sets cannot matter to transformers
  or vLLM. SGLang rotates the token at position L as position 0 when no position past L is in its batch (its
  index runs from the short cos/sin cache into the long one); `ctxext export --engine sglang` moves L in the
  written longrope past the served length, where the switch never happens (ctxext.serving.engines).

Dynamic methods other than dynamic NTK, and the attention-level methods, have no exact native form; they keep
ctxext's own types. config.json then carries both spellings: `rope_parameters` (transformers 5) and
`rope_scaling` plus `rope_theta` (what transformers 4.x and the engines pinned to it read).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from ..errors import CtxextError
from ..methods import Method, MethodParams
from ..methods.frequency import yarn_mscale
from ..methods.remapping import RemapParams
from ..patching import ScaledRotaryEmbedding, rotary_host
from ..patching.families import (
    FAMILY_ROPE_KEYS,
    config_refusal,
    is_nested,
    missing_base,
    missing_base_error,
    own_partial_rotary_factor,
)
from ..patching.rope_types import equal_sets_longrope, rope_parameters_for, with_float_numbers

FORMATS = ("native", "ctxext")


@dataclass(frozen=True)
class RopeForm:
    """The rope parameters to write, whether transformers computes them without ctxext, and how (one line)."""

    rope_parameters: dict
    native: bool
    how: str


def no_native_form(method: Method, params: MethodParams) -> str | None:
    """Why `method` with `params` has no exact form among transformers' rope types, or None if it has one."""
    if issubclass(method.params_cls, RemapParams):
        return f"'{method.name}' remaps positions inside attention; no rope type expresses it"
    if method.is_dynamic(params) and method.rope_type(params).startswith("ctxext_"):
        return (
            f"'{method.name}' recomputes its frequencies from the current length; transformers' only such type "
            f"is dynamic NTK ('dynamic')"
        )
    return None


def rope_form(
    method: Method,
    params: MethodParams,
    rotary_dim: int,
    base: float,
    original_max_position_embeddings: int,
    partial_rotary_factor: float | None = None,
    format: str = "native",
) -> RopeForm:
    """The rope parameters that reproduce `method` with `params` when the checkpoint is loaded again.

    format 'native': transformers' own types wherever an exact form exists (ctxext's types otherwise);
    'ctxext': ctxext's types for everything transformers has no type of the same name for.
    """
    if format not in FORMATS:
        raise CtxextError(f"unknown format '{format}'; choose one of: {', '.join(FORMATS)}")
    L = original_max_position_embeddings
    ctxext_parameters = rope_parameters_for(method, params, rotary_dim, base, L, partial_rotary_factor)
    rope_type = ctxext_parameters["rope_type"]
    if not rope_type.startswith("ctxext_"):
        return RopeForm(for_engines(ctxext_parameters), True, f"transformers' own '{rope_type}' type")
    if format == "ctxext":
        return RopeForm(ctxext_parameters, False, f"ctxext's '{rope_type}' type (--format ctxext)")
    reason = no_native_form(method, params)
    if reason is not None:
        return RopeForm(ctxext_parameters, False, f"ctxext's '{rope_type}' type: {reason}")

    extra = {} if partial_rotary_factor is None else {"partial_rotary_factor": partial_rotary_factor}
    if method.new_base is not None:
        new_base = float(method.new_base(rotary_dim, base, params))
        # L is kept so that patching the checkpoint again scales from it (transformers only warns about the key).
        return RopeForm(
            {"rope_type": "default", "rope_theta": new_base, "original_max_position_embeddings": L, **extra},
            True,
            f"a base change: 'default' with rope_theta {base:g} -> {new_base:g}",
        )
    return RopeForm(
        for_engines(equal_sets_longrope(method, params, rotary_dim, base, L, partial_rotary_factor)),
        True,
        "'longrope' with short_factor = long_factor = theta_i/theta'_i per pair",
    )


def for_engines(rope_parameters: dict) -> dict:
    """Add the keys vLLM and SGLang read where they do not read transformers' own.

    - longrope: both take the cos/sin scale from `short_mscale`/`long_mscale` and otherwise compute
      sqrt(1 + ln(max_position_embeddings/L)/ln L) themselves (vLLM 0.33, SGLang 0.5.23).
    - yarn with an explicit attention factor a: SGLang and vLLM before 0.33 ignore it and multiply their own
      0.1 ln s + 1 by `attn_factor`, so attn_factor = a / (0.1 ln s + 1).
    - dynamic: vLLM 0.33 scales the base from `max_trained_positions` (default: max_position_embeddings, which
      leaves the base unscaled), as b * (s * max_position_embeddings / max_trained_positions - (s - 1))^(d/(d-2));
      with L there and max_position_embeddings overridden to L x s at serving time (`ctxext export` prints the
      flags), that is transformers' base for a sequence of L x s tokens. config.json keeps
      max_position_embeddings = L: transformers' 'dynamic' scales from it.
    transformers computes from its own keys and only warns that it does not know these.
    """
    out = dict(rope_parameters)
    if out["rope_type"] == "longrope" and "attention_factor" in out:
        out["short_mscale"] = out["long_mscale"] = out["attention_factor"]
    if out["rope_type"] == "yarn" and out.get("attention_factor") is not None:
        out["attn_factor"] = out["attention_factor"] / yarn_mscale(out["factor"])
    if out["rope_type"] == "dynamic" and "original_max_position_embeddings" in out:
        out["max_trained_positions"] = out["original_max_position_embeddings"]
    return out


def with_both_spellings(config: dict, rope_parameters: dict) -> dict:
    """A config.json dict with `rope_parameters` (transformers 5) and `rope_scaling` + `rope_theta` (4.x).

    Every config.json ctxext writes goes through here: the engines' float parameters are written as floats
    (`with_float_numbers`), whatever form the parameters came in (a checkpoint loaded as it is included)."""
    require_base(rope_parameters)
    rope_parameters = with_float_numbers(rope_parameters)
    out = dict(config)
    out["rope_parameters"] = dict(rope_parameters)
    out["rope_theta"] = rope_parameters["rope_theta"]
    scaling = {k: v for k, v in rope_parameters.items() if k not in ("rope_theta", "partial_rotary_factor")}
    # 4.x writes no rope_scaling for plain RoPE; its readers take a missing one as 'default'.
    out["rope_scaling"] = None if scaling["rope_type"] == "default" else scaling
    if "partial_rotary_factor" in rope_parameters:
        out["partial_rotary_factor"] = rope_parameters["partial_rotary_factor"]
    return out


def require_base(rope_parameters: dict) -> None:
    """No config.json ctxext writes has a rope parameter set without its base (`missing_base`): transformers and
    the engines could not build its rotary."""
    where = missing_base(rope_parameters)
    if where is not None:
        raise missing_base_error(where, "ctxext will not write a config.json whose rotary cannot be built")


def model_rope_form(model, format: str = "native") -> RopeForm:
    """The rope form of whatever `ctxext.patch` applied to `model` (its config's own parameters if unpatched)."""
    host = rotary_host(model)
    scaled = host.rotary_emb
    kept = _kept_scaling(scaled) if isinstance(scaled, ScaledRotaryEmbedding) and scaled.shipped else ""
    if is_nested(host.config.rope_parameters):  # one entry per layer type (Gemma 3): transformers' own form
        nested = dict(host.config.rope_parameters)
        native = all(not values["rope_type"].startswith("ctxext_") for values in nested.values())
        return RopeForm(nested, native, "nested by layer type, as transformers reads it" + kept)
    if not isinstance(scaled, ScaledRotaryEmbedding):
        rope_parameters = dict(host.config.rope_parameters)
        return RopeForm(rope_parameters, not rope_parameters["rope_type"].startswith("ctxext_"), "as loaded")
    if scaled.composed_keys:  # composed with a shipped scaling: `patch` recorded its native form (compose.py),
        rope_parameters = for_engines(dict(host.config.rope_parameters))  # with the cos/sin scale engines read
        return RopeForm(
            rope_parameters,
            not rope_parameters["rope_type"].startswith("ctxext_"),
            f"'{rope_parameters['rope_type']}': {scaled.method.name} composed with the model's shipped scaling",
        )
    if scaled.shipped:  # a remapping method on shipped static scaling: the frequencies (and form) are the model's
        rope_parameters = dict(host.config.rope_parameters)
        native = not rope_parameters["rope_type"].startswith("ctxext_")
        return RopeForm(rope_parameters, native, f"the model's shipped '{rope_parameters['rope_type']}' type" + kept)
    form = rope_form(
        scaled.method,
        scaled.params,
        scaled.rotary_dim,
        scaled.base,
        scaled.original_max_position_embeddings,
        own_partial_rotary_factor(host.config.rope_parameters),
        format,
    )
    if config_refusal(host.config, form.rope_parameters) is not None:  # Phi-3, PhiMoE: what `patch` recorded
        return RopeForm(dict(host.config.rope_parameters), True, "the only form this family's config takes")
    return with_family_keys(form, host.config.rope_parameters)


def _kept_scaling(scaled) -> str:
    """What a remapping method on shipped static scaling keeps, and how to count a longer trained reach than L."""
    L, reach = scaled.original_max_position_embeddings, scaled.undo.max_position_embeddings
    told = f"; {scaled.method.name} keeps the shipped scaling of {', '.join(str(k or 'every layer') for k in scaled.shipped)}"
    if reach and reach > L:  # a long-context stage the recorded L does not count
        told += (
            f" and remaps past L = {L}: to count the {reach} tokens the scaling reaches as trained, patch with "
            f"--original-max-position-embeddings {reach}"
        )
    return told


def with_family_keys(form: RopeForm, rope_parameters: dict) -> RopeForm:
    """`form` with the keys the family's own code reads beside the rope type (FAMILY_ROPE_KEYS: Ministral 3's
    llama_4_scaling_beta, Qwen3.5's mrope_section), copied from `rope_parameters`: a method's form never names them,
    and the family's model fails to build (llama_4_scaling_beta) or reads other sections without them."""
    kept = {key: rope_parameters[key] for key in FAMILY_ROPE_KEYS if key in rope_parameters}
    return dataclasses.replace(form, rope_parameters={**form.rope_parameters, **kept}) if kept else form


def text_config_of(config: dict) -> dict:
    """The part of a config.json dict that holds the rope and the lengths: a vision-language model's text_config,
    else the whole config."""
    return config["text_config"] if isinstance(config.get("text_config"), dict) else config


def with_text_config(config: dict, text: dict) -> dict:
    """`config` with the part `text_config_of` returns replaced by `text`."""
    return {**config, "text_config": text} if text_config_of(config) is not config else text


def write_config_for_serving(model, folder, format: str = "native") -> RopeForm:
    """Rewrite `folder`/config.json, just written by `model.save_pretrained`, with the model's rope form in both
    spellings. The caller writes `folder` atomically; this only replaces one file inside it."""
    form = model_rope_form(model, format)
    path = Path(folder) / "config.json"
    written = json.loads(path.read_text())
    # a vision-language model keeps its language model's rope in text_config
    config = text_config_of(written)
    if is_nested(form.rope_parameters):  # no 4.x spelling nests by layer type: transformers 5's form alone
        require_base(form.rope_parameters)
        config["rope_parameters"] = with_float_numbers(form.rope_parameters)
    else:
        config = with_both_spellings(config, form.rope_parameters)
    path.write_text(json.dumps(with_text_config(written, config), indent=2, sort_keys=True) + "\n")
    return form
