"""Extension from where the model is: the length a patch counts from, and a frequency method composed with the
scaling a model shipped.

`--factor s` means s times the trained context C (`RopeRecord.trained_context`): yarn x2 on Llama 3.1 (llama3 x8,
131072) reaches 262144. A static frequency method acts on the frequencies the model was trained with at C
(`composed_rope_parameters`), so that what the shipped scaling did inside C stays, up to the method's own rule; the
result is written as transformers' `longrope` with short = long factors (an exact form of any static per-pair
scaling), as the shipped longrope with its long factors composed (Phi-3.5/Phi-4-mini), or, where it is exact, as the
shipped type with multiplied factors (linear on linear). The old behaviour, replacing the shipped scaling and
counting from L0, is asked for with `replace_shipped` (`--replace-shipped`) or by giving L explicitly.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from ..errors import CtxextError
from ..methods import Method, MethodParams, composed_per_pair_factors, rope_inv_freq
from .families import FAMILY_ROPE_KEYS, module_frequencies
from .record import LayerTypeRope, RopeRecord
from .rope_types import keeps_p_rope


@dataclasses.dataclass(frozen=True)
class Extension:
    """Where a patch counts from and what it does with the scaling the model shipped, decided once (`extension`).

    `method_length`: the L the method is given (C, or L0 where the shipped scaling is replaced or gives way to
    plain RoPE). `composed`: the layer types whose shipped scaling a frequency method composes with. `how`: one line
    saying what happens to the shipped scaling, for the user ('' where the model ships none)."""

    method_length: int
    composed: tuple = ()
    how: str = ""


def extension(
    record: RopeRecord,
    method: Method,
    params: MethodParams,
    keys: tuple,
    remaps: bool,
    original_max_position_embeddings: int | None,
    replace_shipped: bool,
) -> Extension:
    """The L and the shipped scaling's fate for `method` on the layer types `keys` (None: the one set).

    Explicit L other than C (or `replace_shipped`, which means L0): the method counts from it and replaces whatever
    scaling it names, as before. Otherwise a frequency method counts from C and composes with a shipped static or longrope
    scaling; a remapping method keeps static shipped frequencies and remaps past C, but past L0 where the shipped
    frequencies follow the length (dynamic, longrope), which give way to plain RoPE, trained to L0 only."""
    if original_max_position_embeddings == record.trained_context:  # C given explicitly: the default
        original_max_position_embeddings = None
    shipped = {key: record.of(key) for key in keys if record.of(key).rope_type != "default"}
    scaled = {key: rope for key, rope in shipped.items() if rope.scaled}
    C, L0 = record.trained_context, record.pretraining_length
    if original_max_position_embeddings is not None or replace_shipped:
        L = original_max_position_embeddings or L0
        kept = {key: rope for key, rope in shipped.items() if rope.static}
        how = f"replaces the shipped {_names(shipped)}, counting from L = {L}" if shipped else ""
        if remaps:
            how = f"keeps the shipped {_names(kept)} and remaps past L = {L}" if kept else ""
        return Extension(L, (), how)
    if remaps:
        gives_way = [key for key, rope in shipped.items() if not rope.static]
        L = L0 if gives_way else C
        kept = {key: rope for key, rope in shipped.items() if rope.static}
        how = f"keeps the shipped {_names(kept)} and remaps past C = {C}" if kept else ""
        if gives_way:
            how = f"rotates with plain RoPE in place of the shipped {_names(shipped)} and remaps past L0 = {L0}"
        return Extension(L, (), how)
    if not scaled:  # plain RoPE, or p-RoPE's layout of the head
        p_rope = {key: rope for key, rope in shipped.items() if rope.rotated_pairs is not None}
        if p_rope and keeps_p_rope(method):
            pairs = ", ".join(
                f"{rope.rotated_pairs} of {rope.rotary_dim // 2} on {key}" for key, rope in p_rope.items()
            )
            return Extension(C, (), f"turns the pairs the shipped p-RoPE turns ({pairs}), the rest kept at frequency 0")
        return Extension(C, (), f"replaces the shipped {_names(shipped)}" if shipped else "")
    if method.is_dynamic(params):
        raise CtxextError(
            f"{method.name} follows the length from plain RoPE and does not compose with the shipped "
            f"{_names(scaled)}; use a static method, or --replace-shipped to replace the shipped scaling "
            f"(counting from L0 = {L0})"
        )
    return Extension(C, tuple(scaled), f"composes with the shipped {_names(scaled)}")


def _names(shipped: dict) -> str:
    return ", ".join(rope.describe() if key is None else f"{rope.describe()} ({key})" for key, rope in shipped.items())


def factor_for(target_length: int | None, factor: float | None, counts_from: int) -> float:
    """s from `--target-length N` (N / the length counted from) or `--factor`; both must agree."""
    if target_length is None:
        return 1.0 if factor is None else factor
    if not isinstance(target_length, int) or isinstance(target_length, bool) or target_length < 1:
        raise CtxextError(f"target_length must be a whole number of tokens, got {target_length!r}")
    wanted = target_length / counts_from
    if factor not in (None, 1.0, 1) and abs(float(factor) - wanted) > 1e-9 * wanted:
        raise CtxextError(
            f"--factor {factor:g} and --target-length {target_length} disagree (from {counts_from} tokens, "
            f"{target_length} is x{wanted:g}); give one"
        )
    return wanted


def trained_frequencies(rotary: nn.Module, rope: LayerTypeRope) -> tuple[torch.Tensor, float]:
    """(inv_freq, attention factor) a layer type was trained with at its context C: its rotary module's own for a
    static scaling, the long factors' for longrope (the set transformers uses past L0)."""
    inv_freq, scaling = module_frequencies(rotary, rope.key)
    if rope.rope_type == "longrope":
        long_factor = torch.tensor(rope.parameters["long_factor"], dtype=torch.float64)
        inv_freq = (rope_inv_freq(rope.rotary_dim, rope.base).double() / long_factor).float()
    return inv_freq, scaling


