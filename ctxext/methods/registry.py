"""The method registry: a name, a parameters dataclass and one pure function per method.

Every frequency function has the same signature,

    fn(rotary_dim, base, original_max_position_embeddings, params, seq_len=None) -> (inv_freq, attention_factor)

with `inv_freq` a float32 tensor of length rotary_dim // 2. `seq_len` is the current total length (KV cache
included); only length-dependent methods (the dynamic variants, longrope) read it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import CtxextError, did_you_mean
from ..validate import boolean, number


def param(default, help: str, **kwargs):
    """A dataclass field that carries its help text (shown by `ctxext methods` and `--help`)."""
    return field(default=default, metadata={"help": help, **kwargs})


@dataclass
class MethodParams:
    """Parameters every method accepts."""

    factor: float = param(1.0, "scale s = L'/L: the new context is s times the original one (>= 1)")

    def validate(self) -> None:
        _check_number("factor", self.factor, minimum=1.0)

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def transformers_compatible(self) -> bool:
        """Whether transformers' rope type of the same name computes exactly these parameters."""
        return True


@dataclass
class DynamicParams(MethodParams):
    """Parameters of frequency methods that can be made dynamic."""

    dynamic: bool = param(False, "recompute the scale from the current length: s_eff = max(1, l/L)")

    def validate(self) -> None:
        super().validate()
        boolean("dynamic", self.dynamic)


def _check_number(name: str, value, minimum: float | None = None, strict: bool = False, allow_none=False):
    """The methods' name for `ctxext.validate.number` (kept: every params dataclass calls it)."""
    number(name, value, minimum=minimum, strict=strict, allow_none=allow_none)


InvFreqFn = Callable[..., tuple[torch.Tensor, float]]


@dataclass(frozen=True)
class Method:
    name: str
    summary: str  # one line, shown by `ctxext methods`
    source: str  # the paper or post it comes from
    params_cls: type[MethodParams]
    inv_freq_fn: InvFreqFn
    length_dependent: bool = False  # reads seq_len even when not `dynamic` (dynamic_ntk, longrope)
    hf_rope_type: str | None = None  # the transformers rope_type with identical behaviour, if any
    forced: dict = field(default_factory=dict)  # parameter values the method fixes (dynamic_yarn: dynamic=True)
    # For a method that is plain RoPE at another base: fn(rotary_dim, base, params) -> the new base b'.
    new_base: Callable[[int, float, MethodParams], float] | None = None

    def is_dynamic(self, params: MethodParams) -> bool:
        return self.length_dependent or bool(getattr(params, "dynamic", False))

    def rope_type(self, params: MethodParams) -> str:
        """The `rope_type` a patched config records: the transformers name where one matches exactly."""
        if self.hf_rope_type and not getattr(params, "dynamic", False) and params.transformers_compatible():
            return self.hf_rope_type
        return self.ctxext_rope_type(params)

    def ctxext_rope_type(self, params: MethodParams) -> str:
        """ctxext's own rope type of the method: `ctxext_<name>`, `ctxext_<name>_dynamic` where it is dynamic."""
        # "dynamic" in the name makes transformers recompute frequencies as the length grows.
        base_name = self.name.removeprefix("dynamic_")
        return f"ctxext_{base_name}_dynamic" if self.is_dynamic(params) else f"ctxext_{base_name}"

    def make_params(self, **values) -> MethodParams:
        """Build and validate parameters; unknown keys get a 'did you mean'."""
        names = [f.name for f in dataclasses.fields(self.params_cls)]
        for key in values:
            if key not in names:
                raise CtxextError(
                    f"method '{self.name}' has no parameter '{key}'{did_you_mean(key, names)};"
                    f" its parameters are: {', '.join(names)}"
                )
        for key, forced_value in self.forced.items():
            if key in values and values[key] != forced_value:
                raise CtxextError(f"method '{self.name}' always has {key}={forced_value}")
        params = self.params_cls(**{**values, **self.forced})
        params.validate()
        return params

    def param_help(self) -> list[tuple[str, Any, str]]:
        return [
            (f.name, f.default, f.metadata.get("help", ""))
            for f in dataclasses.fields(self.params_cls)
            if f.name not in self.forced
        ]


METHODS: dict[str, Method] = {}


def register(method: Method) -> Method:
    METHODS[method.name] = method
    return method


def method_for_rope_type(rope_type: str) -> tuple[Method, dict]:
    """Inverse of `Method.rope_type` for ctxext's own types: the method and the values the name implies."""
    name = rope_type.removeprefix("ctxext_")
    if name.endswith("_dynamic"):
        return get_method(name.removesuffix("_dynamic")), {"dynamic": True}
    return get_method(name), {}


def get_method(name: str) -> Method:
    if name not in METHODS:
        raise CtxextError(f"unknown method '{name}'{did_you_mean(name, METHODS)}; run 'ctxext methods' to list them")
    return METHODS[name]


def compute_inv_freq(
    method: Method,
    params: MethodParams,
    rotary_dim: int,
    base: float,
    original_max_position_embeddings: int,
    seq_len: int | None = None,
) -> tuple[torch.Tensor, float]:
    """inv_freq and attention factor for `method`, at the current length where the method is dynamic."""
    if getattr(params, "dynamic", False) and not method.length_dependent and params.factor != 1:
        # The generic dynamic rule: the scale follows the length, never below 1. factor 1 still means
        # "no scaling" for every method, dynamic or not.
        length = original_max_position_embeddings if seq_len is None else seq_len
        s_eff = max(1.0, length / original_max_position_embeddings)
        params = dataclasses.replace(params, factor=s_eff)
    return method.inv_freq_fn(rotary_dim, base, original_max_position_embeddings, params, seq_len=seq_len)
