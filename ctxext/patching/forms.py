"""The rope form of a patch, decided here and nowhere else: what the model's config holds in memory, and what a
checkpoint's config.json is written with.

`rope_parameters_to_write` (called once, by `plan_patch`) decides the in-memory form: ctxext's own types
(`rope_parameters_for`), or, where the family's config takes no other scaled type (Phi-3, PhiMoE), the method as
longrope with equal factor sets. `model_rope_form` turns that decision into the form written to config.json by
`ctxext patch`, `ctxext.save_pretrained`, `ctxext export` and fine-tuning (ctxext.serving.forms writes the file):
a serving engine (vLLM, SGLang, plain transformers) knows transformers' rope types and nothing of ctxext's, and
most static frequency methods still have an exact native form:

- a base change (`ntk`, `theta`) is rope type `default` with the new `rope_theta`;
- any other static per-pair rule (`ntk_fixed`, `ntk_mixed`, `ntk_by_parts`, yarn's 'ratio' ramp, searched or
  not) is `longrope` with short_factor = long_factor = theta_i / theta'_i per pair and an explicit attention
  factor: with equal factors, longrope's switch between its short and long sets cannot matter to transformers
  or vLLM. SGLang rotates the token at position L as position 0 when no position past L is in its batch (its
  index runs from the short cos/sin cache into the long one); `ctxext export --engine sglang` moves L in the
  written longrope past the served length, where the switch never happens (ctxext.serving.engines).

Dynamic methods other than dynamic NTK, and the attention-level methods, have no exact native form; they keep
ctxext's own types. The keys a family's own code reads beside the rope type (FAMILY_ROPE_KEYS) are carried by
one function, `with_family_keys`.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass

from torch import nn

from ..errors import CtxextError
from ..methods import Method, MethodParams, get_method
from ..methods.frequency import yarn_mscale
from ..methods.remapping import RemapParams
from .families import (
    FAMILY_ROPE_KEYS,
    RopeLayout,
    config_refusal,
    is_nested,
    layer_rope_parameters,
    own_partial_rotary_factor,
    rotary_host,
)
from .record import as_shipped
from .rope_types import (
    ROPE_PROPORTION,
    equal_sets_longrope,
    longrope_form,
    p_rope_form,
    p_rope_share,
    rope_parameters_for,
    why_no_longrope_form,
    with_mscales,
)
from .rotary import ScaledRotaryEmbedding

# Ministral 3's query temperature, one of the rope_parameters keys that belong to the family (FAMILY_ROPE_KEYS)
NATIVE_QUERY_TEMPERATURE = "llama_4_scaling_beta"


def rope_parameters_to_write(
    host: nn.Module,
    layout,
    keys: tuple,
    spec,
    method_params,
    L: int,
    native_temperature: float | None,
    shipped: tuple = (),
    composed: dict | None = None,
) -> dict:
    """{layer type (None: the one set of frequencies): the rope parameters `patch` records for it}.

    ctxext's own form (`rope_parameters_for`) where the family's config takes it; else, for a config that takes no
    other scaled type than longrope (Phi-3, PhiMoE: `families.config_refusal`), the method as longrope with equal
    factor sets (`longrope_form`), its attention factor as `attention_factor` or, where the config needs them, as
    `short_mscale`/`long_mscale` too. A method no such form expresses is a one-line CtxextError: the checkpoint
    would not save, or would not load as patched. The layer types in `shipped` keep the parameters they have (a
    remapping method on shipped static scaling); those in `composed` get the parameters given there (a frequency
    method composed with a shipped scaling, ctxext.patching.compose), and where the config refuses them, the patch is
    refused. Read from the unpatched model's rope parameters."""
    forms = RopeForms(
        unpatched_rope_parameters(host),
        layout,
        keys,
        spec,
        method_params,
        L,
        native_temperature,
        shipped,
        composed or {},
    )
    written = forms.with_family_keys(forms.form(rope_parameters_for))
    refusal = forms.refusal(host.config, written)
    if refusal is None:
        return written
    if composed:
        raise CtxextError(
            f"{spec.name} composed with the shipped scaling cannot be recorded in this model's config ({refusal}); "
            "use --replace-shipped to replace the shipped scaling instead"
        )
    return _written_another_way(host.config, forms, refusal)


