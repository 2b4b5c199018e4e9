"""Getting a method into a transformers model: rotary replacement, patch/unpatch, rope-type registration."""

from .families import SUPPORTED_FAMILIES, rotary_dim, rotary_host
from .patch import applied_method, patch, unpatch
from .rope_types import register_rope_types
from .rotary import ScaledRotaryEmbedding

register_rope_types()

__all__ = ["SUPPORTED_FAMILIES", "ScaledRotaryEmbedding", "applied_method", "patch", "rotary_dim", "rotary_host",
           "unpatch"]
