"""Gemma 4 (gemma4_text, gemma4_unified_text): head sizes per layer type and p-RoPE on the full-attention layers.

Its config gives the full layers their own head size (`global_head_dim`, through `per_layer_config`; reading
`config.head_dim` raises there) and rotates them with p-RoPE (rope type `proportional`, p = 0.25: of the head's 16
pairs the 4 highest-frequency ones turn, the other 12 keep frequency 0); the sliding layers are plain RoPE at base
1e4. Oracles: transformers' own `proportional` with a factor (linear), transformers' own yarn and llama3 functions
computed for the full layers' head and given the layer's frequency-0 pairs, and plain transformers reloading the
checkpoint `ctxext patch` writes. The matrix of tests/test_families.py runs on both families as well (SelfExtend
against the per-cell reference there, frequency-0 pairs included).
"""

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

import ctxext
from ctxext.errors import CtxextError
from tests.family_models import L, build, rebuilt_with
from tests.helpers import run_cli

GEMMA4 = ["gemma4_text", "gemma4_unified_text"]
FULL, SLIDING = "full_attention", "sliding_attention"
PAIRS, TURNING = 16, 4  # the full layers' head 32: 16 pairs, int(0.25 x 32 // 2) of them turn
THETA = 1e6


def _tokens(n: int = 3 * L) -> torch.Tensor:
    return torch.randint(3, 128, (1, n), generator=torch.Generator().manual_seed(1))


def _logits(model, tokens) -> torch.Tensor:
    with torch.no_grad():
        return model(tokens).logits


@pytest.mark.parametrize("family", GEMMA4)
def test_the_layout_and_record_hold_each_layer_types_head_and_base(family):
    model, why = build(family)
    assert model is not None, why
    layout = ctxext.patching.rope_layout(model)
    assert layout.rotary_dims == {SLIDING: 16, FULL: 32} and layout.bases == {SLIDING: 1e4, FULL: THETA}
    record = ctxext.patching.record.model_rope_record(model)
    assert (record.of(FULL).rotary_dim, record.of(FULL).rotated_pairs) == (32, TURNING)
    assert (record.of(SLIDING).rotary_dim, record.of(SLIDING).rotated_pairs) == (16, None)


@pytest.mark.parametrize("family", GEMMA4)
def test_linear_is_transformers_proportional_with_the_factor_past_L(family):
    """PI x4 on the full layers is transformers' own `proportional` with factor 4 (it divides every frequency by
    it): the config says so, and a model built from that form with the same weights gives the same logits."""
    model, _ = build(family)
    tokens = _tokens()
    before = _logits(model, tokens)
    ctxext.patch(model, "linear", factor=4.0)
    try:
        written = copy.deepcopy(model.config.rope_parameters)
        patched = _logits(model, tokens)
    finally:
        ctxext.unpatch(model)
    assert torch.equal(_logits(model, tokens), before)
    native = {"rope_type": "proportional", "rope_theta": THETA, "partial_rotary_factor": 0.25, "factor": 4.0}
    assert written[FULL] == {**native, "original_max_position_embeddings": L}
    assert written[SLIDING] == model.config.rope_parameters[SLIDING]  # left as shipped, as Gemma 3's

    def change(values):
        values["rope_parameters"][FULL] = native

    theirs = _logits(rebuilt_with(family, change), tokens)
    torch.testing.assert_close(patched, theirs, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(patched, before, atol=1e-3)


def _transformers_frequencies(model, rope: dict) -> tuple[torch.Tensor, float]:
    """transformers' own function of `rope`'s type computed for the full layers' head (their per-layer config, 32
    channels, every pair), then the pairs p-RoPE keeps at frequency 0 set so, as the layer ships them."""
    layer_config = copy.copy(model.config.per_layer_config[FULL])
    layer_config.rope_parameters = {**model.config.rope_parameters, FULL: rope}
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope["rope_type"]](layer_config, None, layer_type=FULL)
    assert inv_freq.shape == (PAIRS,)
    inv_freq = inv_freq.clone()
    inv_freq[TURNING:] = 0.0
    return inv_freq, float(scaling)


