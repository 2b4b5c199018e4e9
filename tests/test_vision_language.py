"""Vision-language models (MRoPE): Qwen2-VL, Qwen2.5-VL, Qwen3-VL (interleaved sections) and GLM-4V.

ctxext patches the language model inside the composite model. The oracle is transformers' own rope type on the
same weights: the VLM built from a config whose text_config carries native yarn, compared past L on text-only
input and on a text + image sequence whose 3-section position ids come from the model's own `get_rope_index`
(they advance more slowly than tokens over the video). The CLI writes an image-text-to-text checkpoint that plain
transformers reloads with the same logits, and `ctxext export` keeps the sections in text_config.
"""

import json

import pytest
import torch
from transformers import AutoModelForImageTextToText

import ctxext
from ctxext.cli import main
from ctxext.patching.families import rope_layout
from tests.helpers import (
    VLM_L,
    VLM_TEXT_ROPE,
    VLM_TOKENS,
    requires_transformers,
    save_tiny_checkpoint,
    tiny_model,
    tiny_vlm,
    tiny_vlm_config,
)

# transformers 5.16 returns one (cos, sin) per position section from these rotary modules and merges the sections
# in the attention (apply_multimodal_rotary_pos_emb); ctxext reads the merged form of 5.17 and later, and refuses the
# older one in one line (this rotary module computes positions in its own way)
pytestmark = requires_transformers("5.17", "Qwen2-VL, Qwen2.5-VL and GLM-4V merge MRoPE's sections in the attention")

