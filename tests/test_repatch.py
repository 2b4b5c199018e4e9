"""Patching again a checkpoint ctxext wrote (issue 65 item 7): `ntk` is written as a changed base (type default,
rope_theta raised), so the reloaded model's own config no longer says what ctxext changed. Replacing that patch
(`replace_shipped`, or an explicit L) starts from the rope from before it, which config.json records as
`ctxext_source_rope` (and, for a checkpoint written before that, ctxext.yaml's `source_rope`): ntk x4 then ntk x2
replacing it is ntk x2 on the original.

The oracle: NTK-aware scaling's base from docs/METHODS.md, b' = b alpha^(d / (d - 2)), run by transformers' own
default rotary in a model built with that base and the same weights.
"""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

import ctxext
from ctxext.patching.patch import plan_patch
from ctxext.patching.record import SOURCE_KEY
from tests.family_models import L, build, rebuilt_with
from tests.helpers import run_cli, save_tiny_checkpoint

BASE = 10000.0
D = 16  # the tiny LLaMA's rotary channels


def ntk_base(alpha: float) -> float:
    return BASE * alpha ** (D / (D - 2))


def original():
    model, _ = build("llama")
    assert model.config.rope_parameters["rope_theta"] == BASE and model.config.max_position_embeddings == L
    return rebuilt_with("llama", lambda values: None)


def oracle(alpha: float):
    """The tiny LLaMA with plain RoPE at NTK's base for `alpha`, in plain transformers."""

    def change(values):
        values["rope_parameters"] = {"rope_type": "default", "rope_theta": ntk_base(alpha)}
        values["max_position_embeddings"] = int(alpha * L)

    return rebuilt_with("llama", change)


def tokens() -> torch.Tensor:
    return torch.randint(3, 128, (1, 3 * L), generator=torch.Generator().manual_seed(0))


def assert_is_ntk_x2_on_the_original(model):
    want = oracle(2.0)
    torch.testing.assert_close(model.model.rotary_emb.inv_freq, want.model.rotary_emb.inv_freq, rtol=0, atol=0)
    with torch.no_grad():
        torch.testing.assert_close(model(tokens()).logits, want(tokens()).logits, rtol=0, atol=0)


def saved_ntk_x4(folder):
    """The tiny LLaMA patched with ntk x4 and saved by ctxext.save_pretrained (native form: a raised base)."""
    model = original()
    ctxext.patch(model, "ntk", factor=4.0)
    ctxext.save_pretrained(model, folder)
    written = json.loads((folder / "config.json").read_text())
    assert written["rope_parameters"]["rope_theta"] == pytest.approx(ntk_base(4.0))
    assert written[SOURCE_KEY]["rope_parameters"]["rope_theta"] == BASE
    return folder


@pytest.mark.parametrize("how", [{"replace_shipped": True}, {"original_max_position_embeddings": L}])
def test_replacing_a_reloaded_ntk_patch_is_ntk_on_the_original(tmp_path, how):
    reloaded = AutoModelForCausalLM.from_pretrained(saved_ntk_x4(tmp_path / "ntk4"), dtype=torch.float32).eval()
    told = plan_patch(reloaded, "ntk", factor=2.0, **how).describe()
    assert "starts from the rope from before it" in told and f"{4 * L} -> {2 * L}" in told, told
    with pytest.warns(UserWarning, match=f"shorter than the {4 * L} it has now"):  # what the checkpoint serves
        ctxext.patch(reloaded, "ntk", factor=2.0, **how)
    assert reloaded.config.max_position_embeddings == 2 * L
    assert_is_ntk_x2_on_the_original(reloaded)


def test_extending_a_reloaded_patch_still_counts_from_where_it_is(tmp_path):
    """Without replace_shipped or L the checkpoint is extended from the context it serves (C = 4L): composed."""
    reloaded = AutoModelForCausalLM.from_pretrained(saved_ntk_x4(tmp_path / "ntk4"), dtype=torch.float32).eval()
    told = plan_patch(reloaded, "ntk", factor=2.0).describe()
    assert f"{4 * L} -> {8 * L}" in told and "before it" not in told, told


def test_unpatch_restores_the_config_without_the_source_record():
    model = original()
    ctxext.patch(model, "ntk", factor=4.0)
    assert getattr(model.config, SOURCE_KEY)["rope_parameters"]["rope_theta"] == BASE
    ctxext.patch(model, "ntk", factor=2.0, replace_shipped=True)  # patched again: the source stays the original
    assert getattr(model.config, SOURCE_KEY)["rope_parameters"]["rope_theta"] == BASE
    assert_is_ntk_x2_on_the_original(model)
    ctxext.unpatch(model)
    assert not hasattr(model.config, SOURCE_KEY)


@pytest.mark.parametrize("older", [False, True], ids=["config.json records it", "only ctxext.yaml does"])
def test_cli_replacing_a_checkpoint_it_wrote_starts_from_the_source(tmp_path, capsys, older):
    save_tiny_checkpoint(tmp_path / "tiny", original())
    code, _, err = run_cli(capsys, "patch", tmp_path / "tiny", "--method", "ntk", "--factor", "4", "-o", tmp_path / "a")
    assert code in (0, None), err
    config_path = tmp_path / "a" / "config.json"
    written = json.loads(config_path.read_text())
    assert written["rope_parameters"]["rope_theta"] == pytest.approx(ntk_base(4.0))
    if older:  # a checkpoint from before config.json carried the record: ctxext.yaml's source_rope answers
        del written[SOURCE_KEY]
        config_path.write_text(json.dumps(written))
    argv = ["patch", tmp_path / "a", "--method", "ntk", "--factor", "2", "--replace-shipped", "--allow-shorter"]
    argv += ["-o", tmp_path / "b"]
    code, out, err = run_cli(capsys, *argv)
    assert code in (0, None), err
    assert "starts from the rope from before it" in out, out
    again = json.loads((tmp_path / "b" / "config.json").read_text())
    assert again["rope_parameters"]["rope_theta"] == pytest.approx(ntk_base(2.0), rel=1e-12)
    assert again["max_position_embeddings"] == 2 * L
    assert_is_ntk_x2_on_the_original(AutoModelForCausalLM.from_pretrained(tmp_path / "b", dtype=torch.float32).eval())