@pytest.mark.parametrize("family", GEMMA4)
@pytest.mark.parametrize(
    ("method", "rope"),
    [
        ("yarn", {"rope_type": "yarn"}),
        ("llama3", {"rope_type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0}),
    ],
)
def test_yarn_and_llama3_are_transformers_own_on_the_pairs_that_turn(family, method, rope):
    """transformers' yarn on these layers fails (its cos/sin have 8 channels for a 32-channel head); ctxext turns
    the 4 pairs p-RoPE turns by transformers' own yarn (llama3) frequencies for the head and attention factor, and
    keeps the other 12 at 0. The oracle: the unpatched model given exactly those frequencies."""
    model, _ = build(family)
    tokens = _tokens()
    ctxext.patch(model, method, factor=4.0)
    try:
        written = copy.deepcopy(model.config.rope_parameters[FULL])
        patched = _logits(model, tokens)
    finally:
        ctxext.unpatch(model)
    assert written["rope_type"] == f"ctxext_{method}" and written["rope_proportion"] == 0.25
    rope = {**rope, "rope_theta": THETA, "factor": 4.0, "original_max_position_embeddings": L}
    inv_freq, scaling = _transformers_frequencies(model, rope)
    rotary = model.model.rotary_emb
    own = (rotary.full_attention_inv_freq.clone(), rotary.full_attention_attention_scaling)
    rotary.full_attention_inv_freq, rotary.full_attention_attention_scaling = inv_freq, scaling
    try:
        theirs = _logits(model, tokens)
    finally:
        rotary.full_attention_inv_freq, rotary.full_attention_attention_scaling = own
    torch.testing.assert_close(patched, theirs, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(patched, _logits(model, tokens), atol=1e-3)


@pytest.mark.parametrize("family", GEMMA4)
@pytest.mark.parametrize("method", ["linear", "yarn", "self_extend"])
def test_ctxext_patch_writes_a_checkpoint_plain_transformers_reloads_with_the_same_logits(
    family, method, tmp_path, capsys
):
    model, _ = build(family)
    model.save_pretrained(tmp_path / "in")
    code, out, err = run_cli(
        capsys, "patch", tmp_path / "in", "--method", method, "--factor", "4", "-o", tmp_path / "out"
    )
    assert code == 0, out + err
    assert f"layer types: {FULL}" in out, out  # what the default chose
    tokens = _tokens()
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    ctxext.patch(model, method, factor=4.0)
    try:
        torch.testing.assert_close(_logits(reloaded, tokens), _logits(model, tokens), atol=1e-5, rtol=1e-5)
    finally:
        ctxext.unpatch(model)


@pytest.mark.parametrize("family", GEMMA4)
def test_ctxext_methods_describes_each_layer_type(family, tmp_path, capsys):
    model, _ = build(family)
    model.save_pretrained(tmp_path / "in")
    code, out, err = run_cli(capsys, "methods", "--model", tmp_path / "in")
    assert code == 0 and "Traceback" not in err, out + err
    rows = {
        line.split()[0]: line.split() for line in out.splitlines() if line.strip().startswith(("full_", "sliding_"))
    }
    assert rows[SLIDING][4:7] == ["8", "16", "10000"], rows  # window, rotary dim, base
    assert rows[FULL][4:7] == ["-", "32", "1e+06"], rows
    assert f"p-RoPE: {TURNING} of {PAIRS} pairs turn" in out
    assert "yarn          applies" in out and "dynamic_yarn  no: dynamic_yarn follows the length" in out


@pytest.mark.parametrize("method", ["dynamic_yarn", "dynamic_ntk", "longrope"])
def test_a_method_that_follows_the_length_is_refused_in_one_line(method, tmp_path, capsys):
    """transformers' dynamic update of a rotary per layer type sets `attention_scaling`, not the layer type's own,
    so such a checkpoint would not reload as patched (dynamic_yarn: 3.5e-2 off): refused, before any change."""
    model, _ = build("gemma4_text")
    shipped = copy.deepcopy(model.config.rope_parameters)
    with pytest.raises(CtxextError, match="follows the length") as error:
        ctxext.patch(model, method, factor=4.0)
    assert "\n" not in str(error.value) and model.config.rope_parameters == shipped
    model.save_pretrained(tmp_path / "in")
    code, out, err = run_cli(
        capsys, "patch", tmp_path / "in", "--method", method, "--factor", "4", "-o", tmp_path / "o"
    )
    assert code == 2 and "follows the length" in err.strip().splitlines()[-1] and "Traceback" not in err
