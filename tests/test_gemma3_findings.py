"""Defects found on a real Gemma 3 checkpoint, each reproduced on a tiny model of its shape: rope parameters nested by
layer type, the full-attention layers at base 1e6 with a shipped linear x8, the sliding layers at base 1e4."""

import json

import pytest
import yaml
from transformers import AutoConfig, AutoModelForCausalLM

from ctxext.cli import main
from tests.conftest import save_tiny_checkpoint
from tests.family_models import build

FULL_BASE, SLIDING_BASE = 1e6, 1e4


def gemma3_linear_global():
    """The tiny gemma3_text of the family matrix, shipped as Gemma 3 ships: linear x8 on the full layers only."""
    model, reason = build("gemma3_text")
    if model is None:
        pytest.skip(f"gemma3_text does not build here: {reason}")
    values = model.config.to_dict()
    full = values["rope_parameters"]["full_attention"]
    values["rope_parameters"]["full_attention"] = {**full, "rope_type": "linear", "factor": 8.0, "rope_theta": FULL_BASE}
    values["rope_parameters"]["sliding_attention"]["rope_theta"] = SLIDING_BASE
    values["max_position_embeddings"] = 128
    config = AutoConfig.for_model(values.pop("model_type"), **values)
    rebuilt = AutoModelForCausalLM.from_config(config).eval()
    rebuilt.load_state_dict(model.state_dict())
    return rebuilt


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    """A Gemma-3-shaped tiny checkpoint (with a 256-word tokenizer)."""
    return save_tiny_checkpoint(tmp_path_factory.mktemp("gemma3"), gemma3_linear_global())


def run_cli(capsys, *argv):
    code = main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


# --------------------------------------------------------------------------- 1. export --check, per layer type base
def test_the_gemma3_fixture_has_two_bases(gemma3):
    rope = json.loads((gemma3 / "config.json").read_text())["rope_parameters"]
    assert rope["full_attention"]["rope_theta"] == FULL_BASE and rope["sliding_attention"]["rope_theta"] == SLIDING_BASE
    assert rope["full_attention"]["rope_type"] == "linear"


def test_unscaled_reference_keeps_each_layer_types_base(gemma3, tmp_path, capsys):
    """The reference `export --check` patches the method into: plain RoPE per layer type, each at its own base."""
    from ctxext.serving.engines import read_served_model
    from ctxext.serving.parity import _unscaled

    out = tmp_path / "yarn"
    code, _, err = run_cli(capsys, "patch", gemma3, "--method", "yarn", "--factor", 2, "-o", out)
    assert code == 0, err
    config = AutoConfig.from_pretrained(out)
    _unscaled(config, read_served_model(out))
    assert config.rope_parameters == {
        "full_attention": {"rope_type": "default", "rope_theta": FULL_BASE},
        "sliding_attention": {"rope_type": "default", "rope_theta": SLIDING_BASE},
    }


@pytest.mark.parametrize(
    "flags",
    [
        ("--method", "yarn", "--factor", 2),  # composes with the shipped linear x8
        ("--method", "yarn", "--factor", 2, "--replace-shipped"),
        ("--method", "yarn", "--factor", 2, "--replace-shipped", "--layer-types", "all"),
        ("--method", "linear", "--factor", 8, "--replace-shipped", "--layer-types", "full"),
    ],
    ids=["yarn-composed", "yarn-full", "yarn-all", "linear-full"],
)
def test_export_check_agrees_on_a_gemma3_checkpoint(gemma3, tmp_path, capsys, flags):
    """`ctxext export DIR --check` on what `ctxext patch` writes for Gemma 3: agreement, not a KeyError."""
    out = tmp_path / "out"
    code, _, err = run_cli(capsys, "patch", gemma3, *flags, "-o", out)
    assert code == 0, err
    report = tmp_path / "table.json"
    code, stdout, err = run_cli(capsys, "export", out, "--check", "--tokens", 64, "--json", report)
    rows = {row["engine"]: row for row in json.loads(report.read_text())["engines"]}
    assert code == 0, stdout + err
    checked = rows["transformers"]["checked"]
    assert "max |logit diff|" in checked and "DISAGREES" not in checked, checked
    assert yaml.safe_load((out / "ctxext.yaml").read_text())["method"] == flags[1]