@dataclass(frozen=True)
class RopeForms:
    """The rope parameters of each chosen layer type in one form (`rope_parameters_to_write`): the types in
    `shipped` as the unpatched model has them, those in `composed` as given there, the others as `write` says."""

    unpatched: dict
    layout: RopeLayout
    keys: tuple
    spec: Method
    method_params: MethodParams
    L: int
    native_temperature: float | None
    shipped: tuple
    composed: dict

    def form(self, write) -> dict:
        return {key: self._one(key, write) for key in self.keys}

    def _one(self, key, write) -> dict | None:
        own = layer_rope_parameters(self.unpatched, key)
        if key in self.shipped:
            return copy.deepcopy(own)
        if key in self.composed:
            return copy.deepcopy(self.composed[key])
        dims, base = self.layout.rotary_dims[key], self.layout.bases[key]
        p = p_rope_share(own)
        if p is not None:  # p-RoPE (Gemma 4's full layers): the method on the pairs that turn, in one form only
            return p_rope_form(self.spec, self.method_params, dims, base, self.L, p)
        return write(self.spec, self.method_params, dims, base, self.L, own_partial_rotary_factor(own))

    def with_family_keys(self, written: dict) -> dict:
        """What the family's own code reads beside the rope type stays (and its query temperature goes in)."""
        for key, values in written.items():
            values.update(with_family_keys(values, layer_rope_parameters(self.unpatched, key)))
            if self.native_temperature is not None:
                values[NATIVE_QUERY_TEMPERATURE] = self.native_temperature
        return written

    def refusal(self, config, written: dict) -> str | None:
        return config_refusal(config, with_written(self.unpatched, written))


def _written_another_way(config, forms: RopeForms, refusal: str) -> dict:
    """Where the config refuses ctxext's own form: a remapping method's plain frequencies as the family's own
    'default' type; else the method as longrope with equal factor sets, with short/long mscales where needed."""
    spec = forms.spec
    if isinstance(forms.method_params, RemapParams):  # plain frequencies: the family's own 'default' type says so
        plain = get_method("none")
        as_plain = forms.form(lambda _, __, *rest: rope_parameters_for(plain, plain.make_params(), *rest))
        written = forms.with_family_keys(as_plain)
        if forms.refusal(config, written) is None:
            return written
    as_longrope = forms.form(longrope_form)
    if any(values is None for values in as_longrope.values()):
        raise CtxextError(
            f"{spec.name} cannot be recorded in this model's config ({refusal}), and {why_no_longrope_form(spec)}, "
            "so no longrope with equal factor sets expresses it; use a static frequency method"
        )
    for candidate in (as_longrope, {key: with_mscales(values) for key, values in as_longrope.items()}):
        candidate = forms.with_family_keys(candidate)
        if forms.refusal(config, candidate) is None:
            return candidate
    raise CtxextError(f"{spec.name} cannot be recorded in this model's config, even as longrope: {refusal}")


def unpatched_rope_parameters(host: nn.Module) -> dict:
    """The config's rope parameters before any patch (an in-memory patch is looked through)."""
    return as_shipped(host)["rope_parameters"] or {}


def with_written(rope_parameters: dict, written: dict) -> dict:
    """The config's rope parameters once `written` ({layer type or None: parameters}) replaces what it names: the
    one flat dict, or the nesting by layer type, as transformers reads it, where the other types keep theirs."""
    if list(written) == [None]:
        return written[None]
    return {key: written.get(key, value) for key, value in rope_parameters.items()}


# ------------------------------------------------------------------------------------------ the form written to config.json
FORMATS = ("native", "ctxext")


