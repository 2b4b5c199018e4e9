"""GALI (Greedy Attention Logit Interpolation) against the per-cell reference of tests.test_remapping.

The oracle (tests.test_remapping: gali_positions, gali_relative, naive_forward): GALI's position list for T
tokens, built by its greedy rule as a plain loop; query i reads the list for T = i + 1, so
r'(i, j) = P_T[i] - P_T[j]; a fractional r' scores the interpolation of the scores at its two integer
neighbours, in float64. It shares nothing with ctxext's closed forms, regions or kernel.
"""

import pytest
import torch

import ctxext
from ctxext.methods.remapping import GaliParams, gali_exact_keys, gali_group
from ctxext.patching.attention import set_attention_tuning
from tests.helpers import (
    FAMILIES,
    decoded_and_full_logits,
    gali_positions,
    gali_relative,
    reference_model,
    save_tiny_checkpoint,
    tiny_model,
)

L = 32
SEQ = 100  # past L: far keys 1/2, 1/3 and 1/4 apart with w = 3


# --------------------------------------------------------------------------------- the greedy rule
@pytest.mark.parametrize("R,w", [(32, 1), (32, 3), (20, 4), (8, 7)])
def test_closed_forms_follow_the_greedy_position_list(R, w):
    for T in range(1, 12 * R):
        at = gali_positions(T, R, w)
        assert len(at) == T and all(b > a for a, b in zip(at, at[1:]))
        assert at[-1] == min(T, R) - 1  # the query sits at the end of the range: r' stays below R
        exact = next(n for n in range(T, 0, -1) if all(at[-k] == at[-1] - k + 1 for k in range(1, n + 1)))
        assert exact >= min(w, T)
        lengths = torch.tensor([T])
        assert int(gali_exact_keys(lengths, R, w)) == exact, T
        expected_group = 1 if T <= R else round(1 / (at[1] - at[0]))
        assert int(gali_group(lengths, R, w)) == expected_group, T


def test_fractional_positions_are_really_interpolated():
    """A far key between two integer positions scores neither neighbour's value (not rounded)."""
    n = torch.arange(SEQ)
    relative = gali_relative(n[:, None], n[None], 3)
    fractional = (relative - relative.round()).abs() > 1e-9
    assert bool(fractional.any())
    assert float(relative.max()) == L - 1


def test_the_largest_relative_position_is_the_oracles_and_below_l():
    n = torch.arange(SEQ)
    largest = float(gali_relative(n[:, None], n[None], 3, 20).max())
    assert GaliParams(local_window=3, position_range=20).largest_relative_position(SEQ) == largest == 19
    assert GaliParams(local_window=3).resolved(L).largest_relative_position(SEQ) == L - 1
    assert GaliParams().largest_relative_position(SEQ) is None  # R not resolved: it is L, so never past it


# ------------------------------------------------------------------------------------ model oracle
CASES = [({"local_window": 3}, False), ({"local_window": 1}, True), ({"local_window": 4, "position_range": 20}, False)]
RUNS = [(family, params, logn) for family in FAMILIES for params, logn in CASES]


@pytest.mark.parametrize("family,params,logn", RUNS)
def test_patched_model_matches_the_per_cell_reference(family, params, logn):
    tokens = torch.randint(0, 256, (1, SEQ), generator=torch.Generator().manual_seed(3))
    expected_model = reference_model(family, "gali", params, logn)
    patched = ctxext.patch(tiny_model(family, max_position_embeddings=L), "gali", logn=logn, **params)
    set_attention_tuning(patched, query_block=16)
    with torch.no_grad():
        expected = expected_model(tokens, use_cache=False).logits
        got = patched(tokens).logits
        plain = tiny_model(family, max_position_embeddings=L)(tokens).logits
    assert torch.allclose(got, expected, atol=1e-5), (got - expected).abs().max()
    R = params.get("position_range", L)
    assert (got[:, R:] - plain[:, R:]).abs().max() > 1e-3  # past R the method really acts
    assert logn or torch.allclose(got[:, :R], plain[:, :R], atol=1e-5)  # within R it is plain RoPE


@pytest.mark.parametrize("kernel", ["lse", "blockwise", "naive"])
def test_every_cpu_kernel_gives_the_fused_kernels_logits(kernel):
    tokens = torch.randint(0, 256, (1, SEQ), generator=torch.Generator().manual_seed(4))
    model = ctxext.patch(tiny_model("qwen3", max_position_embeddings=L), "gali", local_window=2)
    with torch.no_grad():
        set_attention_tuning(model, query_block=7, kernel="lse")
        fused = model(tokens).logits
        set_attention_tuning(model, kernel=kernel)
        other = model(tokens).logits
    assert torch.allclose(other, fused, atol=1e-5), (other - fused).abs().max()


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_cached_decoding_equals_full_forward_across_group_boundaries(family):
    """Decoding token by token crosses L and two group boundaries (g 2 -> 3 -> 4): new regions, kept keys
    rebuilt, the same logits as one full forward."""
    model = ctxext.patch(tiny_model(family, max_position_embeddings=L), "gali", local_window=3)
    decoded, full = decoded_and_full_logits(model, 80)
    assert decoded.shape[1] == 80 and int(gali_group(torch.tensor([92]), L, 3)) == 4
    assert torch.allclose(decoded, full, atol=1e-4), (decoded - full).abs().max()


def test_gradients_match_the_reference():
    tokens = torch.randint(0, 256, (1, 80), generator=torch.Generator().manual_seed(6))
    expected_model = reference_model("mistral", "gali", {"local_window": 3}, False)
    patched = ctxext.patch(tiny_model("mistral", max_position_embeddings=L), "gali", local_window=3)
    set_attention_tuning(patched, query_block=16)
    patched.train()
    expected_model.train()
    for model in (patched, expected_model):
        model.zero_grad()
        model(tokens, labels=tokens, use_cache=False).loss.backward()
    compared = 0
    for (name, want), got in zip(expected_model.named_parameters(), patched.parameters()):
        if want.grad is None:
            continue
        assert torch.allclose(got.grad, want.grad, atol=1e-4), (name, (got.grad - want.grad).abs().max())
        compared += "self_attn" in name
    assert compared >= 8  # q, k, v, o of both layers at least


# -------------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    "params,message",
    [
        ({"local_window": 0}, "local_window"),
        ({"local_window": 8, "position_range": 8}, "must be below 'position_range'"),
    ],
)
def test_impossible_parameters_are_refused(params, message):
    with pytest.raises(ctxext.errors.CtxextError, match=message):
        GaliParams(**params).validate()


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--position-range", "64"], "reaches past the model's original length L = 32"),
        (["--local-window", "40"], "must be below 'position_range'"),
        (["--local-window", "0"], "'local_window' must be >= 1"),
    ],
)
def test_cli_rejects_a_setting_that_reaches_past_l_with_one_line_and_exit_2(tmp_path, capsys, flags, message):
    from ctxext.cli import main

    source = save_tiny_checkpoint(tmp_path / "model", tiny_model("llama", max_position_embeddings=L))
    out = tmp_path / "out"
    capsys.readouterr()
    assert main(["patch", str(source), "-o", str(out), "--method", "gali", *flags]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err
    assert not out.exists()
