"""The checkpoint `ctxext patch` writes loads in plain transformers (a process that never imports ctxext) with the
logits of the model patched in memory: every static frequency method, at its defaults and at other parameters,
on all four families, and a `ctxext search` result. The oracle is `ctxext.patch` in memory (ctxext's own
formulas); the loaded model computes its frequencies with transformers' code from the written config.json."""

import ast
import json
from pathlib import Path

import pytest
import torch

import ctxext
from ctxext.checkpoint import write_patched_checkpoint
from ctxext.config import load_method_config
from ctxext.methods import get_method, per_pair_factors
from ctxext.patching.forms import rope_form
from ctxext.serving.forms import with_both_spellings
from tests.helpers import (
    FAMILIES,
    load_in_plain_transformers,
    run_cli,
    save_tiny_checkpoint,
    tiny_model,
    write_documents,
)

# (method, parameters, the native rope type the checkpoint must use). L = 64 for the tiny models.
CASES = {
    "ntk": ("ntk", {"factor": 4.0}, "default"),
    "ntk_alpha": ("ntk", {"factor": 4.0, "alpha": 5.0}, "default"),
    "theta": ("theta", {"factor": 4.0, "new_base": 1e6}, "default"),
    "ntk_fixed": ("ntk_fixed", {"factor": 4.0}, "longrope"),
    "ntk_fixed_x8": ("ntk_fixed", {"factor": 8.0}, "longrope"),
    "ntk_mixed": ("ntk_mixed", {"factor": 4.0}, "longrope"),
    "ntk_mixed_beta": ("ntk_mixed", {"factor": 4.0, "beta": 0.3}, "longrope"),
    "ntk_by_parts": ("ntk_by_parts", {"factor": 4.0}, "longrope"),
    "ntk_by_parts_betas": ("ntk_by_parts", {"factor": 4.0, "beta_fast": 16.0, "beta_slow": 2.0}, "longrope"),
    "yarn_ratio_ramp": ("yarn", {"factor": 4.0, "ramp": "ratio", "attention_factor": 1.2}, "longrope"),
    "linear": ("linear", {"factor": 4.0}, "linear"),
    "yarn": ("yarn", {"factor": 4.0, "beta_fast": 24.0}, "yarn"),
    "yarn_attention": ("yarn", {"factor": 4.0, "attention_factor": 1.3}, "yarn"),
    "llama3": ("llama3", {"factor": 8.0}, "llama3"),
    "dynamic_ntk": ("dynamic_ntk", {"factor": 2.0}, "dynamic"),
}


def assert_both_spellings(config: dict, rope_type: str):
    assert config["rope_parameters"]["rope_type"] == rope_type
    assert config["rope_theta"] == config["rope_parameters"]["rope_theta"]
    if rope_type == "default":
        assert config["rope_scaling"] is None
    else:
        assert config["rope_scaling"] == {k: v for k, v in config["rope_parameters"].items() if k != "rope_theta"}


def assert_same_logits(path, model, tokens, case):
    plain = torch.load(path / "plain.pt", weights_only=True)
    with torch.no_grad():
        for n, logits in plain.items():
            torch.testing.assert_close(
                logits, model(tokens[:, :n]).logits, rtol=1e-5, atol=1e-5, msg=f"{case} at {n} tokens"
            )


@pytest.fixture(scope="module")
def written_and_loaded_plain(tmp_path_factory):
    """Every case written by ctxext for every family, then loaded in one plain-transformers process (starting
    one costs about 13 s on a 2-core CPU): the folder of each family's cases, and the tokens scored."""
    root = tmp_path_factory.mktemp("forms")
    for family in FAMILIES:
        source = save_tiny_checkpoint(root / family / "source", tiny_model(family, seed=2))
        for case, (method, params, _) in CASES.items():
            mapping = {"method": method, **params}
            write_patched_checkpoint(str(source), load_method_config(None, mapping), root / family / case)
    tokens = load_in_plain_transformers(root, [root / family / case for family in FAMILIES for case in CASES])
    return {family: root / family for family in FAMILIES}, tokens


@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_static_frequency_method_loads_in_plain_transformers_with_the_patched_logits(
    written_and_loaded_plain, family
):
    folders, tokens = written_and_loaded_plain
    folder = folders[family]
    unpatched = tiny_model(family, seed=2)
    for case, (method, params, rope_type) in CASES.items():
        config = json.loads((folder / case / "config.json").read_text())
        assert_both_spellings(config, rope_type)
        model = ctxext.patch(tiny_model(family, seed=2), method, **params)
        with torch.no_grad():  # the tolerance is far tighter than what the method changes
            assert not torch.allclose(unpatched(tokens).logits, model(tokens).logits, rtol=1e-5, atol=1e-5), case
        assert_same_logits(folder / case, model, tokens, case)


