"""The frequency functions against independent oracles: transformers' own rope types, and the docs/METHODS.md
formulas written out naively in float64 Python."""

import math

import pytest
import torch
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from ctxext.errors import CtxextError
from ctxext.methods import METHODS, compute_inv_freq, get_method
from tests.helpers import tiny_config

D, BASE, L = 64, 10000.0, 4096


def ours(name, rotary_dim=D, base=BASE, original=L, seq_len=None, **params):
    method = get_method(name)
    return compute_inv_freq(method, method.make_params(**params), rotary_dim, base, original, seq_len)


def theta(i, d=D, b=BASE):
    return b ** (-2 * i / d)


def assert_rel(actual: torch.Tensor, expected, rtol=1e-6):
    expected = torch.as_tensor(expected, dtype=torch.float64)
    assert actual.shape == expected.shape
    rel = ((actual.double() - expected).abs() / expected.abs()).max().item()
    assert rel <= rtol, f"max relative error {rel:.3g} > {rtol}"


# ----------------------------------------------------------------------- against transformers' rope types
def transformers_inv_freq(family, rope_parameters, seq_len=None, **config_overrides):
    config = tiny_config(family, rope_parameters={"rope_theta": BASE, **rope_parameters}, **config_overrides)
    inv_freq, attention = ROPE_INIT_FUNCTIONS[rope_parameters["rope_type"]](config, None, seq_len=seq_len)
    return config, inv_freq, attention


NATIVE_CASES = [
    ("linear", {"factor": 4.0}, {"rope_type": "linear", "factor": 4.0}),
    ("yarn", {"factor": 4.0}, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}),
    (
        "yarn",
        {"factor": 8.0, "beta_fast": 16.0, "beta_slow": 2.0},
        {
            "rope_type": "yarn",
            "factor": 8.0,
            "beta_fast": 16.0,
            "beta_slow": 2.0,
            "original_max_position_embeddings": 64,
        },
    ),
    (
        "yarn",
        {"factor": 4.0, "mscale": 0.707, "mscale_all_dim": 1.0},
        {
            "rope_type": "yarn",
            "factor": 4.0,
            "mscale": 0.707,
            "mscale_all_dim": 1.0,
            "original_max_position_embeddings": 64,
        },
    ),
    (
        "yarn",
        {"factor": 4.0, "attention_factor": 1.3},
        {"rope_type": "yarn", "factor": 4.0, "attention_factor": 1.3, "original_max_position_embeddings": 64},
    ),
]


@pytest.mark.parametrize("name,params,rope_parameters", NATIVE_CASES)
@pytest.mark.parametrize("head_dim", [16, 64, 128])
def test_static_methods_equal_transformers(name, params, rope_parameters, head_dim):
    config, expected, expected_attention = transformers_inv_freq(
        "llama", rope_parameters, head_dim=head_dim, max_position_embeddings=64
    )
    inv_freq, attention = ours(name, rotary_dim=head_dim, original=64, **params)
    assert_rel(inv_freq, expected)
    assert attention == pytest.approx(expected_attention, rel=1e-12)


@pytest.mark.parametrize("seq_len", [None, 32, 64, 65, 100, 1000])
@pytest.mark.parametrize("factor", [2.0, 4.0])
def test_dynamic_ntk_equals_transformers_dynamic(seq_len, factor):
    _, expected, _ = transformers_inv_freq("llama", {"rope_type": "dynamic", "factor": factor}, seq_len=seq_len)
    assert_rel(ours("dynamic_ntk", rotary_dim=16, original=64, seq_len=seq_len, factor=factor)[0], expected)


def test_partial_rotary_factor_matches_transformers_yarn():
    config, expected, _ = transformers_inv_freq(
        "qwen3",
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "partial_rotary_factor": 0.5},
        head_dim=32,
    )
    from ctxext.patching import rotary_dim

    assert rotary_dim(config) == 16
    assert_rel(ours("yarn", rotary_dim=16, original=64, factor=4.0)[0], expected)