def composed_rope_parameters(
    rope: LayerTypeRope,
    method: Method,
    params: MethodParams,
    trained: tuple[torch.Tensor, float],
    trained_context: int,
    pretraining_length: int,
    new_context: int,
) -> dict | None:
    """The rope parameters of `method` composed with the layer type's shipped scaling (see the module's text), or
    None where the composition changes nothing (method none): the shipped parameters then stay."""
    inv_freq, shipped_attention = trained
    if bool((inv_freq == 0).any()):
        raise CtxextError(
            f"{method.name} does not compose with the shipped {rope.describe()}: it sets some frequencies to 0, which "
            "no longrope form can scale; use --replace-shipped to replace it"
        )
    factors, attention = composed_per_pair_factors(
        method, params, inv_freq, rope.rotary_dim, rope.base, trained_context
    )
    shipped = rope.parameters
    if rope.rope_type == "longrope":
        shipped_long = shipped["long_factor"]
    else:
        shipped_long = (rope_inv_freq(rope.rotary_dim, rope.base).double() / inv_freq.double()).tolist()
    if attention == 1.0 and all(abs(f - k) <= 1e-12 * k for f, k in zip(factors, shipped_long)):
        return None
    family = {name: shipped[name] for name in FAMILY_ROPE_KEYS if name in shipped}
    if rope.rope_type == "linear" and method.name == "linear":  # exact as one linear: the factors multiply
        return {**shipped, "factor": float(shipped["factor"]) * float(params.factor)}
    written = {
        "rope_type": "longrope",
        "rope_theta": float(shipped["rope_theta"]),
        "factor": new_context / pretraining_length,
        "original_max_position_embeddings": pretraining_length,
        "short_factor": [float(f) for f in shipped.get("short_factor", factors)]
        if rope.rope_type == "longrope"
        else [float(f) for f in factors],
        "long_factor": [float(f) for f in factors],
        "attention_factor": float(shipped_attention * attention),
        **family,
    }
    if "partial_rotary_factor" in shipped:
        written["partial_rotary_factor"] = shipped["partial_rotary_factor"]
    return written