@dataclass(frozen=True)
class RopeForm:
    """The rope parameters to write, whether transformers computes them without ctxext, and how (one line)."""

    rope_parameters: dict
    native: bool
    how: str

    def with_family_keys(self, kept_from: dict) -> RopeForm:
        """The form with the family's own keys of `kept_from` (`with_family_keys`)."""
        return dataclasses.replace(self, rope_parameters=with_family_keys(self.rope_parameters, kept_from))


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
    decided: dict | None = None,
) -> RopeForm:
    """The rope parameters that reproduce `method` with `params` when the checkpoint is loaded again.

    format 'native': transformers' own types wherever an exact form exists (ctxext's types otherwise);
    'ctxext': ctxext's types for everything transformers has no type of the same name for. `decided`: the
    in-memory form `rope_parameters_to_write` chose for the method (a patched model's config), read instead of
    computed again; without it (a method not patched into a model), `rope_parameters_for`'s.
    """
    if format not in FORMATS:
        raise CtxextError(f"unknown format '{format}'; choose one of: {', '.join(FORMATS)}")
    L = original_max_position_embeddings
    ctxext_parameters = (
        dict(decided)
        if decided is not None
        else rope_parameters_for(method, params, rotary_dim, base, L, partial_rotary_factor)
    )
    rope_type = ctxext_parameters["rope_type"]
    if not rope_type.startswith("ctxext_"):
        return RopeForm(for_engines(ctxext_parameters), True, f"transformers' own '{rope_type}' type")
    if format == "ctxext":
        return RopeForm(ctxext_parameters, False, f"ctxext's '{rope_type}' type (--format ctxext)")
    reason = no_native_form(method, params)
    if ROPE_PROPORTION in ctxext_parameters:  # p-RoPE's frequency-0 pairs: no theta_i/theta'_i factor keeps them
        reason = "a p-RoPE layer's pairs that do not turn, which transformers' types would turn"
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


def model_rope_form(model, format: str = "native") -> RopeForm:
    """The rope form of whatever `ctxext.patch` applied to `model` (its config's own parameters if unpatched)."""
    host = rotary_host(model)
    scaled = host.rotary_emb
    shipped = isinstance(scaled, ScaledRotaryEmbedding) and scaled.shipped
    kept = _kept_scaling(scaled, as_shipped(host)["max_position_embeddings"]) if shipped else ""
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
        decided=host.config.rope_parameters,  # what the plan decided (rope_parameters_to_write), not decided again
    )
    if config_refusal(host.config, form.rope_parameters) is not None:  # Phi-3, PhiMoE: what `patch` recorded
        return RopeForm(dict(host.config.rope_parameters), True, "the only form this family's config takes")
    return form.with_family_keys(host.config.rope_parameters)


def _kept_scaling(scaled, reach: int | None) -> str:
    """What a remapping method on shipped static scaling keeps, and how to count a longer trained reach than L
    (`reach`: the max_position_embeddings it shipped)."""
    L = scaled.original_max_position_embeddings
    told = f"; {scaled.method.name} keeps the shipped scaling of {', '.join(str(k or 'every layer') for k in scaled.shipped)}"
    if reach and reach > L:  # a long-context stage the recorded L does not count
        told += (
            f" and remaps past L = {L}: to count the {reach} tokens the scaling reaches as trained, patch with "
            f"--original-max-position-embeddings {reach}"
        )
    return told


def with_family_keys(rope_parameters: dict, kept_from: dict) -> dict:
    """`rope_parameters` with the keys the family's own code reads beside the rope type (FAMILY_ROPE_KEYS: Ministral
    3's llama_4_scaling_beta, Qwen3.5's mrope_section), copied from `kept_from`: a method's form never names them, and
    the family's model fails to build (llama_4_scaling_beta) or reads other sections without them."""
    return {**rope_parameters, **{key: kept_from[key] for key in FAMILY_ROPE_KEYS if key in kept_from}}