# -------------------------------------------------------------------------- against docs/METHODS.md formulas
@pytest.mark.parametrize("factor,alpha", [(4.0, None), (4.0, 6.0), (2.0, None)])
def test_ntk_formula(factor, alpha):
    a = factor if alpha is None else alpha
    new_base = BASE * a ** (D / (D - 2))
    expected = [theta(i, b=new_base) for i in range(D // 2)]
    inv_freq, attention = ours("ntk", factor=factor, alpha=alpha)
    assert_rel(inv_freq, expected)
    assert attention == 1.0
    assert inv_freq[0].item() == 1.0  # the highest frequency is kept
    assert inv_freq[-1].item() == pytest.approx(theta(D // 2 - 1) / a, rel=1e-6)  # the lowest divided by alpha


@pytest.mark.parametrize("factor", [2.0, 4.0, 16.0])
def test_ntk_fixed_formula(factor):
    mu = factor ** (2 / D)
    expected = [theta(i) / mu ** (i + 1) for i in range(D // 2)]
    inv_freq, _ = ours("ntk_fixed", factor=factor)
    assert_rel(inv_freq, expected)
    assert inv_freq[-1].item() == pytest.approx(theta(D // 2 - 1) / factor, rel=1e-6)


@pytest.mark.parametrize("beta", [0.3, 0.625, 0.9])
@pytest.mark.parametrize("factor", [2.0, 8.0])
def test_ntk_mixed_formula(beta, factor):
    c = math.log(factor) / (D / 2) ** beta
    expected = [theta(i) / math.exp(c * (i + 1) ** beta) for i in range(D // 2)]
    inv_freq, _ = ours("ntk_mixed", factor=factor, beta=beta)
    assert_rel(inv_freq, expected)
    assert inv_freq[-1].item() == pytest.approx(theta(D // 2 - 1) / factor, rel=1e-6)


def test_ntk_mixed_limits_are_ntk_fixed_and_linear():
    assert_rel(ours("ntk_mixed", factor=4.0, beta=1.0)[0], ours("ntk_fixed", factor=4.0)[0].double())
    assert_rel(ours("ntk_mixed", factor=4.0, beta=0.0)[0], ours("linear", factor=4.0)[0].double())


def naive_by_parts(factor, beta_fast=32.0, beta_slow=1.0, d=D, b=BASE, original=L):
    def corr(r):
        return d * math.log(original / (2 * math.pi * r)) / (2 * math.log(b))

    low = max(math.floor(corr(beta_fast)), 0)
    high = min(math.ceil(corr(beta_slow)), d - 1)
    if low == high:
        high += 0.001
    out = []
    for i in range(d // 2):
        ramp = min(max((i - low) / (high - low), 0.0), 1.0)
        out.append(theta(i, d, b) * (1 - ramp) + theta(i, d, b) / factor * ramp)
    return out


@pytest.mark.parametrize("factor,beta_fast,beta_slow", [(4.0, 32.0, 1.0), (2.0, 32.0, 1.0), (8.0, 16.0, 2.0)])
def test_ntk_by_parts_formula(factor, beta_fast, beta_slow):
    inv_freq, attention = ours("ntk_by_parts", factor=factor, beta_fast=beta_fast, beta_slow=beta_slow)
    assert_rel(inv_freq, naive_by_parts(factor, beta_fast, beta_slow))
    assert attention == 1.0
    yarn_freq, yarn_attention = ours("yarn", factor=factor, beta_fast=beta_fast, beta_slow=beta_slow)
    assert torch.equal(inv_freq, yarn_freq)
    assert yarn_attention == pytest.approx(0.1 * math.log(factor) + 1)


def test_by_parts_ratio_ramp_is_the_papers_formula():
    factor, alpha, beta = 4.0, 1.0, 32.0
    expected = []
    for i in range(D // 2):
        r = L / (2 * math.pi / theta(i))
        gamma = 0.0 if r < alpha else 1.0 if r > beta else (r - alpha) / (beta - alpha)
        expected.append((1 - gamma) * theta(i) / factor + gamma * theta(i))
    assert_rel(ours("ntk_by_parts", factor=factor, ramp="ratio")[0], expected)


def test_theta_is_plain_rope_with_the_new_base():
    assert_rel(ours("theta", factor=4.0, new_base=1e6)[0], [theta(i, b=1e6) for i in range(D // 2)])


@pytest.mark.parametrize("name", ["linear", "ntk", "ntk_fixed", "ntk_mixed", "yarn"])
def test_generic_dynamic_uses_the_length_ratio(name):
    # Inside L: no scaling at all. Past L: the static method at s_eff = l/L, whatever the configured factor.
    unscaled = ours("none")[0]
    assert torch.equal(ours(name, factor=4.0, dynamic=True, seq_len=L)[0], unscaled)
    assert torch.equal(ours(name, factor=4.0, dynamic=True, seq_len=None)[0], unscaled)
    dynamic = ours(name, factor=4.0, dynamic=True, seq_len=3 * L)
    static = ours(name, factor=3.0)
    assert torch.equal(dynamic[0], static[0]) and dynamic[1] == static[1]
    assert torch.equal(ours("dynamic_yarn", factor=4.0, seq_len=3 * L)[0], ours("yarn", factor=3.0)[0])


# theta, proportional (p-RoPE's zeroed pairs) and cope (CoPE's clip) change frequencies whatever the factor.
@pytest.mark.parametrize("name", [n for n in METHODS if n not in ("theta", "proportional", "cope")])
def test_factor_one_is_plain_rope(name):
    inv_freq, attention = ours(name, factor=1.0)
    assert torch.equal(inv_freq, ours("none")[0]), name
    # STRING's attention factor does not follow the scale: the reference code always scales cos and sin by
    # 0.1 ln 2 + 1; attention_factor=1 turns it off.
    assert attention == (0.1 * math.log(2) + 1 if name == "string" else 1.0)
    if name == "string":
        assert ours(name, factor=1.0, attention_factor=1.0)[1] == 1.0


# --------------------------------------------------------------------------------------- validation
@pytest.mark.parametrize(
    "name,params,message",
    [
        ("yarn", {"factor": 0.5}, "'factor' must be >= 1"),
        ("yarn", {"factor": "four"}, "'factor' must be a number"),
        ("yarn", {"factor": float("nan")}, "'factor' must be a number"),
        ("yarn", {"factor": 2.0, "beta_fast": 1.0, "beta_slow": 2.0}, "must be greater than"),
        ("yarn", {"factor": 2.0, "beat_fast": 3}, "did you mean 'beta_fast'"),
        ("ntk", {"factor": 2.0, "alpha": 0.5}, "'alpha' must be >= 1"),
        ("theta", {"factor": 2.0}, "needs 'new_base'"),
        ("ntk_by_parts", {"factor": 2.0, "ramp": "linear"}, "'ramp' must be"),
        ("dynamic_yarn", {"factor": 2.0, "dynamic": False}, "always has dynamic=True"),
    ],
)
def test_bad_parameters_are_rejected_with_a_clear_message(name, params, message):
    with pytest.raises(CtxextError, match=message):
        get_method(name).make_params(**params)


def test_unknown_method_suggests_the_closest_name():
    with pytest.raises(CtxextError, match="did you mean 'ntk_mixed'"):
        get_method("ntk_mixd")
