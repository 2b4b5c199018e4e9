"""Frequency methods: each returns new inverse frequencies θ'_i and an attention factor a.

Formulas and conventions follow docs/METHODS.md (the project's reference). θ_i = b^(-2i/d) is computed in
float32 exactly as transformers computes its default RoPE, so that an unscaled method is bit-identical
to the unpatched model; per-pair scale factors are computed in float64 and applied at the end.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..errors import CtxextError
from ..validate import choice, whole_number
from .registry import DynamicParams, Method, MethodParams, _check_number, compute_inv_freq, param, register


def rope_inv_freq(rotary_dim: int, base: float) -> torch.Tensor:
    """Plain RoPE: θ_i = base^(-2i/d), float32, computed the way transformers does."""
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).to(torch.float32) / rotary_dim
    return 1.0 / (base**exponents)


def per_pair_factors(
    method: Method, params: MethodParams, rotary_dim: int, base: float, original_max_position_embeddings: int
) -> list[float]:
    """theta_i / theta'_i for each rotary pair (pair 0, the highest frequency, first): what each pair's frequency
    is divided by. longrope's factors and llama.cpp's `rope_freqs` tensor have this meaning."""
    scaled, _ = compute_inv_freq(method, params, rotary_dim, base, original_max_position_embeddings)
    return (rope_inv_freq(rotary_dim, base).double() / scaled.double()).tolist()


def composed_per_pair_factors(
    method: Method,
    params: MethodParams,
    trained_inv_freq: torch.Tensor,
    rotary_dim: int,
    base: float,
    trained_context: int,
) -> tuple[list[float], float]:
    """(theta_i / theta'_i per pair, attention factor): `method` composed with frequencies a model was trained
    with at its context C (`trained_inv_freq`, e.g. Llama 3.1's llama3 x8 at 131072), for a static method.

    The method's own rule is applied to each pair as the model knows it: a pair whose trained frequency is its plain
    one divided by k_i makes C / k_i / lambda_i turns in C tokens, so pair i takes the divisor D_i the method gives
    it on plain RoPE with L = C / k_i. For a rule by pair index (linear, NTK, ntk_fixed, ntk_mixed, theta) that is
    the rule itself, whatever L; for a rule by wavelength (NTK-by-parts, YaRN) it is the rule on the trained
    wavelengths against C. The result is k_i D_i against plain RoPE; the attention factor is the method's at C."""
    plain = rope_inv_freq(rotary_dim, base).double()
    shipped = plain / trained_inv_freq.double().cpu()  # k_i
    divisors = []
    for pair, k in enumerate(shipped.tolist()):
        scaled, _ = compute_inv_freq(method, params, rotary_dim, base, trained_context / k)
        divisors.append(float(plain[pair] / scaled[pair].double()))
    _, attention_factor = compute_inv_freq(method, params, rotary_dim, base, trained_context)
    return (shipped * torch.tensor(divisors, dtype=torch.float64)).tolist(), float(attention_factor)


def _divide(inv_freq: torch.Tensor, divisors: torch.Tensor) -> torch.Tensor:
    return (inv_freq.double() / divisors.double()).to(torch.float32)


def _pair_index(rotary_dim: int) -> torch.Tensor:
    return torch.arange(rotary_dim // 2, dtype=torch.float64)


# ---------------------------------------------------------------------------------------------- none
def none_inv_freq(rotary_dim, base, original_max_position_embeddings, params, seq_len=None):
    return rope_inv_freq(rotary_dim, base), 1.0


register(
    Method(
        name="none",
        summary="no scaling: direct extrapolation past the original length (the baseline)",
        source="Su et al. 2021, RoFormer",
        params_cls=MethodParams,
        inv_freq_fn=none_inv_freq,
        hf_rope_type="default",
    )
)


# -------------------------------------------------------------------------------------------- linear
def linear_inv_freq(rotary_dim, base, original_max_position_embeddings, params, seq_len=None):
    # Dividing θ by s is the same as reading position m as m/s.
    return rope_inv_freq(rotary_dim, base) / params.factor, 1.0


register(
    Method(
        name="linear",
        summary="Position Interpolation: every frequency divided by s",
        source="Chen et al. 2023, Extending Context Window of LLMs via Positional Interpolation",
        params_cls=DynamicParams,
        inv_freq_fn=linear_inv_freq,
        hf_rope_type="linear",
    )
)


# ----------------------------------------------------------------------------------------------- ntk
@dataclass
class NtkParams(DynamicParams):
    alpha: float | None = param(
        None,
        "NTK alpha: the lowest frequency is interpolated by exactly alpha (default: factor)",
        search=(1.0, 4.0, "log", "*factor"),
    )

    def validate(self):
        super().validate()
        _check_number("alpha", self.alpha, minimum=1.0, allow_none=True)


def ntk_base(rotary_dim: int, base: float, params: NtkParams) -> float:
    alpha = params.factor if params.alpha is None else params.alpha
    return base * alpha ** (rotary_dim / (rotary_dim - 2))


def ntk_inv_freq(rotary_dim, base, original_max_position_embeddings, params, seq_len=None):
    return rope_inv_freq(rotary_dim, ntk_base(rotary_dim, base, params)), 1.0


register(
    Method(
        name="ntk",
        summary="NTK-aware: a larger base b' = b*alpha^(d/(d-2)); high frequencies kept, lowest divided by alpha",
        source="bloc97 2023, NTK-Aware Scaled RoPE (r/LocalLLaMA)",
        params_cls=NtkParams,
        inv_freq_fn=ntk_inv_freq,
        new_base=ntk_base,
    )
)


# ----------------------------------------------------------------------------------------- ntk_fixed
def ntk_fixed_inv_freq(rotary_dim, base, original_max_position_embeddings, params, seq_len=None):
    # θ_i / μ^(i+1) with μ = s^(2/d): the lowest pair (i = d/2-1) is divided by exactly s.
    i = _pair_index(rotary_dim)
    divisors = torch.tensor(float(params.factor), dtype=torch.float64) ** (2.0 * (i + 1) / rotary_dim)
    return _divide(rope_inv_freq(rotary_dim, base), divisors), 1.0


register(
    Method(
        name="ntk_fixed",
        summary="NTK-RoPE-fixed: a true base conversion, theta_i / s^(2(i+1)/d); lowest divided by exactly s",
        source="Su 2023, kexue.fm/archives/9706",
        params_cls=DynamicParams,
        inv_freq_fn=ntk_fixed_inv_freq,
    )
)


# ----------------------------------------------------------------------------------------- ntk_mixed
@dataclass
class NtkMixedParams(DynamicParams):
    beta: float = param(0.625, "exponent beta: 1 gives ntk_fixed, 0 gives linear", search=(0.1, 2.0))

    def validate(self):
        super().validate()
        _check_number("beta", self.beta, minimum=0.0)


def ntk_mixed_inv_freq(rotary_dim, base, original_max_position_embeddings, params, seq_len=None):
    # θ_i / exp(c·(i+1)^β), c = ln(s)/(d/2)^β: the lowest pair is divided by exactly s.
    i = _pair_index(rotary_dim)
    c = math.log(params.factor) / (rotary_dim / 2) ** params.beta
    return _divide(rope_inv_freq(rotary_dim, base), torch.exp(c * (i + 1) ** params.beta)), 1.0


register(
    Method(
        name="ntk_mixed",
        summary="NTK-RoPE-mixed: theta_i / exp(c*(i+1)^beta); fast pairs extrapolate, slow pairs interpolate",
        source="Su 2023, kexue.fm/archives/9706",
        params_cls=NtkMixedParams,
        inv_freq_fn=ntk_mixed_inv_freq,
    )
)


# --------------------------------------------------------------------------------- ntk_by_parts, yarn
@dataclass
class ByPartsParams(DynamicParams):
    beta_fast: float = param(
        32.0, "pairs that turn more than beta_fast times within L are kept (extrapolated)", search=(4.0, 128.0, "log")
    )
    beta_slow: float = param(
        1.0, "pairs that turn fewer than beta_slow times within L are interpolated by s", search=(0.25, 4.0, "log")
    )
    ramp: str = param(
        "index",
        "'index': ramp linear in the pair index, as the YaRN code and transformers;"
        " 'ratio': linear in r = L/wavelength, as the YaRN paper",
    )
    truncate: bool = param(True, "round the ramp ends to whole pairs (floor/ceil), as the YaRN code does")

    def validate(self):
        super().validate()
        _check_number("beta_fast", self.beta_fast, minimum=0.0, strict=True)
        _check_number("beta_slow", self.beta_slow, minimum=0.0, strict=True)
        if self.beta_fast <= self.beta_slow:
            raise CtxextError(f"'beta_fast' ({self.beta_fast}) must be greater than 'beta_slow' ({self.beta_slow})")
        if self.ramp not in ("index", "ratio"):
            raise CtxextError(f"'ramp' must be 'index' or 'ratio', got {self.ramp!r}")

    def transformers_compatible(self) -> bool:
        return self.ramp == "index"


def yarn_correction_dim(rotations: float, rotary_dim: int, base: float, original_max_position_embeddings: int):
    """The (fractional) pair index whose wavelength fits `rotations` times into L."""
    return rotary_dim * math.log(original_max_position_embeddings / (2 * math.pi * rotations)) / (2 * math.log(base))


def by_parts_ramp(rotary_dim, base, original_max_position_embeddings, params) -> torch.Tensor:
    """Per pair, 0 = keep θ_i (extrapolate), 1 = use θ_i/s (interpolate), linear in between."""
    if params.ramp == "ratio":
        # Paper form: r_i = L/λ_i; pairs with r > beta_fast are kept, r < beta_slow interpolated.
        wavelengths = 2 * math.pi / rope_inv_freq(rotary_dim, base).double()
        ratio = original_max_position_embeddings / wavelengths
        return 1.0 - ((ratio - params.beta_slow) / (params.beta_fast - params.beta_slow)).clamp(0.0, 1.0)
    low = yarn_correction_dim(params.beta_fast, rotary_dim, base, original_max_position_embeddings)
    high = yarn_correction_dim(params.beta_slow, rotary_dim, base, original_max_position_embeddings)
    if params.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001  # avoids a division by zero, as the YaRN code does
    i = torch.arange(rotary_dim // 2, dtype=torch.float32)
    return ((i - low) / (high - low)).clamp(0.0, 1.0)


def ntk_by_parts_inv_freq(rotary_dim, base, original_max_position_embeddings, params, seq_len=None):
    if params.factor == 1:
        return rope_inv_freq(rotary_dim, base), 1.0
    ramp = by_parts_ramp(rotary_dim, base, original_max_position_embeddings, params).to(torch.float32)
    wavelength_terms = base ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).to(torch.float32) / rotary_dim)
    kept = 1 - ramp
    # This order of float32 operations is the one transformers' yarn uses, so that a `yarn` checkpoint
    # reloaded in plain transformers gives bit-identical logits.
    return (1.0 / (params.factor * wavelength_terms)) * (1 - kept) + (1.0 / wavelength_terms) * kept, 1.0


register(
    Method(
        name="ntk_by_parts",
        summary="NTK-by-parts: short wavelengths kept, long ones divided by s, a linear ramp in between",
        source="bloc97 2023; Peng et al. 2023, YaRN (section 3.2)",
        params_cls=ByPartsParams,
        inv_freq_fn=ntk_by_parts_inv_freq,
    )
)


@dataclass
class YarnParams(ByPartsParams):
    attention_factor: float | None = param(
        None, "override the attention factor a (default: 0.1*ln(s)+1, or the mscale ratio)", search=(0.9, 1.5)
    )
    mscale: float | None = param(None, "DeepSeek-style: a = m(s, mscale)/m(s, mscale_all_dim), with both set")
    mscale_all_dim: float | None = param(None, "see mscale")

    def validate(self):
        super().validate()
        _check_number("attention_factor", self.attention_factor, minimum=0.0, strict=True, allow_none=True)
        _check_number("mscale", self.mscale, allow_none=True)
        _check_number("mscale_all_dim", self.mscale_all_dim, allow_none=True)


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature: sqrt(1/t) = 0.1*mscale*ln(s) + 1 (1 inside the original length)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_attention_factor(params: YarnParams) -> float:
    if params.attention_factor is not None:
        return float(params.attention_factor)
    if params.mscale and params.mscale_all_dim:
        return yarn_mscale(params.factor, params.mscale) / yarn_mscale(params.factor, params.mscale_all_dim)
    return yarn_mscale(params.factor)


def yarn_inv_freq(rotary_dim, base, original_max_position_embeddings, params, seq_len=None):
    inv_freq, _ = ntk_by_parts_inv_freq(rotary_dim, base, original_max_position_embeddings, params)
    return inv_freq, yarn_attention_factor(params)


YARN_SUMMARY = "YaRN: NTK-by-parts frequencies plus attention temperature a = 0.1*ln(s)+1"
register(
    Method(
        name="yarn",
        summary=YARN_SUMMARY,
        source="Peng et al. 2023, YaRN: Efficient Context Window Extension of LLMs",
        params_cls=YarnParams,
        inv_freq_fn=yarn_inv_freq,
        hf_rope_type="yarn",
    )
)
register(
    Method(
        name="dynamic_yarn",
        summary="YaRN with the scale recomputed from the current length (s_eff = max(1, l/L))",
        source="Peng et al. 2023, YaRN (section 3.3)",
        params_cls=YarnParams,
        inv_freq_fn=yarn_inv_freq,
        forced={"dynamic": True},
    )
)


# ------------------------------------------------------------------------------------------- theta
@dataclass
class ThetaParams(MethodParams):
    new_base: float | None = param(
        None, "the new RoPE base b' (e.g. 1e6, as Code Llama); required", search=(1.0, 1000.0, "log", "*base")
    )

    def validate(self):
        super().validate()
        if self.new_base is None:
            raise CtxextError("method 'theta' needs 'new_base' (e.g. --new-base 1000000)")
        _check_number("new_base", self.new_base, minimum=1.0, strict=True)


def theta_inv_freq(rotary_dim, base, original_max_position_embeddings, params, seq_len=None):
    return rope_inv_freq(rotary_dim, params.new_base), 1.0


register(
    Method(
        name="theta",
        summary="base change (ABF): RoPE with an explicitly given larger base b'",
        source="Roziere et al. 2023, Code Llama; Xiong et al. 2023 (ABF)",
        params_cls=ThetaParams,
        inv_freq_fn=theta_inv_freq,
        new_base=lambda rotary_dim, base, params: float(params.new_base),
    )
)


# ------------------------------------------------------------------------------------- dynamic_ntk
@dataclass
class DynamicNtkParams(MethodParams):
    def transformers_compatible(self) -> bool:
        # transformers' formula still grows the base at s = 1; ctxext keeps "factor 1 = no scaling".
        return self.factor != 1


def dynamic_ntk_inv_freq(rotary_dim, base, original_max_position_embeddings, params, seq_len=None):
    # transformers' `dynamic`: b' = b·((s·l/L) - (s-1))^(d/(d-2)) for l > L, plain RoPE up to L.
    if params.factor == 1:
        return rope_inv_freq(rotary_dim, base), 1.0
    length = max(seq_len or 0, original_max_position_embeddings)
    s = params.factor
    grown = (s * length / original_max_position_embeddings) - (s - 1)
    return rope_inv_freq(rotary_dim, base * grown ** (rotary_dim / (rotary_dim - 2))), 1.0


register(
    Method(
        name="dynamic_ntk",
        summary="dynamic NTK: the base grows with the current length past L (transformers' 'dynamic')",
        source="emozilla 2023, Dynamically Scaled RoPE (r/LocalLLaMA)",
        params_cls=DynamicNtkParams,
        inv_freq_fn=dynamic_ntk_inv_freq,
        length_dependent=True,
        hf_rope_type="dynamic",
    )
)


# ------------------------------------------------------------------------ low-frequency clipping (p-RoPE, CoPE)
def pairs_beyond_length(rotary_dim: int, base: float, length: int) -> int:
    """How many pairs have a wavelength 2*pi/theta_i = 2*pi * b^(2i/d) (float64) longer than `length` tokens: the
    lowest-frequency pairs, which never complete one turn within the original length. Plain Python, so that it
    also runs while transformers builds a model on the meta device."""
    return sum(2 * math.pi * base ** (2 * i / rotary_dim) > length for i in range(rotary_dim // 2))


def _fraction_between_zero_and_one(name: str, value) -> None:
    _check_number(name, value, allow_none=True)
    if value is not None and not 0 < value <= 1:
        raise CtxextError(f"'{name}' must be in (0, 1], got {value!r}")


@dataclass
class ProportionalParams(MethodParams):
    rope_proportion: float | None = param(
        None,
        "p in (0, 1]: the share of pairs kept, highest frequencies first; the rest get frequency 0 (written as "
        "transformers' partial_rotary_factor; default: the pairs whose wavelength fits in L)",
        search=(0.25, 1.0),
    )

    def validate(self):
        super().validate()
        _fraction_between_zero_and_one("rope_proportion", self.rope_proportion)


def proportional_kept_pairs(rotary_dim: int, base: float, original_max_position_embeddings: int, params) -> int:
    """The number of pairs p-RoPE keeps: int(p * d // 2) as transformers rounds it, or by default the pairs whose
    wavelength fits in L."""
    if params.rope_proportion is not None:
        return int(params.rope_proportion * rotary_dim // 2)
    kept = rotary_dim // 2 - pairs_beyond_length(rotary_dim, base, original_max_position_embeddings)
    if kept == 0:
        raise CtxextError(
            f"proportional: every pair's wavelength exceeds L = {original_max_position_embeddings}, so the default "
            "keeps none; give --rope-proportion"
        )
    return kept


def proportional_fraction(rotary_dim: int, base: float, original_max_position_embeddings: int, params) -> float:
    """The p written as `partial_rotary_factor`: the one given, or the smallest float whose int(p * d // 2) (what
    transformers, vLLM and SGLang compute) is the default's number of kept pairs."""
    if params.rope_proportion is not None:
        return float(params.rope_proportion)
    kept = proportional_kept_pairs(rotary_dim, base, original_max_position_embeddings, params)
    p = kept / (rotary_dim // 2)
    while int(p * rotary_dim // 2) < kept:  # kept / pairs may round just below in binary
        p = math.nextafter(p, 2.0)
    return p


def p_rope_pairs(rope_proportion: float, rotary_dim: int) -> int:
    """The pairs p-RoPE keeps a frequency on: int(p * d // 2), as transformers' `proportional` rounds it."""
    return int(rope_proportion * rotary_dim // 2)


def on_rotated_pairs(inv_freq: torch.Tensor, pairs: int | None) -> torch.Tensor:
    """`inv_freq` on a layer that rotates only its first `pairs` pairs (p-RoPE: Gemma 4's full layers), the others
    turning by frequency 0 as it ships them; unchanged where `pairs` is None."""
    if pairs is None:
        return inv_freq
    inv_freq = inv_freq.clone()
    inv_freq[pairs:] = 0.0
    return inv_freq


def proportional_inv_freq(rotary_dim, base, original_max_position_embeddings, params, seq_len=None):
    # transformers' `proportional`: theta_i for the first int(p*d//2) pairs, 0 for the rest, all divided by s.
    kept = proportional_kept_pairs(rotary_dim, base, original_max_position_embeddings, params)
    inv_freq = rope_inv_freq(rotary_dim, base)
    inv_freq[kept:] = 0.0
    return inv_freq / params.factor, 1.0


register(
    Method(
        name="proportional",
        summary="p-RoPE: the highest-frequency share p of pairs kept, the rest set to frequency 0; all divided by s",
        source="Barbero et al. 2025, Round and Round We Go! What makes Rotary Positional Encodings useful? "
        "(ICLR 2025); Gemma 4's rope type 'proportional'",
        params_cls=ProportionalParams,
        inv_freq_fn=proportional_inv_freq,
        hf_rope_type="proportional",
    )
)


CLIP_FORMS = ("soft", "hard")


@dataclass
class CopeParams(MethodParams):
    clip_pairs: int | None = param(
        None,
        "c: how many of the lowest-frequency pairs are clipped (default: the pairs whose wavelength exceeds L)",
        search=(1, 32, "int"),
    )
    clip: str = param(
        "soft", "'soft': CoPE's raised-cosine taper over the c pairs; 'hard': HardClip, the c pairs set to 0"
    )

    def validate(self):
        super().validate()
        whole_number("clip_pairs", self.clip_pairs, minimum=1, allow_none=True)
        choice("clip", self.clip, CLIP_FORMS)

    def resolved(self, original_max_position_embeddings: int) -> CopeParams:
        return self

    def check_model(self, rotary_dim: int, num_layers: int) -> None:
        """A one-line CtxextError when an explicit c is more than this model's rotary pairs (checked before any
        weights load)."""
        check_clip_pairs(self.clip_pairs, rotary_dim // 2)


def check_clip_pairs(clip_pairs: int, pairs: int) -> None:
    if clip_pairs is not None and not 1 <= clip_pairs <= pairs:
        raise CtxextError(
            f"'clip_pairs' must be in [1, {pairs}] (this model has {pairs} rotary pairs), got {clip_pairs}"
        )


def cope_clip_pairs(rotary_dim: int, base: float, original_max_position_embeddings: int, params: CopeParams) -> int:
    """c: the one given, or the number of pairs whose wavelength 2*pi/theta_i exceeds L."""
    pairs = rotary_dim // 2
    if params.clip_pairs is not None:
        check_clip_pairs(params.clip_pairs, pairs)
        return int(params.clip_pairs)
    clipped = pairs_beyond_length(rotary_dim, base, original_max_position_embeddings)
    if clipped == 0:
        raise CtxextError(
            f"cope: no pair's wavelength exceeds L = {original_max_position_embeddings}, so the default clips "
            "nothing; give --clip-pairs"
        )
    return clipped


def cope_weights(pairs: int, clip_pairs: int, clip: str) -> torch.Tensor:
    """Per pair (pair 0 the highest frequency), the factor its frequency is multiplied by, float64: 1 for the first
    pairs - c; over the last c, CoPE's 0.5 * (1 + cos(pi * k / (c - 1))), k = 0..c-1 (1 down to exactly 0; a single
    clipped pair keeps weight 1), or 0 for HardClip."""
    weights = torch.ones(pairs, dtype=torch.float64)
    if clip == "hard":
        weights[pairs - clip_pairs :] = 0.0
    elif clip_pairs > 1:
        k = torch.arange(clip_pairs, dtype=torch.float64)
        weights[pairs - clip_pairs :] = 0.5 * (1.0 + torch.cos(math.pi * k / (clip_pairs - 1)))
    return weights


def cope_inv_freq(rotary_dim, base, original_max_position_embeddings, params, seq_len=None):
    clip_pairs = cope_clip_pairs(rotary_dim, base, original_max_position_embeddings, params)
    weights = cope_weights(rotary_dim // 2, clip_pairs, params.clip)
    return (rope_inv_freq(rotary_dim, base).double() * weights).to(torch.float32), 1.0


register(
    Method(
        name="cope",
        summary="CoPE: the last c pairs (wavelength > L) tapered to frequency 0 by a raised cosine; HardClip zeroes them",
        source="CoPE: Clipped RoPE as A Scalable Free Lunch for Long Context LLMs (arXiv 2602.05258, 2026; "
        "code: hrlics/CoPE)",
        params_cls=CopeParams,
        inv_freq_fn=cope_inv_freq,
    )
)
