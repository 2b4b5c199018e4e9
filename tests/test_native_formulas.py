"""`llama3` and `longrope` against their published formulas, written out here in float64.

ctxext delegates both methods to transformers, so comparing them with transformers' own function would test
that function against itself. The oracles below are the formulas as their authors state them:

- Llama 3.1 (Meta's `apply_scaling` in the llama-models reference code; model card values factor 8,
  low_freq_factor 1, high_freq_factor 4, original context 8192): with wavelength λ_i = 2π/θ_i,
  λ_i < L/high_freq_factor keeps θ_i, λ_i > L/low_freq_factor divides it by s, and in between
  θ'_i = (1 - γ)·θ_i/s + γ·θ_i with γ = (L/λ_i - low_freq_factor) / (high_freq_factor - low_freq_factor).
  No attention factor (1).
- LongRoPE (Ding et al. 2024; Phi-3's "su"/longrope scaling): θ'_i = θ_i / λ_i with the per-pair rescale
  factors λ = long_factor when the current length l exceeds L, short_factor otherwise (l = L is short);
  attention factor sqrt(1 + ln s / ln L) for s > 1 (1 otherwise), unless `attention_factor` is given.
"""

import math

import pytest
import torch

from ctxext.methods import compute_inv_freq, get_method
from tests.helpers import tiny_model

TOL = 1e-6


def ours(name, rotary_dim, base, original, seq_len=None, **params):
    method = get_method(name)
    return compute_inv_freq(method, method.make_params(**params), rotary_dim, base, original, seq_len)


