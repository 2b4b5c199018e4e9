"""Defects found on a real Gemma 3 checkpoint, each reproduced on a tiny model of its shape: rope parameters nested by
layer type, the full-attention layers at base 1e6 with a shipped linear x8, the sliding layers at base 1e4."""

import dataclasses
import json
import shutil

import pytest
import torch
import yaml
from transformers import AutoConfig, AutoModelForCausalLM

from tests.family_models import build
from tests.helpers import run_cli, save_tiny_checkpoint

FULL_BASE, SLIDING_BASE = 1e6, 1e4


def gemma3_linear_global():
    """The tiny gemma3_text of the family matrix, shipped as Gemma 3 ships: linear x8 on the full layers only."""
    model, reason = build("gemma3_text")
    if model is None:
        pytest.skip(f"gemma3_text does not build here: {reason}")
    values = model.config.to_dict()
    full = values["rope_parameters"]["full_attention"]
    values["rope_parameters"]["full_attention"] = {
        **full,
        "rope_type": "linear",
        "factor": 8.0,
        "rope_theta": FULL_BASE,
    }
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


# --------------------------------------------------------------------------- 1. export --check, per layer type base
def test_the_gemma3_fixture_has_two_bases(gemma3):
    rope = json.loads((gemma3 / "config.json").read_text())["rope_parameters"]
    assert rope["full_attention"]["rope_theta"] == FULL_BASE and rope["sliding_attention"]["rope_theta"] == SLIDING_BASE
    assert rope["full_attention"]["rope_type"] == "linear"


def test_unscaled_reference_keeps_each_layer_types_base(gemma3, tmp_path, capsys):
    """Where neither ctxext.yaml (a checkpoint written before it recorded `source_rope`) nor this machine says how the
    source shipped, the reference `export --check` patches the method into is plain RoPE per layer type, each at its
    own recorded base (not one base for both)."""
    from ctxext.serving.engines import read_served_model
    from ctxext.verification.parity import _unscaled

    out = tmp_path / "yarn"
    code, _, err = run_cli(capsys, "patch", gemma3, "--method", "yarn", "--factor", 2, "--replace-shipped", "-o", out)
    assert code == 0, err
    served = read_served_model(out)
    older = {key: value for key, value in served.record.items() if key != "source_rope"}
    served = dataclasses.replace(served, record={**older, "source_model": str(tmp_path / "gone")})
    config = AutoConfig.from_pretrained(out)
    assert "plain RoPE" in _unscaled(config, served)
    assert config.rope_parameters == {
        "full_attention": {"rope_type": "default", "rope_theta": FULL_BASE},
        "sliding_attention": {"rope_type": "default", "rope_theta": SLIDING_BASE},
    }
    assert config.max_position_embeddings == served.record["original_max_position_embeddings"]


def test_unscaled_reference_is_the_source_as_shipped_where_it_is_here(gemma3, tmp_path, capsys):
    """yarn x2 composes with Gemma 3's shipped linear x8: the reference is the source's rope, linear x8 and all."""
    from ctxext.serving.engines import read_served_model
    from ctxext.verification.parity import _unscaled

    out = tmp_path / "yarn"
    code, _, err = run_cli(capsys, "patch", gemma3, "--method", "yarn", "--factor", 2, "-o", out)
    assert code == 0, err
    config = AutoConfig.from_pretrained(out)
    assert "the source's rope as shipped" in _unscaled(config, read_served_model(out))
    assert config.rope_parameters == AutoConfig.from_pretrained(gemma3).rope_parameters
    assert config.max_position_embeddings == 128


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


