"""The scaled rotary embedding that replaces a model's `rotary_emb`.

Threads: one patched model may run forwards in several threads at once. The module's only state that changes
during a forward is a dynamic method's last (length, frequencies) pair, which is replaced as one tuple and read
once per forward, so a thread never computes with the frequencies of another thread's length.
"""

from __future__ import annotations

import torch
from torch import nn

from ..methods import Method, MethodParams, compute_inv_freq


class ScaledRotaryEmbedding(nn.Module):
    """Drop-in `rotary_emb`: forward(x, position_ids) -> (cos, sin), computed in float32, cast to x.dtype.

    Dynamic methods recompute their frequencies from the current length l = max(position_ids) + 1,
    statelessly: the same positions always give the same (cos, sin).
    """

    def __init__(
        self,
        method: Method,
        params: MethodParams,
        rotary_dim: int,
        base: float,
        original_max_position_embeddings: int,
        original: nn.Module | None = None,
    ):
        super().__init__()
        self.method = method
        self.params = params
        self.rotary_dim = rotary_dim
        self.base = base
        self.original_max_position_embeddings = original_max_position_embeddings
        self.dynamic = method.is_dynamic(params)
        # The module we replaced, kept so that `unpatch` can put it back (it follows .to() with the model).
        self.original = original
        inv_freq, self.attention_scaling = self.frequencies(None)
        # float32 always: a model cast to bf16 must not round the frequencies.
        self._inv_freq_fp32 = inv_freq
        # A dynamic method's last (length, inv_freq, attention scaling): replaced whole, never updated in place,
        # so that threads sharing the model each read a consistent triple (see the module docstring).
        self._dynamic_cache: tuple[int, torch.Tensor, float] | None = None

    @property
    def inv_freq(self) -> torch.Tensor:
        return self._inv_freq_fp32

    def frequencies(self, seq_len: int | None) -> tuple[torch.Tensor, float]:
        return compute_inv_freq(
            self.method, self.params, self.rotary_dim, self.base, self.original_max_position_embeddings, seq_len
        )

    def _inv_freq_for(self, position_ids: torch.Tensor, device) -> tuple[torch.Tensor, float]:
        if not self.dynamic:
            inv_freq, scaling = self._inv_freq_fp32, self.attention_scaling
        else:
            length = int(position_ids.max()) + 1
            cached = self._dynamic_cache
            if cached is None or cached[0] != length:
                cached = (length, *self.frequencies(length))
                self._dynamic_cache = cached
            _, inv_freq, scaling = cached
        return inv_freq.to(device), scaling

    @torch.no_grad()
    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        inv_freq, scaling = self._inv_freq_for(position_ids, x.device)
        freqs = position_ids[..., None].float() * inv_freq
        angles = torch.cat((freqs, freqs), dim=-1)
        cos = angles.cos() * scaling
        sin = angles.sin() * scaling
        return cos.to(dtype=x.dtype), sin.to(dtype=x.dtype)

    def extra_repr(self) -> str:
        return f"method={self.method.name}, params={self.params.to_dict()}, L={self.original_max_position_embeddings}"


def is_dynamic(model: nn.Module) -> bool:
    """Whether the model's rotary embedding follows the current length, so that no longest length applies: a
    dynamic (or length-dependent) ctxext method, or a rope type transformers rescales with the length."""
    from .families import rotary_host

    host = rotary_host(model)
    if isinstance(host.rotary_emb, ScaledRotaryEmbedding):
        return host.rotary_emb.dynamic
    return "dynamic" in (host.config.rope_parameters or {}).get("rope_type", "default")
