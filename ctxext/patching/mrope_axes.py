"""Axis-selective scaling of multimodal RoPE: a frequency method on some position sections only.

MRoPE (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, GLM-4V, Qwen 3.5) hands its rotary pairs to three position sections:
temporal, height and width (`mrope_section`). Over an image or a video the height and width positions stay within
the picture's size, and only the temporal positions (and text) grow with a long input; Qwen2.5-VL's card warns that
plain YaRN on every pair "has a significant impact on the performance of temporal and spatial localization". So
`mrope_sections` scales the chosen sections' pairs by the method and leaves the others as trained: each pair's
frequency is divided by the method's own factor theta_i / theta'_i where its section is chosen, by 1 elsewhere, with
the method's attention factor. That is LongRoPE's form with equal short and long factor sets, which transformers
computes exactly (`longrope`, with `mrope_section` kept beside it); no engine offers the knob itself.
"""

from __future__ import annotations

from ..errors import CtxextError
from ..methods import Method, MethodParams, get_method
from ..methods.frequency import per_pair_factors
from ..methods.registry import compute_inv_freq
from ..methods.remapping import RemapParams
from .families import SECTION_NAMES, RopeLayout

SHORT_NAMES = {"t": 0, "h": 1, "w": 2}


def parse_sections(value) -> tuple[int, ...] | None:
    """The sections named by `value` ('temporal', 'height,width', ['t', 'h'], ...) as indices, or None for all."""
    if value is None:
        return None
    names = [part.strip() for part in value.split(",")] if isinstance(value, str) else list(value)
    chosen = []
    for name in names:
        index = SHORT_NAMES.get(name, SECTION_NAMES.index(name) if name in SECTION_NAMES else None)
        if index is None:
            raise CtxextError(
                f"mrope_sections: unknown section {name!r}; choose from {', '.join(SECTION_NAMES)} (or t, h, w)"
            )
        chosen.append(index)
    if not chosen:
        raise CtxextError("mrope_sections is empty; name at least one of temporal, height, width")
    return tuple(sorted(set(chosen)))


def describe_sections(sections: tuple[int, ...]) -> str:
    return "+".join(SECTION_NAMES[i] for i in sections)


def axis_selective(
    layout: RopeLayout, spec: Method, params: MethodParams, L: int, sections: tuple[int, ...]
) -> tuple[Method, MethodParams]:
    """(longrope, its parameters) that scale the pairs of `sections` as `spec` does at L and keep the others, or a
    one-line CtxextError where the model has no sections or the method is not a static frequency method."""
    if layout.sections is None:
        raise CtxextError(
            f"mrope_sections: {layout.model_type} has no multimodal RoPE sections (mrope_section); drop the option"
        )
    if isinstance(params, RemapParams) or spec.is_dynamic(params) or spec.name == "longrope":
        raise CtxextError(
            f"mrope_sections takes a static frequency method (linear, ntk, yarn, ...), not {spec.name}: "
            "its scaling is not one divisor per rotary pair"
        )
    rotary_dim, base = layout.rotary_dims[None], layout.bases[None]
    factors = per_pair_factors(spec, params, rotary_dim, base, L)
    _, attention_factor = compute_inv_freq(spec, params, rotary_dim, base, L)
    kept = [factor if section in sections else 1.0 for factor, section in zip(factors, layout.sections)]
    longrope = get_method("longrope")
    return longrope, longrope.make_params(
        factor=params.factor, short_factor=kept, long_factor=list(kept), attention_factor=float(attention_factor)
    )
