"""What a patched attention module carries (`AttentionState`: the settings, the base model, the tuning knobs),
kept in the module's __dict__ under `STATE`."""

from __future__ import annotations

from torch import nn

from ...errors import CtxextError
from ...methods.attention import AttentionSettings
from ...validate import boolean
from ..remap_kernel import BACKEND_CHOICES, QUERY_BLOCK
from .memo import ForwardMemo

STATE = "_ctxext_attention"  # attribute on each patched attention module


class AttentionState:
    """What a patched attention module needs: the settings and the base model whose rotary_emb it reads.

    A plain object, not an nn.Module, so that the base model is not registered as a submodule of its own
    attention layers. `layer_type` is the layer's type where the rotary module keeps one set of frequencies per
    type (None where one set serves every layer). `query_block` and `kernel` (a remapping backend, or "auto")
    are tuning knobs (tests shrink the block to exercise it, and force each backend); `keep_keys=False` trades
    decode speed for the memory of `KeptKeys`.
    """

    def __init__(
        self,
        settings: AttentionSettings,
        host: nn.Module,
        memo: ForwardMemo,
        query_block: int = QUERY_BLOCK,
        kernel: str = "auto",
        keep_keys: bool = True,
        layer_type: str | None = None,
    ):
        if kernel not in BACKEND_CHOICES:
            raise CtxextError(f"unknown remapping backend '{kernel}'; choose one of {', '.join(BACKEND_CHOICES)}")
        if query_block < 1:
            raise CtxextError(f"query_block must be >= 1, got {query_block}")
        self.settings = settings
        self.host = host
        self.query_block = int(query_block)
        self.kernel = kernel
        self.keep_keys = boolean("keep_keys", keep_keys)
        self.memo = memo  # one per model, shared by its layers
        self.layer_type = layer_type


def state_of(module: nn.Module) -> AttentionState | None:
    """The state ctxext put on an attention module, or None where it patched nothing."""
    return module.__dict__.get(STATE)
