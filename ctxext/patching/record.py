"""The model's rope record: what a checkpoint ships about its rotary position embedding, read once from its config.

Most checkpoints users download already ship long-context scaling: Llama 3.1 (`llama3` x8 over 8192, served at
131072), Qwen's card recipe (yarn x4 over 32768, `max_position_embeddings` left at 32768 or 40960), Gemma 3 (linear
x8 on its full-attention layers only), gpt-oss (yarn x32 over 4096), Phi-3.5/Phi-4-mini (`longrope` with short and
long factors over 4096). `rope_record(config)` turns a config into one `RopeRecord`: per layer type the rope
parameters as shipped, their base and rotated width; the pre-training length L0; and the **trained context C**, the
length the model serves now, from which every extension counts (`trained_context`). Every consumer (patch, compare,
search, eval, checkpoint, the serving forms) reads these facts here instead of reading `rope_theta` or
`rope_parameters` itself (tests/test_rope_record.py enforces it).
"""

from __future__ import annotations

import copy
import dataclasses

from ..errors import CtxextError
from ..methods.frequency import p_rope_pairs
from .families import (
    FULL,
    default_layer_type,
    head_dim_of,
    is_nested,
    layer_config,
    layer_rope_parameters,
    missing_base,
    missing_base_error,
    own_partial_rotary_factor,
    rotary_host,
    scales_statically,
    shipped_base,
)
from .rotary import ScaledRotaryEmbedding

# Shipped types whose factor says how far the scaling reaches from L0 (factor x L0). `llama3` and `longrope` do
# not: Llama 3.2 ships llama3 x32 over 8192 and serves 131072, Phi-3.5 derives its factor from
# max_position_embeddings. vLLM derives its maximum length the same way (yarn: factor x original).
REACH_BY_FACTOR = ("linear", "yarn")


@dataclasses.dataclass(frozen=True)
class LayerTypeRope:
    """One layer type's rope as shipped (key None: the one set of frequencies every layer shares)."""

    key: str | None
    parameters: dict  # the rope parameters as the config has them (a copy)
    base: float  # the base its frequencies use (HunYuan's NTK alpha applied)
    rotary_dim: int  # channels rotated per head
    partial_rotary_factor: float | None  # the share of each head rotated, where the model rotates part of it

    @property
    def rope_type(self) -> str:
        return self.parameters.get("rope_type", self.parameters.get("type", "default"))

    @property
    def static(self) -> bool:
        """Whether the shipped frequencies are scaled once for every length (linear, yarn, llama3, ...)."""
        return scales_statically(self.parameters)

    @property
    def scaled(self) -> bool:
        """Whether the layer type ships a scaling a frequency method composes with: a static one, or longrope.
        Not p-RoPE (`proportional`, Gemma 4, LFM): a layout of the head that leaves some pairs unrotated, which a
        frequency method replaces as it replaces plain RoPE."""
        return (self.static and self.rope_type != "proportional") or self.rope_type == "longrope"

    @property
    def rotated_pairs(self) -> int | None:
        """p-RoPE (rope type `proportional`: Gemma 4's full-attention layers): the int(p x d // 2) pairs that turn,
        p being its partial_rotary_factor; the rest turn by frequency 0. None where every pair turns."""
        if self.rope_type != "proportional":
            return None
        return p_rope_pairs(float(self.parameters.get("partial_rotary_factor", 1.0)), self.rotary_dim)

    def describe(self) -> str:
        """'llama3 x8', 'yarn x4', 'longrope', 'default'."""
        factor = self.parameters.get("factor")
        text = f"{self.rope_type} x{float(factor):g}" if factor and self.rope_type != "longrope" else self.rope_type
        if self.rotated_pairs is not None:
            text += f" (p-RoPE: {self.rotated_pairs} of {self.rotary_dim // 2} pairs turn)"
        return text


@dataclasses.dataclass(frozen=True)
class RopeRecord:
    """What a model ships about its RoPE, read once (`rope_record`). Plain data.

    `types`: {layer type (None: the one set): LayerTypeRope}. `pretraining_length` L0: the pre-training length (what
    a scaled config records as original_max_position_embeddings, else max_position_embeddings).
    `trained_context` C: the length the model serves now: `max_position_embeddings`, or, where a shipped linear or
    yarn reaches farther (Qwen's card recipe leaves max_position_embeddings at 32768 under yarn x4), factor x L0.
    """

    model_type: str | None
    types: dict
    pretraining_length: int
    max_position_embeddings: int
    trained_context: int

    @property
    def full(self) -> LayerTypeRope:
        """The full-attention layers' rope (the one set where the config does not nest by layer type): the layers
        whose context an extension moves."""
        if None in self.types:
            return self.types[None]
        return self.types.get(FULL) or self.types[default_layer_type(sorted(self.types))]

    @property
    def base(self) -> float:
        """The full-attention layers' base (Gemma 3: 1e6, not its sliding layers' 1e4)."""
        return self.full.base

    @property
    def rotary_dim(self) -> int:
        return self.full.rotary_dim

    def of(self, key: str | None) -> LayerTypeRope:
        """The rope of a layer type (None: the full-attention layers')."""
        if key is None or key not in self.types:
            return self.full
        return self.types[key]

    @property
    def shipped_scaling(self) -> dict:
        """{layer type: 'llama3 x8'} for each layer type that ships a scaling (empty for plain RoPE)."""
        return {key: rope.describe() for key, rope in self.types.items() if rope.rope_type != "default"}

    def describe(self) -> str:
        """One line: 'L0 8192, trained context C 131072, shipped: llama3 x8'."""
        shipped = self.shipped_scaling
        names = ", ".join(text if key is None else f"{text} on {key}" for key, text in shipped.items())
        return (
            f"L0 {self.pretraining_length}, trained context C {self.trained_context}, "
            f"shipped scaling: {names or 'none (plain RoPE)'}"
        )