def rope_theta(rotary_dim, base):
    return [base ** (-2 * i / rotary_dim) for i in range(rotary_dim // 2)]


def assert_close_rel(actual: torch.Tensor, expected: list[float], tol=TOL):
    assert actual.shape == (len(expected),)
    expected = torch.tensor(expected, dtype=torch.float64)
    rel = ((actual.double() - expected).abs() / expected.abs()).max().item()
    assert rel <= tol, f"max relative error {rel:.3g} > {tol}"


# ------------------------------------------------------------------------------------------------- llama3
def llama3_reference(rotary_dim, base, original, factor, low_freq_factor, high_freq_factor):
    """Per pair: (θ'_i, band) with band 'kept', 'divided' or 'smooth'."""
    low_freq_wavelength = original / low_freq_factor  # longer wavelengths are interpolated by s
    high_freq_wavelength = original / high_freq_factor  # shorter ones are kept
    out = []
    for theta in rope_theta(rotary_dim, base):
        wavelength = 2 * math.pi / theta
        if wavelength < high_freq_wavelength:
            out.append((theta, "kept"))
        elif wavelength > low_freq_wavelength:
            out.append((theta / factor, "divided"))
        else:
            gamma = (original / wavelength - low_freq_factor) / (high_freq_factor - low_freq_factor)
            out.append(((1 - gamma) * theta / factor + gamma * theta, "smooth"))
    return out


LLAMA3_CASES = [
    # (rotary_dim, base, L, factor, low_freq_factor, high_freq_factor)
    (128, 500000.0, 8192, 8.0, 1.0, 4.0),  # Llama 3.1 8B/70B/405B
    (64, 500000.0, 8192, 32.0, 1.0, 4.0),  # Llama 3.2 1B (head_dim 64, factor 32)
    (64, 10000.0, 4096, 4.0, 1.0, 4.0),
    (64, 10000.0, 2048, 16.0, 2.0, 8.0),
    (128, 1000000.0, 16384, 2.0, 0.5, 3.0),
    (16, 10000.0, 64, 8.0, 1.0, 4.0),  # the tiny test models
]


@pytest.mark.parametrize("rotary_dim,base,original,factor,low,high", LLAMA3_CASES)
def test_llama3_formula(rotary_dim, base, original, factor, low, high):
    reference = llama3_reference(rotary_dim, base, original, factor, low, high)
    for seq_len in (None, original, 3 * original):  # llama3 does not depend on the current length
        inv_freq, attention = ours(
            "llama3", rotary_dim, base, original, seq_len, factor=factor, low_freq_factor=low, high_freq_factor=high
        )
        assert_close_rel(inv_freq, [theta for theta, _ in reference])
        assert attention == pytest.approx(1.0, abs=TOL)


def test_llama3_cases_reach_every_band():
    """The Llama 3.1 case has pairs in all three bands, so the test above checks each branch of the formula."""
    bands = {band for _, band in llama3_reference(*LLAMA3_CASES[0])}
    assert bands == {"kept", "divided", "smooth"}


def test_llama3_smooth_band_is_strictly_between():
    """In the smooth band the reference lies strictly between θ/s and θ (a sanity check on the oracle)."""
    rotary_dim, base, original, factor, low, high = LLAMA3_CASES[0]
    thetas = rope_theta(rotary_dim, base)
    smooth = [(t, new) for t, (new, band) in zip(thetas, llama3_reference(*LLAMA3_CASES[0])) if band == "smooth"]
    assert smooth and all(t / factor < new < t for t, new in smooth)


# ----------------------------------------------------------------------------------------------- longrope
def longrope_reference(rotary_dim, base, original, factor, short_factor, long_factor, seq_len, attention_factor=None):
    rescale = long_factor if seq_len is not None and seq_len > original else short_factor
    inv_freq = [theta / lam for theta, lam in zip(rope_theta(rotary_dim, base), rescale)]
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
    return inv_freq, attention_factor


def rescale_factors(pairs, low, high, power):
    """A deterministic, increasing list of per-pair factors from `low` to `high` (searched factors look so)."""
    return [low + (high - low) * (i / (pairs - 1)) ** power for i in range(pairs)]


LONGROPE_CASES = [
    # (rotary_dim, base, L, factor, short_factor, long_factor, attention_factor)
    # Phi-3-mini-128k's shape: head_dim 96, L 4096, s = 131072/4096 = 32.
    (96, 10000.0, 4096, 32.0, rescale_factors(48, 1.0, 3.0, 2.0), rescale_factors(48, 1.0, 60.0, 1.5), None),
    (64, 10000.0, 2048, 8.0, rescale_factors(32, 1.0, 1.2, 1.0), rescale_factors(32, 1.1, 12.0, 3.0), None),
    (64, 10000.0, 2048, 8.0, rescale_factors(32, 1.0, 1.2, 1.0), rescale_factors(32, 1.1, 12.0, 3.0), 1.25),
    (16, 10000.0, 64, 4.0, rescale_factors(8, 1.0, 1.1, 1.0), rescale_factors(8, 1.5, 4.0, 1.0), None),
    (16, 10000.0, 64, 1.0, [1.0] * 8, [1.0] * 8, None),  # s = 1: attention factor 1
]


@pytest.mark.parametrize("rotary_dim,base,original,factor,short,long,attention", LONGROPE_CASES)
def test_longrope_formula(rotary_dim, base, original, factor, short, long, attention):
    extra = {} if attention is None else {"attention_factor": attention}
    for seq_len in (None, 1, original - 1, original, original + 1, 5 * original):
        expected, expected_attention = longrope_reference(
            rotary_dim, base, original, factor, short, long, seq_len, attention
        )
        inv_freq, attention_factor = ours(
            "longrope",
            rotary_dim,
            base,
            original,
            seq_len,
            factor=factor,
            short_factor=short,
            long_factor=long,
            **extra,
        )
        assert_close_rel(inv_freq, expected)
        assert attention_factor == pytest.approx(expected_attention, rel=TOL)


def test_longrope_defaults():
    """ctxext's documented defaults: short_factor all 1 (plain RoPE up to L), long_factor all equal to s."""
    rotary_dim, base, original, factor = 64, 10000.0, 4096, 8.0
    for seq_len in (None, original, original + 1):
        expected, expected_attention = longrope_reference(
            rotary_dim, base, original, factor, [1.0] * 32, [factor] * 32, seq_len
        )
        inv_freq, attention = ours("longrope", rotary_dim, base, original, seq_len, factor=factor)
        assert_close_rel(inv_freq, expected)
        assert attention == pytest.approx(expected_attention, rel=TOL)
    assert expected_attention == pytest.approx(math.sqrt(1 + math.log(8) / math.log(4096)))


def test_longrope_in_a_patched_model_switches_at_the_current_length():
    """Through `ctxext.patch`: the rotary module's cos/sin at l positions use the short set for l <= L, the
    long set for l > L, and carry the attention factor."""
    import ctxext

    rotary_dim, base, original, factor, short, long, _ = LONGROPE_CASES[3]
    model = ctxext.patch(
        tiny_model("llama"),
        "longrope",
        factor=factor,
        short_factor=short,
        long_factor=long,
        original_max_position_embeddings=original,
    )
    rotary = model.model.rotary_emb
    x = torch.zeros(1, 1, 16)
    for length in (original, original + 1, 3 * original):
        positions = torch.arange(length)[None]
        inv_freq, a = longrope_reference(rotary_dim, base, original, factor, short, long, length)
        angles = torch.arange(length, dtype=torch.float64)[:, None] * torch.tensor(inv_freq, dtype=torch.float64)
        angles = torch.cat([angles, angles], dim=-1)[None]
        cos, sin = rotary(x, positions)
        torch.testing.assert_close(cos.double(), angles.cos() * a, rtol=0, atol=1e-4)
        torch.testing.assert_close(sin.double(), angles.sin() * a, rtol=0, atol=1e-4)