VLMS = list(VLM_TEXT_ROPE)
YARN = {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": VLM_L}
SEQ = 3 * VLM_L  # past 2L: the scaling changes every pair


def native_yarn_vlm(model_type: str, patched) -> torch.nn.Module:
    config = tiny_vlm_config(model_type, **YARN)
    config.text_config.max_position_embeddings = 2 * VLM_L
    reference = AutoModelForImageTextToText.from_config(config, attn_implementation="sdpa").eval()
    reference.load_state_dict(patched.state_dict())
    return reference


def image_sequence(vlm) -> tuple[torch.Tensor, torch.Tensor]:
    """(input ids, 3-section position ids from the model's get_rope_index) of text, a 4 x 4 image, then text."""
    merge = vlm.config.vision_config.spatial_merge_size
    grid = torch.tensor([[1, 4 * merge, 4 * merge]])  # 16 image tokens after merging, 4 positions wide
    image = int(grid.prod()) // merge**2
    text = SEQ - image - 10
    ids = torch.cat(
        [
            torch.randint(3, 110, (10,)),
            torch.full((image,), VLM_TOKENS["image_token_id"]),
            torch.randint(3, 110, (text,)),
        ]
    )[None]
    types = (ids == VLM_TOKENS["image_token_id"]).int()
    positions, _ = vlm.model.get_rope_index(ids, types, image_grid_thw=grid)
    return ids, positions


def text_model_output(vlm, ids, positions=None) -> torch.Tensor:
    with torch.no_grad():
        return vlm.model.language_model(input_ids=ids, position_ids=positions).last_hidden_state


@pytest.mark.parametrize("model_type", VLMS)
def test_yarn_on_a_vision_language_model_is_transformers_yarn(model_type):
    vlm = ctxext.patch(tiny_vlm(model_type), "yarn", factor=2)
    reference = native_yarn_vlm(model_type, vlm)
    ids = torch.randint(3, 110, (1, SEQ), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(vlm(ids).logits, reference(ids).logits)
    ids, positions = image_sequence(vlm)
    assert int(positions.max()) + 1 < SEQ  # the image's positions advance more slowly than its tokens
    torch.testing.assert_close(
        text_model_output(vlm, ids, positions), text_model_output(reference, ids, positions), rtol=0, atol=1e-6
    )
    assert ctxext.applied_method(vlm)["method"] == "yarn"


@pytest.mark.parametrize("model_type", VLMS)
def test_the_cli_writes_a_checkpoint_plain_transformers_reloads_patched(model_type, tmp_path, capsys):
    source = save_tiny_checkpoint(tmp_path / "vlm", tiny_vlm(model_type))
    out = tmp_path / "yarn"
    assert main(["patch", str(source), "--method", "yarn", "--factor", "2", "-o", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "max_position_embeddings: 32 -> 64" in printed
    config = json.loads((out / "config.json").read_text())
    written = config["text_config"]["rope_parameters"]
    assert written["rope_type"] == "yarn" and written["mrope_section"] == VLM_TEXT_ROPE[model_type]["mrope_section"]
    reloaded = AutoModelForImageTextToText.from_pretrained(out).eval()
    expected = ctxext.patch(AutoModelForImageTextToText.from_pretrained(source).eval(), "yarn", factor=2)
    ids = torch.randint(3, 110, (1, SEQ), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, expected(ids).logits)
    assert main(["export", str(out), "--engine", "vllm", "-o", str(tmp_path / "vllm")]) == 0
    exported = json.loads((tmp_path / "vllm" / "config.json").read_text())
    assert exported["text_config"]["rope_parameters"] == written and "rope_parameters" not in exported


def test_methods_describes_the_language_model_and_counts_position_ids(tmp_path, capsys):
    source = save_tiny_checkpoint(tmp_path / "vlm", tiny_vlm("qwen2_5_vl"))
    assert main(["methods", "--model", str(source)]) == 0
    printed = capsys.readouterr().out
    assert "position ids" in printed and "yarn          applies" in printed


def test_a_remapping_method_on_mrope_is_refused_with_the_reason():
    with pytest.raises(ctxext.CtxextError, match="3 position sections"):
        ctxext.patch(tiny_vlm("qwen2_vl"), "self_extend", factor=2, window=8)


# ----------------------------------------------------------------------------------- axis-selective scaling
def unit_cos_sin(rotary, ids, positions) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) of each pair's angle, the attention factor divided out (angles alone: 'rotate as')."""
    x = torch.zeros(1, ids.shape[1], 1)
    with torch.no_grad():
        cos, sin = rotary(x, positions)
    norm = torch.sqrt(cos**2 + sin**2)
    return cos / norm, sin / norm


@pytest.mark.parametrize("model_type", VLMS)
def test_temporal_only_yarn_rotates_the_other_sections_as_shipped(model_type):
    shipped = tiny_vlm(model_type)
    patched = ctxext.patch(tiny_vlm(model_type), "yarn", factor=2, mrope_sections="temporal")
    yarn = native_yarn_vlm(model_type, shipped)
    ids, positions = image_sequence(shipped)
    got = unit_cos_sin(patched.model.language_model.rotary_emb, ids, positions)
    plain = unit_cos_sin(shipped.model.language_model.rotary_emb, ids, positions)
    scaled = unit_cos_sin(yarn.model.language_model.rotary_emb, ids, positions)
    layout = rope_layout(shipped)
    pairs = torch.tensor([section == 0 for section in layout.sections])
    # pair i's angle sits at columns i and i + pairs (rotate-half), or 2i and 2i + 1 (GLM-4V's interleaved pairs)
    temporal = pairs.repeat_interleave(2) if layout.angles == "interleaved" else pairs.repeat(2)
    assert 0 < int(pairs.sum()) < len(pairs) and bool((scaled[1] != plain[1])[..., temporal].any())
    for mine, native_yarn, shipped_angles in zip(got, scaled, plain):  # 1e-5: float32 rounding of the unit circle
        torch.testing.assert_close(mine[..., temporal], native_yarn[..., temporal], rtol=0, atol=1e-5)
        torch.testing.assert_close(mine[..., ~temporal], shipped_angles[..., ~temporal], rtol=0, atol=1e-5)


@pytest.mark.parametrize("model_type", ["qwen2_5_vl", "qwen3_vl"])
def test_the_axis_selective_checkpoint_reloads_in_plain_transformers(model_type, tmp_path, capsys):
    source = save_tiny_checkpoint(tmp_path / "vlm", tiny_vlm(model_type))
    out = tmp_path / "temporal"
    flags = ["--method", "yarn", "--factor", "4", "--mrope-sections", "temporal", "-o", str(out)]
    assert main(["patch", str(source), *flags]) == 0
    assert "temporal sections only" in capsys.readouterr().out
    written = json.loads((out / "config.json").read_text())["text_config"]["rope_parameters"]
    layout = rope_layout(tiny_vlm(model_type))
    kept = [factor for factor, section in zip(written["short_factor"], layout.sections) if section != 0]
    assert written["rope_type"] == "longrope" and kept == [1.0] * len(kept)
    reloaded = AutoModelForImageTextToText.from_pretrained(out).eval()
    in_memory = ctxext.patch(
        AutoModelForImageTextToText.from_pretrained(source).eval(), "yarn", factor=4, mrope_sections="temporal"
    )
    ids, positions = image_sequence(reloaded)
    torch.testing.assert_close(
        text_model_output(reloaded, ids, positions), text_model_output(in_memory, ids, positions), rtol=0, atol=0
    )
    assert "mrope_sections: temporal" in (out / "ctxext.yaml").read_text()


@pytest.mark.parametrize(
    "model,method,sections,message",
    [
        (lambda: tiny_vlm("qwen2_vl"), "self_extend", "temporal", "static frequency method"),
        (lambda: tiny_vlm("qwen2_vl"), "dynamic_ntk", "temporal", "static frequency method"),
        (lambda: tiny_vlm("qwen2_vl"), "yarn", "depth", "unknown section 'depth'"),
        (lambda: tiny_model("llama"), "yarn", "temporal", "no multimodal RoPE"),
    ],
)
def test_axis_selective_scaling_refuses_what_it_cannot_do_in_one_line(model, method, sections, message):
    with pytest.raises(ctxext.CtxextError, match=message):
        ctxext.patch(model(), method, factor=2, mrope_sections=sections)
