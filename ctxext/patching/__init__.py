"""Getting a method into a transformers model: rotary replacement, patch/unpatch, rope-type registration."""

from .attention import register_load_hook
from .families import RopeLayout, rope_layout, rotary_dim, rotary_host
from .patch import applied_method, patch, trained_context_of, unpatch
from .record import RopeRecord, model_rope_record, rope_record
from .rope_types import register_rope_types
from .rotary import ScaledRotaryEmbedding, is_dynamic, original_rotary_within

register_rope_types()
register_load_hook()  # models built from a config with `ctxext_attention` come up patched

__all__ = [
    "RopeLayout",
    "RopeRecord",
    "ScaledRotaryEmbedding",
    "applied_method",
    "is_dynamic",
    "model_rope_record",
    "original_rotary_within",
    "patch",
    "rope_layout",
    "rope_record",
    "rotary_dim",
    "rotary_host",
    "trained_context_of",
    "unpatch",
]
