"""RoPE context-extension methods: pure math, no model code.

`METHODS` maps a name to a `Method` (parameters dataclass + inv_freq function); see docs/METHODS.md.
"""

from . import attention, frequency, native, remapping  # noqa: F401  (registers the methods)  # noqa: F401  (attention-level methods: listed after the frequency methods)
from .frequency import composed_per_pair_factors, per_pair_factors, rope_inv_freq
from .registry import METHODS, Method, MethodParams, compute_inv_freq, get_method

__all__ = [
    "METHODS",
    "Method",
    "MethodParams",
    "composed_per_pair_factors",
    "compute_inv_freq",
    "get_method",
    "per_pair_factors",
    "rope_inv_freq",
]