def test_a_search_result_is_written_in_its_native_form(tmp_path, capsys):
    pytest.importorskip("optuna")  # the search extra
    pytest.importorskip("cma")
    source = save_tiny_checkpoint(tmp_path / "source", tiny_model("llama", seed=1))
    g = torch.Generator().manual_seed(0)
    docs = write_documents(tmp_path / "docs", [torch.randint(0, 256, (300,), generator=g) for _ in range(3)])
    out = tmp_path / "search"
    code, _, err = run_cli(
        capsys,
        "search",
        source,
        "--method",
        "ntk_by_parts",
        "--factor",
        4,
        "--lengths",
        256,
        "--text-file",
        docs,
        "--trials",
        3,
        "--dtype",
        "fp32",
        "--no-progress",
        "-o",
        out,
    )
    assert code == 0, err
    best = json.loads((out / "results.json").read_text())["best"]["params"]
    checkpoint = out / "checkpoint"
    tokens = load_in_plain_transformers(tmp_path, [checkpoint])
    assert_both_spellings(json.loads((checkpoint / "config.json").read_text()), "longrope")
    model = ctxext.patch(tiny_model("llama", seed=1), "ntk_by_parts", factor=4.0, **best)
    assert_same_logits(checkpoint, model, tokens, "search result")


def test_per_pair_factors_are_the_ratio_of_the_frequencies():
    """Oracle: METHODS' ntk_fixed divisor s^(2(i+1)/d), computed here in float64."""
    d, s = 64, 4.0
    spec = get_method("ntk_fixed")
    factors = per_pair_factors(spec, spec.make_params(factor=s), d, 1e4, 64)
    expected = [s ** (2 * (i + 1) / d) for i in range(d // 2)]
    assert factors == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize(
    "method,params,reason",
    [
        ("dynamic_yarn", {"factor": 4.0}, "current length"),
        ("ntk_by_parts", {"factor": 4.0, "dynamic": True}, "current length"),
        ("self_extend", {}, "inside attention"),
        ("string", {}, "inside attention"),
    ],
)
def test_methods_without_a_native_form_keep_ctxext_types_and_say_why(method, params, reason):
    spec = get_method(method)
    form = rope_form(spec, spec.make_params(**params), 64, 1e4, 64)
    assert not form.native and form.rope_parameters["rope_type"].startswith("ctxext_")
    assert reason in form.how


def test_format_ctxext_keeps_ctxext_types():
    spec = get_method("ntk_mixed")
    params = spec.make_params(factor=4.0)
    assert rope_form(spec, params, 64, 1e4, 64, format="ctxext").rope_parameters["rope_type"] == "ctxext_ntk_mixed"
    assert rope_form(spec, params, 64, 1e4, 64).rope_parameters["rope_type"] == "longrope"


def test_both_spellings_leave_the_rest_of_the_config_alone():
    config = {"model_type": "llama", "hidden_size": 8, "rope_parameters": {"rope_type": "default", "rope_theta": 1.0}}
    rope = {"rope_type": "linear", "rope_theta": 5e5, "factor": 2.0, "original_max_position_embeddings": 64}
    out = with_both_spellings(config, rope)
    assert out["rope_parameters"] == rope and out["rope_theta"] == 5e5
    assert out["rope_scaling"] == {"rope_type": "linear", "factor": 2.0, "original_max_position_embeddings": 64}
    assert {k: out[k] for k in ("model_type", "hidden_size")} == {"model_type": "llama", "hidden_size": 8}


def test_keys_for_vllm_and_sglang_carry_the_attention_factor():
    """They read longrope's scale from short/long_mscale and yarn's from attn_factor x (0.1 ln s + 1)."""
    import math

    spec = get_method("ntk_by_parts")
    longrope = rope_form(spec, spec.make_params(factor=4.0), 64, 1e4, 64).rope_parameters
    assert longrope["short_mscale"] == longrope["long_mscale"] == longrope["attention_factor"] == 1.0
    spec = get_method("yarn")
    yarn = rope_form(spec, spec.make_params(factor=4.0, attention_factor=1.3), 64, 1e4, 64).rope_parameters
    assert yarn["attn_factor"] * (0.1 * math.log(4.0) + 1) == pytest.approx(1.3, rel=1e-12)
    assert "attn_factor" not in rope_form(spec, spec.make_params(factor=4.0), 64, 1e4, 64).rope_parameters


def test_dynamic_ntk_carries_the_length_vllm_scales_its_base_from():
    """vLLM's dynamic NTK scales by max_position_embeddings / max_trained_positions (default: no scaling at all), so
    max_trained_positions = L is written; max_position_embeddings stays L for transformers, and `ctxext export`
    prints the override that takes vLLM past it (tests/test_serving_export.py)."""
    spec = get_method("dynamic_ntk")
    rope = rope_form(spec, spec.make_params(factor=4.0), 64, 1e4, 64).rope_parameters
    assert rope["rope_type"] == "dynamic" and rope["max_trained_positions"] == 64
    assert type(rope["max_trained_positions"]) is int
    assert with_both_spellings({}, rope)["rope_scaling"]["max_trained_positions"] == 64


FORM_BUILDERS = ("rope_parameters_for", "equal_sets_longrope", "longrope_form", "p_rope_form", "with_mscales")


def test_the_rope_form_is_decided_in_one_module():
    """Only ctxext/patching/forms.py turns a method into rope parameters (the builders of patching/rope_types.py):
    patch, save_pretrained, export and fine-tuning all take the form from there, so no second writer can drift."""
    package = Path(ctxext.__file__).parent
    callers = sorted(
        f"{path.relative_to(package)}:{node.lineno} {node.func.id}"
        for path in package.rglob("*.py")
        if path.name not in ("forms.py", "rope_types.py") or path.parent.name != "patching"
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in FORM_BUILDERS
    )
    assert not callers, f"rope parameters built outside ctxext/patching/forms.py: {callers}"
