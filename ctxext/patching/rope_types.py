"""Config round trip: the `rope_parameters` a patched model records, and ctxext's rope types in transformers.

Methods with an exact transformers equivalent (linear, dynamic, yarn, llama3, longrope, proportional) are written with
transformers' own rope_type, so the saved checkpoint loads anywhere transformers' configs are understood.
The others are written as `ctxext_<method>` (`ctxext_<method>_dynamic` when dynamic) and registered here,
in `ROPE_INIT_FUNCTIONS` and as a validation method on the config mixin, when `ctxext` is imported.
A family whose config refuses both (Phi-3 takes only 'default' and 'longrope') gets a static method as
`longrope_form`: longrope with equal short and long factors, which reproduces it exactly.
"""

from __future__ import annotations

import dataclasses

from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from .. import compat
from ..errors import CtxextError
from ..methods import METHODS, Method, MethodParams, compute_inv_freq, per_pair_factors
from ..methods.frequency import on_rotated_pairs, p_rope_pairs, proportional_fraction
from ..methods.registry import method_for_rope_type
from ..methods.remapping import RemapParams
from .families import FAMILY_ROPE_KEYS, ntk_alpha, rope_parameters_of, rotary_dim

# Keys transformers accepts for its own types, beyond rope_type/rope_theta/partial_rotary_factor.
_TRANSFORMERS_KEYS = {
    "default": set(),
    "linear": {"factor"},
    "dynamic": {"factor"},
    "yarn": {
        "factor",
        "original_max_position_embeddings",
        "beta_fast",
        "beta_slow",
        "attention_factor",
        "mscale",
        "mscale_all_dim",
        "truncate",
    },
    "llama3": {"factor", "original_max_position_embeddings", "low_freq_factor", "high_freq_factor"},
    "longrope": {"factor", "original_max_position_embeddings", "short_factor", "long_factor", "attention_factor"},
    # p itself is `partial_rotary_factor` (see rope_parameters_for); transformers' validator warns about the
    # other two keys, which its proportional function reads (factor) or ctxext records (L).
    "proportional": {"factor", "original_max_position_embeddings"},
}


# Numbers the serving engines read as floats. vLLM's and SGLang's linear rope wrap a float `factor` in a list and
# take anything else for a list already, so `"factor": 4` fails to load there ("'int' object is not iterable");
# transformers accepts either. The last three are the keys those engines read instead of `attention_factor`
# (ctxext.serving.forms). Lengths (original_max_position_embeddings) stay integers.
FLOAT_KEYS = frozenset(
    {
        "factor",
        "beta_fast",
        "beta_slow",
        "attention_factor",
        "mscale",
        "mscale_all_dim",
        "low_freq_factor",
        "high_freq_factor",
        "rope_theta",
        "attn_factor",
        "short_mscale",
        "long_mscale",
    }
)
FLOAT_LIST_KEYS = frozenset({"short_factor", "long_factor"})


def with_float_numbers(rope_parameters: dict) -> dict:
    """A copy of `rope_parameters` with every integer among FLOAT_KEYS (and in the FLOAT_LIST_KEYS lists) written
    as a float: `--factor 4` is 4.0 in config.json. Other keys (lengths, flags, ctxext's own parameters) are kept.
    Parameters nested by layer type ({'full_attention': {...}, ...}) are converted inside each."""

    def as_float(value):
        return float(value) if isinstance(value, int) and not isinstance(value, bool) else value

    out = dict(rope_parameters)
    for key, value in out.items():
        if key in FLOAT_KEYS:
            out[key] = as_float(value)
        elif key in FLOAT_LIST_KEYS and isinstance(value, (list, tuple)):
            out[key] = [as_float(x) for x in value]
        elif isinstance(value, dict):
            out[key] = with_float_numbers(value)
    return out


