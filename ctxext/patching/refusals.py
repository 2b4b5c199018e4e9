"""Why an attention-level method cannot go on a model: one ordered table of small rules, the first that matches wins.

Each rule reads an `AttentionRequest` (plain data: the model's rope layout, the layers the method would go on, the
attention implementation, a few config values) and returns the one-line reason, or None. The order is the order a
user meets the reasons in, most basic first: a layer whose forward never calls the attention interface (nothing
ctxext installs there would run), what the rotary layout cannot express (multimodal sections, complex
angles), what the attention implementation cannot run, where the method has no layer to act on, what the attention
computes beyond softmax(q.k) v (latent attention, other angle layouts, soft-capping, sinks), a sliding window
shorter than the context, and values of another head size. `patch` asks it before anything changes; installing
the attention (also when a saved checkpoint loads) asks it again.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from transformers.utils.generic import is_flash_attention_requested

from .families import RopeLayout

# The attention implementations a remapping method reads the mask of and hands its first region back to (flash
# ones are recognised by transformers' own test).
REMAPPING_IMPLEMENTATIONS = ("eager", "sdpa", "flex_attention")


@dataclasses.dataclass(frozen=True)
class AttentionRequest:
    """What the rules need to know about one attention-level patch."""

    method: str  # the method's name ('' for log-n or a query temperature alone)
    remaps: bool  # a remapping method (it forms softmax(q.k) v itself), not only a query scaling
    layout: RopeLayout
    layers: tuple[int, ...]  # the attention layers the method goes on
    implementation: str  # the attention implementation it would wrap
    length: int | None  # the context the model will run to (its sliding windows must reach it)
    config_window: int | None  # the config's one sliding window (None where off)
    config_extras: tuple[str, ...] = ()  # what the config adds to softmax(q.k): attn_logit_softcapping, ...

    @property
    def name(self) -> str:
        return self.method or "log-n scaling"


Rule = Callable[[AttentionRequest], "str | None"]


def attention_interface_bypassed(r: AttentionRequest) -> str | None:
    """ctxext's attention function runs only where the layer's forward calls transformers' attention interface:
    a forward of its own (Unsloth's fast attention; a family that attends in its own code) would train or
    generate unpatched."""
    bypasses = r.layout.interface_bypasses
    for index in (i for i in r.layers if i < len(bypasses) and bypasses[i]):
        origin = bypasses[index]
        if origin.split("module '")[-1].startswith("transformers.models."):
            fix = "this family attends in its own code; use a frequency method"
        else:
            fix = "load the model without the library that replaced it (Unsloth's fast attention does), or use a frequency method"
        return (
            f"{r.name} would not take effect: {r.layout.attention_classes[index]} (layer {index}) runs {origin}, "
            f"which never calls transformers' attention interface (ALL_ATTENTION_FUNCTIONS), where ctxext's "
            f"attention runs; {fix}"
        )
    return None


def multimodal_sections(r: AttentionRequest) -> str | None:
    if r.remaps and r.layout.sections is not None:
        return (
            f"{r.method} remaps one position per token; {r.layout.model_type} uses multimodal RoPE, whose rotary pairs "
            "read 3 position sections (temporal, height, width), which ctxext's remapping methods do not remap; "
            "use a frequency method"
        )
    return None


def complex_angles(r: AttentionRequest) -> str | None:
    if r.remaps and r.layout.angles == "complex" and not r.layout.latent_attention:
        return (
            f"{r.method} rotates rotate-half pairs; {r.layout.model_type} applies RoPE as complex multiplication of "
            "interleaved channel pairs (its rotary module returns complex freqs_cis), which ctxext's remapping "
            "methods do not support; use a frequency method"
        )
    return None


def implementation(r: AttentionRequest) -> str | None:
    inner = r.implementation
    if not r.remaps or inner in REMAPPING_IMPLEMENTATIONS:
        return None
    if is_flash_attention_requested(requested_attention_implementation=inner):
        return None
    return (
        f"{r.method} cannot run under attn_implementation='{inner}'; load the model with "
        f"one of {', '.join(REMAPPING_IMPLEMENTATIONS)} or a FlashAttention implementation"
    )


def _short_windows(r: AttentionRequest, windows) -> str | None:
    short = [w for w in windows if w is not None and r.length is not None and w < r.length]
    if not short:
        return None
    return (
        f"{r.method} cannot run with sliding-window attention ({min(short)} tokens, shorter than the model's "
        f"{r.length}); set sliding_window to null in config.json (or config.sliding_window = None) first"
    )


def every_layer_slides_within_L(r: AttentionRequest) -> str | None:
    """No layer to act on because each slides within L: the config's sliding window is the reason, where set."""
    if r.remaps and not r.layers:
        return _short_windows(r, [r.config_window])
    return None


def no_layer(r: AttentionRequest) -> str | None:
    if not r.layers:
        return (
            f"{r.name} has no layer to act on: every RoPE layer of this model is a sliding-window layer that never "
            "sees past L (or NoPE)"
        )
    return None


def latent_attention(r: AttentionRequest) -> str | None:
    if r.remaps and r.layout.latent_attention:
        return (
            f"{r.method} remaps positions in whole rotate-half heads; this model uses multi-head latent "
            f"attention (MLA, {r.layout.model_type}: RoPE on a separate qk_rope_head_dim slice), which ctxext's "
            "remapping methods do not support; use a frequency method (yarn is DeepSeek's own)"
        )
    return None


def other_angle_layout(r: AttentionRequest) -> str | None:
    if r.remaps and r.layout.angles != "halves":
        return (
            f"{r.method} rotates rotate-half pairs; this model lays its rotary angles out "
            f"{r.layout.angles} ({r.layout.model_type}), which ctxext's remapping methods do not support"
        )
    return None


def config_extras(r: AttentionRequest) -> str | None:
    if r.remaps and r.config_extras:
        return f"{r.method} does not implement {r.config_extras[0]} ({r.layout.model_type}); use a frequency method"
    return None


def short_sliding_window(r: AttentionRequest) -> str | None:
    if r.remaps:
        return _short_windows(r, [r.layout.windows[i] for i in r.layers])
    return None


def attention_sinks(r: AttentionRequest) -> str | None:
    for index in r.layers if r.remaps else ():
        if r.layout.sinks[index]:
            return (
                f"{r.method} does not implement attention sinks ({r.layout.attention_classes[index]}.sinks, layer "
                f"{index}); use a frequency method"
            )
    return None


def value_head_size(r: AttentionRequest) -> str | None:
    for index in r.layers if r.remaps else ():
        sizes = r.layout.value_head_dims[index]
        if sizes is not None:
            value_dim, head_dim = sizes
            return (
                f"{r.method} needs values of the query/key head size; {r.layout.attention_classes[index]} has "
                f"v_head_dim {value_dim} and head_dim {head_dim} (layer {index}); use a frequency method"
            )
    return None


RULES: tuple[Rule, ...] = (
    attention_interface_bypassed,
    multimodal_sections,
    complex_angles,
    implementation,
    every_layer_slides_within_L,
    no_layer,
    latent_attention,
    other_angle_layout,
    config_extras,
    short_sliding_window,
    attention_sinks,
    value_head_size,
)


def first_refusal(request: AttentionRequest, rules: tuple[Rule, ...] = RULES) -> str | None:
    """The reason of the first rule that matches, or None where the method can go on the model."""
    for rule in rules:
        reason = rule(request)
        if reason is not None:
            return reason
    return None
