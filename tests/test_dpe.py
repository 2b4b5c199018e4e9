"""DPE against a naive per-cell, per-pair reference written here: r'_p(i, j) from the rule in the issue (and
docs/METHODS.md), each pair's score rotated by its own r'_p, scores summed over pairs, one causal softmax. It
shares nothing with ctxext's regions or kernel (test_remapping's naive forward, given one r' per pair)."""

import types

import pytest
import torch

import ctxext
from ctxext.patching.attention import set_attention_tuning
from tests.helpers import FAMILIES, REMAP_L, REMAP_SEQ, naive_forward, save_tiny_checkpoint, tiny_model

L = REMAP_L
SEQ = REMAP_SEQ

PAIRS = 8  # the tiny models' head_dim 16
LAYERS = 2


def dpe_relative(i, j, window, pair_scales):
    """(n, n, pairs): r'_p = r below the window, else floor(i/G_p) - floor(j/G_p) + w - floor(w/G_p)."""
    r = (i - j)[..., None].expand(*torch.broadcast_shapes(i.shape, j.shape), len(pair_scales))
    G = torch.tensor(pair_scales)
    far = i[..., None] // G - j[..., None] // G + window - window // G
    return torch.where(r < window, r, far)


def pair_scales_of(group_scales, selected, layer):
    per_group = PAIRS // len(group_scales)
    scales = [group_scales[p // per_group] for p in range(PAIRS)]
    if selected is not None:
        chosen = selected[layer] if isinstance(selected[0], list) else selected
        scales = [G if p in chosen else 1 for p, G in enumerate(scales)]
    return scales


def reference_model(family, params, logn):
    model = tiny_model(family, max_position_embeddings=L)
    for index, layer in enumerate(model.model.layers):
        scales = pair_scales_of(params["group_scales"], params.get("selected_pairs"), index)
        forward = naive_forward(
            lambda i, j, scales=scales: dpe_relative(i, j, params["window"], scales),
            model.model.rotary_emb.inv_freq,
            1.0,
            L if logn else None,
        )
        layer.self_attn.forward = types.MethodType(forward, layer.self_attn)
    return model


CASES = [
    {"window": 8, "group_scales": [2, 8, 2, 8]},
    {"window": 6, "group_scales": [16, 1, 4, 3, 2, 8, 32, 5]},  # one scale per pair; 6 not a multiple of most G
    {"window": 10, "group_scales": [4, 16], "selected_pairs": [0, 3, 5, 6]},
    {"window": 7, "group_scales": [2, 4, 8, 16], "selected_pairs": [[1, 2, 7], [0, 4, 5, 6]]},  # per layer
]
RUNS = [(list(FAMILIES)[n % 4], params, logn) for n, params in enumerate(CASES) for logn in (False, True)]


@pytest.mark.parametrize("family,params,logn", RUNS)
def test_dpe_matches_the_per_cell_per_pair_formula(family, params, logn):
    tokens = torch.randint(0, 256, (1, SEQ), generator=torch.Generator().manual_seed(8))
    patched = ctxext.patch(tiny_model(family, max_position_embeddings=L), "dpe", logn=logn, **params)
    set_attention_tuning(patched, query_block=5)
    with torch.no_grad():
        expected = reference_model(family, params, logn)(tokens, use_cache=False).logits
        got = patched(tokens).logits
        plain = tiny_model(family, max_position_embeddings=L)(tokens).logits
    assert torch.allclose(got, expected, atol=1e-5), (got - expected).abs().max()
    assert (got - plain).abs().max() > 1e-4  # the method really acts on this input


@pytest.mark.parametrize("family", list(FAMILIES))
def test_equal_scales_are_self_extend_and_scales_of_one_are_plain_rope(family):
    tokens = torch.randint(0, 256, (1, SEQ), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        dpe = ctxext.patch(tiny_model(family, max_position_embeddings=L), "dpe", window=8, group_scales=[3] * 4)
        self_extend = ctxext.patch(tiny_model(family, max_position_embeddings=L), "self_extend", window=8, group_size=3)
        assert torch.equal(dpe(tokens).logits, self_extend(tokens).logits)
        ones = ctxext.patch(tiny_model(family, max_position_embeddings=L), "dpe", window=8, group_scales=[1, 1])
        plain = tiny_model(family, max_position_embeddings=L)
        torch.testing.assert_close(ones(tokens).logits, plain(tokens).logits, rtol=1e-5, atol=1e-5)


def test_defaults_follow_the_original_length_and_the_checkpoint_records_them(tmp_path):
    from transformers import AutoModelForCausalLM

    model = ctxext.patch(
        tiny_model("llama", max_position_embeddings=L), "dpe", factor=4, selected_pairs=[[0, 1], [2, 3, 4]]
    )
    saved = model.config.ctxext_attention
    assert (saved["window"], saved["group_scales"]) == (L // 8, [4] * 8)
    model.save_pretrained(tmp_path / "dpe")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "dpe")
    tokens = torch.randint(0, 256, (1, SEQ), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(reloaded(tokens).logits, model(tokens).logits, rtol=0, atol=0)


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--group-scales", "[2, 0]"], "'group_scales' must be >= 1"),
        (["--group-scales", "[2, 1.5]"], "whole number"),
        (["--group-scales", "[2, 4, 8]"], "3 groups (group_scales) do not divide this model's 8 rotary pairs"),
        (["--selected-pairs", "[0, 8]"], "selected pairs [8] are out of range; this model has pairs 0-7"),
        (["--selected-pairs", "[[0], [1], [2]]"], "'selected_pairs' has 3 lists; this model has 2 layers"),
        (["--select-pairs", "/nonexistent/text.txt", "--top-pairs", "2"], "text file '/nonexistent/text.txt' does not"),
        (["--top-pairs", "2"], "--select-pairs TEXT and --top-pairs K go together"),
    ],
)
def test_bad_dpe_parameters_are_one_line_exit_2_and_write_nothing(tmp_path, capsys, flags, message):
    from ctxext.cli import main

    source = save_tiny_checkpoint(tmp_path / "model", tiny_model("llama", max_position_embeddings=L))
    out = tmp_path / "out"
    capsys.readouterr()
    assert main(["patch", str(source), "-o", str(out), "--method", "dpe", *flags]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err
    assert not out.exists()


def test_pair_selection_ranks_pairs_by_mean_q_k_norm_product_and_is_recorded(tmp_path, capsys):
    """Oracle for layer 0: its queries and keys computed here from the embeddings (input norm, projections, Qwen3's
    q/k norms), |q_p| |k_p| per token and query head, averaged; then the checkpoint is dpe with those pairs."""
    import json

    from transformers import AutoModelForCausalLM

    from ctxext.cli import main
    from ctxext.patching.pair_selection import pair_contributions

    model = tiny_model("qwen3", seed=3, max_position_embeddings=L)
    words = torch.randint(0, 256, (200,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        attention = model.model.layers[0].self_attn
        x = model.model.layers[0].input_layernorm(model.model.embed_tokens(words[None]))
        q = attention.q_norm(attention.q_proj(x).view(1, 200, -1, 16))
        k = attention.k_norm(attention.k_proj(x).view(1, 200, -1, 16)).repeat_interleave(2, dim=2)
        expected = (q[..., :8] ** 2 + q[..., 8:] ** 2).sqrt() * (k[..., :8] ** 2 + k[..., 8:] ** 2).sqrt()
        expected = expected.mean(dim=(0, 1, 2))
        got = pair_contributions(model, words[None])
    torch.testing.assert_close(got[0], expected, rtol=1e-5, atol=1e-7)

    source = save_tiny_checkpoint(tmp_path / "model", model)
    text = tmp_path / "calibration.txt"
    text.write_text(" ".join(f"w{int(w)}" for w in words))
    capsys.readouterr()
    assert (
        main(
            [
                "patch",
                str(source),
                "-o",
                str(tmp_path / "out"),
                "--method",
                "dpe",
                "--window",
                "8",
                "--group-scales",
                "[2, 8]",
                "--select-pairs",
                str(text),
                "--top-pairs",
                "3",
            ]
        )
        == 0
    )
    chosen = [sorted(torch.topk(row, 3).indices.tolist()) for row in pair_contributions(model, words[None, :L])]
    saved = json.loads((tmp_path / "out" / "config.json").read_text())["ctxext_attention"]
    assert saved["selected_pairs"] == chosen
    tokens = torch.randint(0, 256, (1, SEQ), generator=torch.Generator().manual_seed(6))
    reference = ctxext.patch(
        tiny_model("qwen3", seed=3, max_position_embeddings=L),
        "dpe",
        window=8,
        group_scales=[2, 8],
        selected_pairs=chosen,
    )
    with torch.no_grad():
        torch.testing.assert_close(
            AutoModelForCausalLM.from_pretrained(tmp_path / "out")(tokens).logits,
            reference(tokens).logits,
            rtol=0,
            atol=0,
        )