def rope_parameters_for(
    method: Method,
    params: MethodParams,
    rotary_dim: int,
    base: float,
    original_max_position_embeddings: int,
    partial_rotary_factor: float | None = None,
) -> dict:
    """The `rope_parameters` dict that reproduces `method` with `params` when a config is loaded again.

    `partial_rotary_factor` is the model's own (the share of each head it rotates), None where it rotates all.
    """
    rope_type = method.rope_type(params)
    if rope_type == "proportional":
        p = proportional_fraction(rotary_dim, base, original_max_position_embeddings, params)
        if rotates_part_of_each_head(partial_rotary_factor):
            rope_type = f"ctxext_{method.name}"
        else:
            partial_rotary_factor = p  # transformers reads p from this key, and rotates the whole head
    values = {k: v for k, v in params.to_dict().items() if v is not None and k not in method.forced}
    if rope_type in _TRANSFORMERS_KEYS:
        values = {k: v for k, v in values.items() if k in _TRANSFORMERS_KEYS[rope_type]}
        if rope_type != "default":
            # Every scaled type records L (transformers' linear/dynamic only warn about the extra key), so
            # that patching a saved checkpoint again scales from L, not from the already-extended length.
            values["original_max_position_embeddings"] = original_max_position_embeddings
        if rope_type == "longrope":  # transformers needs the lists written out
            values.setdefault("short_factor", [1.0] * (rotary_dim // 2))
            values.setdefault("long_factor", [float(params.factor)] * (rotary_dim // 2))
    else:
        values.pop("dynamic", None)  # implied by the type's name
        values["original_max_position_embeddings"] = original_max_position_embeddings
    rope_parameters = {"rope_type": rope_type, "rope_theta": base, **values}
    if partial_rotary_factor is not None:
        rope_parameters["partial_rotary_factor"] = partial_rotary_factor
    return with_float_numbers(rope_parameters)


# p-RoPE's p beside a ctxext rope type (`p_rope_form`): the method's frequencies on the int(p d // 2) pairs that
# turn, the others at frequency 0, as the layer ships them. ctxext's name for p (the proportional method's parameter).
ROPE_PROPORTION = "rope_proportion"


def p_rope_share(rope_parameters: dict) -> float | None:
    """p where a layer type rotates with p-RoPE (transformers' `proportional`, the whole head, the int(p d // 2)
    highest-frequency pairs turning: Gemma 4's full-attention layers), else None."""
    if rope_parameters.get("rope_type") != "proportional":
        return None
    return float(rope_parameters.get("partial_rotary_factor", 1.0))


def keeps_p_rope(method: Method) -> bool:
    """Whether `method` on a p-RoPE layer turns only the pairs that layer turns: every method but `proportional`,
    which chooses its own p."""
    return method.hf_rope_type != "proportional"


def p_rope_form(
    method: Method, params: MethodParams, rotary_dim: int, base: float, original_max_position_embeddings: int, p: float
) -> dict:
    """The rope parameters of `method` on a layer type that rotates with p-RoPE of share p (`p_rope_share`), the
    pairs at frequency 0 kept so, in the form transformers computes: plain frequencies as its own `proportional`;
    linear (position interpolation) as `proportional` with the factor (transformers' proportional divides every
    frequency by it); `proportional` itself as the method writes it (it sets its own p); any other method as
    ctxext's own type with p as `rope_proportion` (transformers' yarn or llama3 there would turn every pair, or,
    given p as partial_rotary_factor, only p of the channels: 32 vs 8 in Gemma 4's attention)."""
    L = original_max_position_embeddings
    rope_type = method.rope_type(params)
    if not keeps_p_rope(method):
        return rope_parameters_for(method, params, rotary_dim, base, L)
    if rope_type in ("default", "linear"):
        values = {k: v for k, v in rope_parameters_for(method, params, rotary_dim, base, L).items() if k != "rope_type"}
        return with_float_numbers({"rope_type": "proportional", **values, "partial_rotary_factor": p})
    if method.is_dynamic(params):
        raise CtxextError(
            f"{method.name} follows the length, which on p-RoPE layers (rope type proportional, frequencies per "
            "layer type) no checkpoint reloads exactly: transformers' dynamic update of such a rotary sets "
            "attention_scaling, not the layer type's own, and recomputes longrope over every pair; use a static method"
        )
    values = {k: v for k, v in params.to_dict().items() if v is not None and k not in method.forced and k != "dynamic"}
    rope_type = method.ctxext_rope_type(params)
    return with_float_numbers(
        {
            "rope_type": rope_type,
            "rope_theta": base,
            **values,
            "original_max_position_embeddings": L,
            ROPE_PROPORTION: p,
        }
    )


def longrope_form(
    method: Method,
    params: MethodParams,
    rotary_dim: int,
    base: float,
    original_max_position_embeddings: int,
    partial_rotary_factor: float | None = None,
) -> dict | None:
    """`method` with `params` as transformers' `longrope` with short_factor = long_factor = theta_i / theta'_i per
    pair (the method's frequencies against plain RoPE's) and its attention factor a written out, for a family whose
    config takes no other scaled type (Phi-3: 'default' and 'longrope' only; PhiMoE: any type, but with
    `short_mscale`/`long_mscale`). a is written as `attention_factor`, which transformers' longrope reads; with
    `with_mscales`, also as the keys PhiMoE (and vLLM, SGLang) read instead. With equal sets, which set transformers
    picks (short up to L tokens, long past) cannot matter.

    None where no such form is exact: a method that remaps positions inside attention, or whose frequencies change
    with the length (dynamic, or longrope with different short and long factors).
    """
    L = original_max_position_embeddings
    own = rope_parameters_for(method, params, rotary_dim, base, L, partial_rotary_factor)
    equal_sets = own["rope_type"] == "longrope" and own["short_factor"] == own["long_factor"]
    if remaps_positions(method) or (method.is_dynamic(params) and not equal_sets):
        return None
    return equal_sets_longrope(method, params, rotary_dim, base, L, partial_rotary_factor)


def equal_sets_longrope(
    method: Method,
    params: MethodParams,
    rotary_dim: int,
    base: float,
    original_max_position_embeddings: int,
    partial_rotary_factor: float | None = None,
) -> dict:
    """transformers' `longrope` parameters with short_factor = long_factor = theta_i / theta'_i per pair and the
    method's attention factor: its frequencies, whatever the length (no check that the method is static)."""
    L = original_max_position_embeddings
    factors = per_pair_factors(method, params, rotary_dim, base, L)
    _, attention_factor = compute_inv_freq(method, params, rotary_dim, base, L)
    rope_parameters = {
        "rope_type": "longrope",
        "rope_theta": base,
        "factor": params.factor,
        "original_max_position_embeddings": L,
        "short_factor": factors,
        "long_factor": list(factors),
        "attention_factor": attention_factor,
    }
    if partial_rotary_factor is not None:
        rope_parameters["partial_rotary_factor"] = partial_rotary_factor
    return with_float_numbers(rope_parameters)


def remaps_positions(method: Method) -> bool:
    """Whether `method` works inside attention (a remapping method) rather than on the frequencies alone."""
    return issubclass(method.params_cls, RemapParams)


def why_no_longrope_form(method: Method) -> str:
    """Why `longrope_form` has none for `method` (which it returned None for), as part of a sentence."""
    if remaps_positions(method):
        return "it remaps positions inside attention"
    return "its frequencies change with the length"


def with_mscales(rope_parameters: dict) -> dict:
    """A longrope's attention factor a also as `short_mscale` = `long_mscale` = a: what PhiMoE's rotary multiplies
    cos/sin by (short up to L tokens, long past) in place of `attention_factor`."""
    a = rope_parameters["attention_factor"]
    return {**rope_parameters, "short_mscale": a, "long_mscale": a}


def rotates_part_of_each_head(partial_rotary_factor: float | None) -> bool:
    """Whether a model whose own partial rotary factor (`families.own_partial_rotary_factor`) is this rotates only
    part of each head, so that transformers' `proportional` (which reads that key as p and rotates the whole head)
    cannot express p-RoPE on it."""
    return partial_rotary_factor not in (None, 1, 1.0)


def params_from_rope_parameters(rope_parameters: dict) -> tuple[Method, MethodParams]:
    """Rebuild (method, params) from a ctxext rope_type's saved parameters."""
    method, implied = method_for_rope_type(rope_parameters["rope_type"])
    fields = {f.name for f in dataclasses.fields(method.params_cls)}
    skip = {"rope_type", "rope_theta", "partial_rotary_factor", "original_max_position_embeddings", ROPE_PROPORTION}
    skip |= set(FAMILY_ROPE_KEYS)
    unknown = set(rope_parameters) - fields - skip
    if unknown:
        raise CtxextError(
            f"rope_parameters for '{rope_parameters['rope_type']}' has unknown keys: {', '.join(sorted(unknown))}"
        )
    values = {k: v for k, v in rope_parameters.items() if k in fields}
    return method, method.make_params(**values, **implied)


def stateless_method_for(rope_parameters: dict) -> tuple[str, dict] | None:
    """The ctxext method (name, parameters) that computes a loaded dynamic rope type statelessly, or None.

    transformers' dynamic rotary update keeps the frequencies of the longest sequence it has seen until the
    length drops below L, so a loaded dynamic checkpoint scores a shorter window after a longer one at the
    longer one's scale: results would depend on the order of the forwards. ctxext's rotary module recomputes
    from each forward's own length. transformers' `dynamic` is ctxext's `dynamic_ntk`.
    """
    rope_type = rope_parameters.get("rope_type", "default")
    if "dynamic" not in rope_type or ntk_alpha(rope_parameters) is not None:  # HunYuan's alpha is static
        return None
    if rope_type == "dynamic":
        return "dynamic_ntk", {"factor": rope_parameters["factor"]}
    method, params = params_from_rope_parameters(rope_parameters)
    values = {k: v for k, v in params.to_dict().items() if v is not None and k not in method.forced}
    return method.name, values


def _ctxext_rope_init(config, device=None, seq_len=None, layer_type=None):
    rope_parameters = rope_parameters_of(config, layer_type)  # one layer type's, where nested by type
    method, params = params_from_rope_parameters(rope_parameters)
    if seq_len is not None:
        seq_len = int(seq_len)
    dim = rotary_dim(config, layer_type)
    inv_freq, attention_factor = compute_inv_freq(
        method, params, dim, rope_parameters["rope_theta"], rope_parameters["original_max_position_embeddings"], seq_len
    )
    if ROPE_PROPORTION in rope_parameters and keeps_p_rope(method):  # p-RoPE's layer: the pairs it turns (p_rope_form)
        inv_freq = on_rotated_pairs(inv_freq, p_rope_pairs(float(rope_parameters[ROPE_PROPORTION]), dim))
    return inv_freq.to(device), attention_factor


def _ctxext_rope_validate(self, rope_parameters, ignore_keys=None):
    if "original_max_position_embeddings" not in rope_parameters:
        raise KeyError(
            f"rope_parameters of type '{rope_parameters['rope_type']}' need 'original_max_position_embeddings'"
        )
    params_from_rope_parameters({k: v for k, v in rope_parameters.items() if k not in (ignore_keys or ())})


def ctxext_rope_types() -> list[str]:
    """Every name `Method.rope_type` can produce outside transformers' own types."""
    names = {method.name.removeprefix("dynamic_") for method in METHODS.values()}
    return sorted({f"ctxext_{name}" for name in names} | {f"ctxext_{name}_dynamic" for name in names})


def register_rope_types() -> None:
    """Make ctxext's rope types loadable by transformers (idempotent)."""
    for rope_type in ctxext_rope_types():
        ROPE_INIT_FUNCTIONS[rope_type] = _ctxext_rope_init
        compat.add_rope_validator(rope_type, _ctxext_rope_validate)
