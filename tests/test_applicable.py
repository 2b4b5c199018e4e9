"""`ctxext methods --model`: which methods apply to a model, decided from its config alone (a meta-device skeleton
with a real rotary module). The oracle is `ctxext.patch` itself on the real tiny model of the same config: every
method the skeleton says applies patches it, and every refusal is the one patch gives."""

import json

import pytest

import ctxext
from ctxext.errors import CtxextError
from ctxext.methods import METHODS
from ctxext.patching.applicable import applicable_methods, skeleton
from ctxext.patching.families import rope_layout
from tests.family_models import build, shipped_model
from tests.helpers import run_cli

# one family of each layout: plain, per-type rotary with sliding layers, interleaved angles, NoPE layers, partial
# rotary, angles laid out once with attention sinks, MoE
LAYOUTS = ("llama", "gemma3_text", "cohere", "smollm3", "phi", "gpt_oss", "mixtral")


def patch_outcome(model, method):
    try:
        ctxext.patch(model, method, 2.0)
    except CtxextError as error:
        return str(error)
    ctxext.unpatch(model)
    return None


@pytest.mark.parametrize("family", LAYOUTS)
def test_the_skeleton_says_what_patching_the_real_model_does(family):
    model, reason = build(family)
    assert model is not None, reason
    frame = skeleton(model.config)
    assert rope_layout(frame) == rope_layout(model)
    verdicts = applicable_methods(frame)
    assert set(verdicts) == set(METHODS) - {"none"}
    for method, verdict in verdicts.items():
        if verdict is not None and verdict.startswith("needs a setting"):
            continue  # theta without --new-base: a setting, not the model
        assert verdict == patch_outcome(model, method), method
    assert verdicts["yarn"] is None  # every family here takes a frequency method


def test_cli_prints_the_layout_and_writes_it_as_json(tmp_path, capsys):
    model, _ = build("gemma3_text")
    model.config.save_pretrained(tmp_path / "gemma")
    code, out, err = run_cli(capsys, "methods", "--model", tmp_path / "gemma", "--json", tmp_path / "layout.json")
    assert code == 0, err
    record = json.loads((tmp_path / "layout.json").read_text())
    by_type = {row["layer_type"]: row for row in record["layout"]}
    types = model.config.layer_types
    assert {t: by_type[t]["layers"] for t in by_type} == {t: types.count(t) for t in set(types)}
    assert by_type["sliding_attention"]["sliding_window"] == model.config.sliding_window
    assert by_type["full_attention"]["rope_theta"] == model.config.rope_parameters["full_attention"]["rope_theta"]
    assert record["per_type_rotary"] is True
    assert record["methods"]["linear"] is None and "linear        applies" in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--layer-types", "global"], "one set of frequencies; use --layer-types all"),
        (["--json", "x.json"], "add --model MODEL"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, argv, message):
    model, _ = build("llama")
    model.config.save_pretrained(tmp_path / "llama")
    argv = [a if a != "x.json" else str(tmp_path / "x.json") for a in argv]
    with_model = ["--model", tmp_path / "llama"] if "--layer-types" in argv else []
    code, out, err = run_cli(capsys, "methods", *with_model, *argv)
    assert code == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert message in err
    assert not (tmp_path / "x.json").exists()


def test_patch_refuses_from_the_config_before_any_weights_load(tmp_path, capsys):
    """A directory with config.json and no weights: the refusal is the one patch makes (unknown layer type,
    a remapping method on interleaved angles), not a failure to load weights."""
    for family, argv, message in [
        ("gemma3_text", ["--method", "linear", "--layer-types", "global"], "global"),
        ("cohere", ["--method", "self_extend"], "interleaved"),
    ]:
        model, _ = build(family)
        model.config.save_pretrained(tmp_path / family)
        code, out, err = run_cli(capsys, "patch", tmp_path / family, *argv, "--factor", "2", "-o", tmp_path / "out")
        assert code == 2 and len(err.strip().splitlines()) == 1, err
        assert message in err and "weights" not in err and "safetensors" not in err, err
        assert not (tmp_path / "out").exists()


def test_cli_says_which_methods_keep_a_shipped_scaling(tmp_path, capsys):
    """On a model that ships llama3 x8, the remapping methods are listed as keeping it and the frequency methods as
    composing with it, as `patch` does on the real model (the oracle: what its rotary module keeps or composes)."""
    model = shipped_model("llama")
    model.config.save_pretrained(tmp_path / "llama3")
    code, out, err = run_cli(capsys, "methods", "--model", tmp_path / "llama3")
    assert code == 0, err
    lines = {line.split()[0]: line for line in out.splitlines()[4:] if line.startswith("  ") and line.split()}
    assert "L0 32, trained context C 128, shipped scaling: llama3 x8" in out, out
    for method in ("self_extend", "gali", "yarn", "linear"):
        ctxext.patch(model, method, 2.0)
        rotary = ctxext.patching.rotary_host(model).rotary_emb
        kept, composed = bool(rotary.shipped), bool(rotary.composed_keys)
        ctxext.unpatch(model)
        assert ("(keeps the shipped llama3 x8 and remaps past C = 128)" in lines[method]) == kept, lines[method]
        assert ("(composes with the shipped llama3 x8)" in lines[method]) == composed, lines[method]
        assert kept == (method in ("self_extend", "gali")) and composed == (not kept)