def test_export_check_agrees_where_the_source_is_gone(gemma3, tmp_path, capsys):
    """The source deleted after the patch: ctxext.yaml's record of how it shipped is the reference (linear x8 on the
    full layers, which the patch replaced), and the written checkpoint agrees with it."""
    source = shutil.copytree(gemma3, tmp_path / "source")
    out = tmp_path / "out"
    flags = ("--method", "yarn", "--factor", 2, "--replace-shipped", "--layer-types", "all")
    code, _, err = run_cli(capsys, "patch", source, *flags, "-o", out)
    assert code == 0, err
    shutil.rmtree(source)
    report = tmp_path / "table.json"
    code, stdout, err = run_cli(capsys, "export", out, "--check", "--tokens", 64, "--json", report)
    checked = {row["engine"]: row for row in json.loads(report.read_text())["engines"]}["transformers"]["checked"]
    assert code == 0, stdout + err
    assert "the source's rope as shipped" in checked and "linear x8" in checked, checked
    assert "DISAGREES" not in checked, checked


# --------------------------------------------------------------------- 2. check: the attention factor it applies
@pytest.fixture(scope="module")
def gemma3_plain(tmp_path_factory):
    """A Gemma-3-shaped tiny checkpoint that ships plain RoPE on both layer types (Gemma 3 270m, 1b)."""
    model, reason = build("gemma3_text")
    if model is None:
        pytest.skip(f"gemma3_text does not build here: {reason}")
    return save_tiny_checkpoint(tmp_path_factory.mktemp("gemma3-plain"), model)


def test_check_agrees_on_gemma3_with_an_attention_factor(gemma3_plain, tmp_path, capsys):
    """STRING carries an attention factor (1.069 at x2.5): the reference must use the one the patched rotary
    applies to the full layers, not the unpatched module's 1.0 behind `full_attention_attention_scaling`."""
    report = tmp_path / "check.json"
    code, stdout, err = run_cli(
        capsys,
        "check",
        "--model",
        gemma3_plain,
        "--method",
        "string",
        "--implementations",
        "eager,sdpa",
        "--lengths",
        "",
        "--device",
        "cpu",
        "--json",
        report,
    )
    rows = json.loads(report.read_text())["agreement"]
    assert code == 0, stdout + err
    assert [(row["implementation"], row["ok"]) for row in rows] == [("eager", True), ("sdpa", True)]
    assert json.loads(report.read_text())["shape"]["rope_theta"] == FULL_BASE


def test_applied_frequencies_are_the_patched_ones(gemma3_plain):
    """What the check's reference reads of a rotary module (`module_frequencies`: `{layer_type}_inv_freq` and
    `{layer_type}_attention_scaling`): the patched frequencies and factor of a scaled type, the model's own for a
    type the patch leaves alone."""
    import ctxext
    from ctxext.patching.families import module_frequencies

    applied_frequencies = module_frequencies
    model = AutoModelForCausalLM.from_pretrained(gemma3_plain).eval()
    sliding_before = module_frequencies(model.model.rotary_emb, "sliding_attention")
    ctxext.patch(model, "yarn", factor=4)
    rotary = model.model.rotary_emb
    inv_freq, scaling = applied_frequencies(rotary, "full_attention")
    cos, _ = rotary(torch.zeros(1), torch.arange(2)[None], "full_attention")
    assert scaling == pytest.approx(float(cos[0, 0, 0])) and scaling > 1.0
    assert torch.allclose(cos[0, 1, : len(inv_freq)], inv_freq.cos() * scaling)
    sliding = applied_frequencies(rotary, "sliding_attention")
    assert torch.equal(sliding[0], sliding_before[0]) and sliding[1] == sliding_before[1]


# ------------------------------------------------------------- 3. eval refuses what patch refuses, before anything
@pytest.fixture(scope="module")
def tiny_text(tmp_path_factory):
    """400 words of the tiny tokenizer inside the tiny vocabulary (w3..w127)."""
    path = tmp_path_factory.mktemp("text") / "text.txt"
    path.write_text(" ".join(f"w{3 + (7 * i) % 125}" for i in range(400)))
    return path


