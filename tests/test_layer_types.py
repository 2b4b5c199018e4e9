"""Layer types by what they are (issue 65 item 3): the default (`--layer-types full`) scales every RoPE layer type
that does not slide, whatever its name (Dots3's `indexed_attention`, Zaya's `hybrid`, Gemma 3's `full_attention`),
or every type where all of them slide; `ctxext patch` says which it chose.

Oracle: transformers' own yarn written on the chosen layer type of the family's config (the other types as
shipped), a model built from it with the same weights.
"""

import copy

import pytest
import torch
from transformers import __version__ as transformers_version

import ctxext
from ctxext.patching.families import RopeLayout
from tests.family_models import L, build, rebuilt_with
from tests.helpers import run_cli

# family: (the layer type the default scales, the one left as shipped)
NOT_FULL = {"dots3_note_text": ("indexed_attention", "sliding_attention"), "zaya": ("hybrid", "hybrid_sliding")}


def built(family: str):
    """The tiny model of `family`; skipped where the installed transformers has no such model type (dots3_note_text
    is new in transformers 5.23)."""
    from transformers import CONFIG_MAPPING

    if family not in CONFIG_MAPPING:
        pytest.skip(f"transformers {transformers_version} has no model type {family}")
    model, why = build(family)
    assert model is not None, why
    return model


def _tokens(n: int = 3 * L) -> torch.Tensor:
    return torch.randint(3, 128, (1, n), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("family", sorted(NOT_FULL))
@pytest.mark.parametrize("layer_types", [None, "full", "indexed_attention|hybrid"])
def test_the_default_scales_the_layer_type_that_does_not_slide_as_transformers_yarn(family, layer_types):
    chosen, kept = NOT_FULL[family]
    if layer_types == "indexed_attention|hybrid":
        layer_types = chosen  # the type named
    model = built(family)
    tokens = _tokens()
    with torch.no_grad():
        before = model(tokens).logits
        ctxext.patch(model, "yarn", factor=4.0, layer_types=layer_types)
        try:
            written = copy.deepcopy(model.config.rope_parameters)
            patched = model(tokens).logits
        finally:
            ctxext.unpatch(model)
    assert written[kept] == model.config.rope_parameters[kept]
    assert written[chosen]["rope_type"] == "yarn"

    def change(values):
        shipped = values["rope_parameters"][chosen]
        values["rope_parameters"][chosen] = {
            **shipped,
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": L,
        }

    with torch.no_grad():
        theirs = rebuilt_with(family, change)(tokens).logits
    torch.testing.assert_close(patched, theirs, atol=1e-5, rtol=1e-5)
    assert (patched - before).abs().max() > 1e-3, f"{family}: yarn x4 changed nothing past L"


def _layout(layer_types, windows) -> RopeLayout:
    n = len(layer_types)
    return RopeLayout(None, tuple(layer_types), True, "halves", (True,) * n, tuple(windows), (True,) * n, {}, {})


@pytest.mark.parametrize(
    ("layer_types", "windows", "chosen"),
    [
        (["sliding_attention", "full_attention"], [8, None], ("full_attention",)),
        (["sliding_attention", "indexed_attention"], [8, None], ("indexed_attention",)),
        (["hybrid_sliding", "hybrid"], [8, None], ("hybrid",)),
        (["chunked_attention", "full_attention"], [8, None], ("full_attention",)),
        (["local", "global"], [8, None], ("global",)),  # told apart by their windows, not their names
        (["sliding_attention", "sliding_attention"], [128, 128], ("sliding_attention",)),  # all slide: all
    ],
)
def test_full_means_every_layer_type_whose_layers_do_not_all_slide(layer_types, windows, chosen):
    assert _layout(layer_types, windows).select_types(None) == chosen
    assert _layout(layer_types, windows).select_types("full") == chosen


@pytest.mark.parametrize("family", sorted(NOT_FULL))
def test_ctxext_patch_says_which_layer_types_it_chose(family, tmp_path, capsys):
    chosen, kept = NOT_FULL[family]
    model = built(family)
    model.save_pretrained(tmp_path / "in")
    code, out, err = run_cli(
        capsys, "patch", tmp_path / "in", "--method", "yarn", "--factor", "2", "-o", tmp_path / "o"
    )
    assert code == 0, out + err
    assert f"layer types: {chosen} ({kept} left as shipped)" in out, out
    code, out, err = run_cli(capsys, "methods", "--model", tmp_path / "in")
    assert code == 0 and "yarn          applies" in out, out + err
