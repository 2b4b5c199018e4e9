"""Methods delegated to transformers' own implementation (`llama3`, `longrope`): no copy of their math.

transformers' rope functions read a model config; we hand them a minimal one built from our parameters.
"""

from __future__ import annotations

from dataclasses import dataclass

from transformers import PretrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from ..errors import CtxextError
from .registry import Method, MethodParams, _check_number, param, register


def _transformers_inv_freq(rope_type, rotary_dim, base, original_max_position_embeddings, rope_parameters, seq_len):
    config = PretrainedConfig()
    config.head_dim = rotary_dim
    config.hidden_size = rotary_dim
    config.num_attention_heads = 1
    config.max_position_embeddings = original_max_position_embeddings * rope_parameters.get("factor", 1.0)
    config.rope_parameters = {
        "rope_type": rope_type,
        "rope_theta": base,
        "original_max_position_embeddings": original_max_position_embeddings,
        **rope_parameters,
    }
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS[rope_type](config, None, seq_len=seq_len)
    return inv_freq.float(), float(attention_factor)


@dataclass
class Llama3Params(MethodParams):
    low_freq_factor: float = param(
        1.0, "wavelengths above L/low_freq_factor are divided by s", search=(0.25, 2.0, "log")
    )
    high_freq_factor: float = param(
        4.0, "wavelengths below L/high_freq_factor are kept; smooth in between", search=(2.0, 32.0, "log")
    )

    def validate(self):
        super().validate()
        _check_number("low_freq_factor", self.low_freq_factor, minimum=0.0, strict=True)
        _check_number("high_freq_factor", self.high_freq_factor, minimum=0.0, strict=True)
        if self.high_freq_factor <= self.low_freq_factor:
            raise CtxextError("'high_freq_factor' must be greater than 'low_freq_factor'")


def llama3_inv_freq(rotary_dim, base, original_max_position_embeddings, params, seq_len=None):
    return _transformers_inv_freq(
        "llama3", rotary_dim, base, original_max_position_embeddings, params.to_dict(), seq_len
    )


register(
    Method(
        name="llama3",
        summary="Llama 3.1 scaling (transformers' implementation): by-wavelength interpolation with a smooth band",
        source="Meta 2024, The Llama 3 Herd of Models",
        params_cls=Llama3Params,
        inv_freq_fn=llama3_inv_freq,
        hf_rope_type="llama3",
    )
)


@dataclass
class LongRopeParams(MethodParams):
    short_factor: list | None = param(None, "per-pair divisors used up to L (default: all 1)")
    long_factor: list | None = param(None, "per-pair divisors used past L (default: all equal to factor)")
    attention_factor: float | None = param(None, "override a (default: sqrt(1 + ln s / ln L))")

    def validate(self):
        super().validate()
        for name in ("short_factor", "long_factor"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, (list, tuple)) or not value):
                raise CtxextError(f"'{name}' must be a list of numbers, one per frequency pair")
            for item in value or []:
                _check_number(name, item, minimum=0.0, strict=True)
        _check_number("attention_factor", self.attention_factor, minimum=0.0, strict=True, allow_none=True)


def longrope_inv_freq(rotary_dim, base, original_max_position_embeddings, params, seq_len=None):
    pairs = rotary_dim // 2
    rope_parameters = {
        "factor": params.factor,
        "short_factor": list(params.short_factor or [1.0] * pairs),
        "long_factor": list(params.long_factor or [params.factor] * pairs),
    }
    for name in ("short_factor", "long_factor"):
        if len(rope_parameters[name]) != pairs:
            raise CtxextError(f"'{name}' has {len(rope_parameters[name])} entries; this model needs {pairs}")
    if params.attention_factor is not None:
        rope_parameters["attention_factor"] = params.attention_factor
    if seq_len is not None:
        seq_len = int(seq_len)
    return _transformers_inv_freq(
        "longrope", rotary_dim, base, original_max_position_embeddings, rope_parameters, seq_len
    )


register(
    Method(
        name="longrope",
        summary="LongRoPE (transformers' implementation): searched per-pair factors, short set up to L, long past it",
        source="Ding et al. 2024, LongRoPE",
        params_cls=LongRopeParams,
        inv_freq_fn=longrope_inv_freq,
        length_dependent=True,
        hf_rope_type="longrope",
    )
)