@pytest.mark.parametrize(
    "flags,message",
    [
        (("--method", "yarn", "--factor", 2, "--layer-types", "global"), "yarn x2: unknown layer type 'global'"),
        (("--method", "dpe", "--group-scales", "[2,4,8]"), "do not divide this model's 8 rotary pairs"),
        (("--method", "rerope", "--layer-types", "sliding_attention"), "cannot run with sliding-window attention"),
    ],
    ids=["layer-type", "dpe-groups", "rerope-sliding"],
)
def test_eval_refuses_what_patch_refuses_before_loading_anything(
    gemma3, tiny_text, tmp_path, capsys, monkeypatch, flags, message
):
    """One line, exit 2, nothing in -o (nor its cells), and no weights loaded: the config alone refuses it."""
    from ctxext.eval import session

    def loads(*args, **kwargs):
        raise AssertionError("the model was loaded before the method was refused")

    monkeypatch.setattr(session, "load_model_and_tokenizer", loads)
    out = tmp_path / "out"
    code, stdout, err = run_cli(
        capsys,
        "eval",
        gemma3,
        *flags,
        "--lengths",
        64,
        "--text-file",
        tiny_text,
        "--dtype",
        "fp32",
        "--no-progress",
        "-o",
        out,
    )
    assert code == 2, stdout + err
    assert err.strip().splitlines() == [f"ctxext eval: error: {err.strip().removeprefix('ctxext eval: error: ')}"]
    assert message in err, err
    assert not out.exists() and not (tmp_path / ".out.cells").exists()


def test_eval_still_runs_what_patch_takes(gemma3, tiny_text, tmp_path, capsys):
    out = tmp_path / "out"
    flags = ("--method", "yarn", "--factor", 2, "--layer-types", "all", "--lengths", 64, "--stride", "window")
    code, stdout, err = run_cli(
        capsys, "eval", gemma3, *flags, "--text-file", tiny_text, "--dtype", "fp32", "--no-progress", "-o", out
    )
    assert code == 0, stdout + err
    rows = json.loads((out / "results.json").read_text())["results"]
    assert [row["method"] for row in rows] == ["none", "yarn x2"]


def test_unscaled_reference_of_a_gguf_record_takes_its_base_on_the_full_layers(gemma3):
    """A GGUF's record keeps one `rope_theta` (the base before any base change): the full layers' base; the
    sliding layers keep the base transformers read from the file."""
    from ctxext.serving.engines import ServedModel
    from ctxext.verification.parity import _unscaled

    config = AutoConfig.from_pretrained(gemma3)
    config.rope_parameters["full_attention"] = {"rope_type": "default", "rope_theta": 4e6}  # as if the base changed
    record = {"method": "ntk", "rope_theta": FULL_BASE, "original_max_position_embeddings": 64}
    served = ServedModel(gemma3 / "model.gguf", "gguf", "gemma3", {}, None, record)
    assert "plain RoPE" in _unscaled(config, served)
    assert config.rope_parameters == {
        "full_attention": {"rope_type": "default", "rope_theta": FULL_BASE},
        "sliding_attention": {"rope_type": "default", "rope_theta": SLIDING_BASE},
    }
    assert config.max_position_embeddings == 64


def test_export_engine_on_a_gemma3_checkpoint_is_one_line(gemma3, tmp_path, capsys):
    """`export --engine vllm` would flatten Gemma 3's per-layer-type rope into one form: refused in one line (it
    was a KeyError: 'rope_theta'), nothing written."""
    out = tmp_path / "yarn"
    code, _, err = run_cli(capsys, "patch", gemma3, "--method", "yarn", "--factor", 2, "-o", out)
    assert code == 0, err
    code, _, err = run_cli(capsys, "export", out, "--engine", "vllm", "-o", tmp_path / "vllm")
    assert code == 2 and len(err.strip().splitlines()) == 1 and "nested by layer type" in err, err
    assert not (tmp_path / "vllm").exists()