def rope_record(config, saved: dict | None = None) -> RopeRecord:
    """The record of a config (no weights needed). `saved`, what an in-memory patch saved of the config
    (`rope_parameters`, `max_position_embeddings`, Phi-3's top-level `original_max_position_embeddings`), replaces
    the config's own values: the record is of the model as shipped."""
    saved = saved or {}
    rope_parameters = saved.get("rope_parameters", getattr(config, "rope_parameters", None)) or {}
    max_position_embeddings = saved.get("max_position_embeddings", getattr(config, "max_position_embeddings", None))
    top_level_L0 = saved.get(
        "original_max_position_embeddings", getattr(config, "original_max_position_embeddings", None)
    )
    where = missing_base(rope_parameters)
    if where is not None:
        raise missing_base_error(where, f"model type '{getattr(config, 'model_type', None) or type(config).__name__}'")
    keys = sorted(rope_parameters) if is_nested(rope_parameters) else [None]
    types = {}
    for key in keys:
        parameters = copy.deepcopy(layer_rope_parameters(rope_parameters, key))
        if "rope_theta" not in parameters:
            continue
        dim = _rotary_dim(config, parameters, key)
        types[key] = LayerTypeRope(
            key,
            parameters,
            shipped_base(parameters, dim),
            dim,
            own_partial_rotary_factor(parameters, layer_config(config, key)),
        )
    if not types:
        name = getattr(config, "model_type", None) or type(config).__name__
        raise CtxextError(f"{name} has no rotary position embedding (RoPE): there is nothing for ctxext to scale")
    record = RopeRecord(getattr(config, "model_type", None), types, 0, int(max_position_embeddings or 0), 0)
    full = record.full.parameters
    L0 = int(full.get("original_max_position_embeddings") or top_level_L0 or max_position_embeddings)
    return dataclasses.replace(
        record, pretraining_length=L0, trained_context=trained_context(full, L0, int(max_position_embeddings or L0))
    )


def trained_context(parameters: dict, pretraining_length: int, max_position_embeddings: int) -> int:
    """C: max_position_embeddings, or factor x L0 where a shipped linear or yarn reaches farther."""
    rope_type = parameters.get("rope_type", parameters.get("type", "default"))
    factor = parameters.get("factor")
    if rope_type in REACH_BY_FACTOR and factor and "original_max_position_embeddings" in parameters:
        return max(max_position_embeddings, int(round(float(factor) * pretraining_length)))
    return max_position_embeddings


def _rotary_dim(config, parameters: dict, key: str | None) -> int:
    """Channels rotated per head of one layer type, from its own configuration (Gemma 4's full layers: head 512)."""
    return int(head_dim_of(config, key) * (own_partial_rotary_factor(parameters, layer_config(config, key)) or 1.0))


# In the config: the rope the model had before ctxext first changed it (in `patch.shipped_rope`'s form), written by
# `patch` and kept by later patches; config.json carries it, so that a checkpoint ctxext wrote, reloaded, can be
# patched again from its source (`recorded_source`), not from the base a native form raised.
SOURCE_KEY = "ctxext_source_rope"


def recorded_source(config) -> dict | None:
    """The rope a config records as the one before ctxext changed it (SOURCE_KEY), or None where it has none."""
    value = getattr(config, SOURCE_KEY, None)
    return copy.deepcopy(value) if isinstance(value, dict) and isinstance(value.get("rope_parameters"), dict) else None


def model_rope_record(model) -> RopeRecord:
    """The record of a loaded model as shipped: an in-memory patch is looked through."""
    return host_rope_record(rotary_host(model))


def host_rope_record(host) -> RopeRecord:
    """`model_rope_record` of the module that owns `rotary_emb` (families.rotary_host)."""
    return rope_record(host.config, as_shipped(host))


def as_shipped(host) -> dict:
    """The rope of the module that owns `rotary_emb` as it shipped, looking through an in-memory patch (the one
    place that does): its rope parameters (a copy), max_position_embeddings and, where the config has one, its
    top-level original_max_position_embeddings (Phi-3); the form `rope_record` reads as `saved` and ctxext.yaml
    keeps as `source_rope`."""
    undo = host.rotary_emb.undo if isinstance(host.rotary_emb, ScaledRotaryEmbedding) else None
    config = host.config
    shipped = {
        "rope_parameters": copy.deepcopy(undo.rope_parameters if undo else config.rope_parameters),
        "max_position_embeddings": undo.max_position_embeddings if undo else config.max_position_embeddings,
    }
    if undo is not None and undo.has_top_level_original_length:
        shipped["original_max_position_embeddings"] = undo.original_max_position_embeddings
    elif undo is None and hasattr(config, "original_max_position_embeddings"):
        shipped["original_max_position_embeddings"] = config.original_max_position_embeddings
    return shipped
