"""The numbers `ctxext patch` writes into config.json have the types the serving engines expect.

vLLM's and SGLang's linear rope wrap a float `factor` in a list (`isinstance(factor, float)`), so an integer
factor fails to load there (`TypeError: 'int' object is not iterable`); transformers accepts either. Every
scale, beta, attention factor and base is written as a float, whatever the command line's number looked like;
lengths stay integers.
"""

import json
import shutil

import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM

from ctxext.cli import main
from ctxext.patching.rope_types import with_float_numbers
from ctxext.serving.forms import with_both_spellings
from tests.helpers import save_tiny_checkpoint, tiny_model

FLOATS = (
    "factor",
    "beta_fast",
    "beta_slow",
    "attention_factor",
    "mscale",
    "mscale_all_dim",
    "low_freq_factor",
    "high_freq_factor",
    "rope_theta",
    "attn_factor",
    "short_mscale",
    "long_mscale",
)
LISTS = ("short_factor", "long_factor")
LENGTHS = ("original_max_position_embeddings",)

# (method, integer-valued flags, keys config.json must carry)
CASES = [
    ("linear", ["--factor", "4"], {"factor"}),
    (
        "yarn",
        ["--factor", "4", "--beta-fast", "32", "--beta-slow", "1", "--attention-factor", "1"],
        {"factor", "beta_fast", "beta_slow", "attention_factor", "attn_factor"},
    ),
    ("yarn", ["--factor", "4", "--mscale", "1", "--mscale-all-dim", "1"], {"factor", "mscale", "mscale_all_dim"}),
    (
        "llama3",
        ["--factor", "8", "--low-freq-factor", "1", "--high-freq-factor", "4"],
        {"factor", "low_freq_factor", "high_freq_factor"},
    ),
    ("dynamic_ntk", ["--factor", "2"], {"factor"}),
    ("ntk_by_parts", ["--factor", "4"], {"factor", "short_factor", "long_factor", "attention_factor", "short_mscale"}),
    ("ntk", ["--factor", "4"], set()),
    ("yarn", ["--factor", "4", "--format", "ctxext", "--dynamic", "true"], {"factor"}),
]


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return save_tiny_checkpoint(tmp_path_factory.mktemp("src") / "tiny-llama", tiny_model("llama"))


def assert_engine_types(rope: dict, where: str) -> None:
    for key in FLOATS:
        if key in rope:
            assert type(rope[key]) is float, f"{where}[{key!r}] = {rope[key]!r} is not a float"
    for key in LISTS:
        if key in rope:
            assert rope[key] and all(type(x) is float for x in rope[key]), f"{where}[{key!r}] has non-floats"
    for key in LENGTHS:
        if key in rope:
            assert type(rope[key]) is int, f"{where}[{key!r}] = {rope[key]!r} is not an int"


def as_ints(rope: dict) -> dict:
    """`rope` with every whole float among the engine numbers written as an int, as ctxext wrote them before."""
    whole = lambda x: int(x) if isinstance(x, float) and x.is_integer() else x
    out = {k: whole(v) if k in FLOATS else v for k, v in rope.items()}
    return out | {k: [whole(x) for x in rope[k]] for k in LISTS if k in rope}


@pytest.mark.parametrize(("method", "flags", "keys"), CASES)
def test_patch_writes_engine_numbers_as_floats(source, tmp_path, capsys, method, flags, keys):
    out = tmp_path / "out"
    assert main(["patch", str(source), "--method", method, *flags, "-o", str(out)]) == 0, capsys.readouterr()
    config = json.loads((out / "config.json").read_text())
    rope = config["rope_parameters"]
    assert keys <= set(rope), rope
    assert_engine_types(rope, "rope_parameters")
    if config["rope_scaling"] is not None:
        assert_engine_types(config["rope_scaling"], "rope_scaling")
    assert type(config["rope_theta"]) is float
    assert type(config["max_position_embeddings"]) is int
    record = yaml.safe_load((out / "ctxext.yaml").read_text())
    assert_engine_types(record["rope_parameters"], "ctxext.yaml rope_parameters")

    # Floats change no computation: the same checkpoint with the integers ctxext wrote before loads to the same
    # logits, bit for bit.
    as_before = tmp_path / "as-before"
    shutil.copytree(out, as_before)
    config["rope_parameters"] = as_ints(rope)
    if config["rope_scaling"] is not None:
        config["rope_scaling"] = as_ints(config["rope_scaling"])
    (as_before / "config.json").write_text(json.dumps(config))
    tokens = torch.randint(0, 256, (1, 120), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = AutoModelForCausalLM.from_pretrained(out).eval()(tokens).logits
        assert torch.equal(logits, AutoModelForCausalLM.from_pretrained(as_before).eval()(tokens).logits)


def test_with_float_numbers_leaves_lengths_flags_and_other_keys_alone():
    rope = {
        "rope_type": "yarn",
        "rope_theta": 10000,
        "factor": 4,
        "beta_fast": 32,
        "original_max_position_embeddings": 4096,
        "truncate": True,
        "short_factor": [1, 2.5],
        "window": 512,
    }
    out = with_float_numbers(rope)
    assert out == rope and out is not rope
    assert [type(out[k]) for k in ("rope_theta", "factor", "beta_fast")] == [float] * 3
    assert [type(x) for x in out["short_factor"]] == [float, float]
    assert type(out["original_max_position_embeddings"]) is int
    assert out["truncate"] is True and type(out["window"]) is int
    assert rope["factor"] == 4 and type(rope["factor"]) is int  # the input is not modified


def test_nested_layer_type_parameters_are_converted_inside_each():
    nested = {"full_attention": {"rope_type": "linear", "rope_theta": 10000, "factor": 4}, "sliding_attention": None}
    out = with_float_numbers(nested)
    assert type(out["full_attention"]["factor"]) is float and type(out["full_attention"]["rope_theta"]) is float
    assert out["sliding_attention"] is None and type(nested["full_attention"]["factor"]) is int


def test_every_config_json_writer_writes_floats_whatever_it_is_given():
    """`with_both_spellings` writes every config.json (patch, finetune, export), also for parameters ctxext did not
    compute itself (a checkpoint written as it was loaded)."""
    config = with_both_spellings({"model_type": "llama"}, {"rope_type": "linear", "rope_theta": 10000, "factor": 4})
    assert type(config["rope_theta"]) is float
    for rope in (config["rope_parameters"], config["rope_scaling"]):
        assert type(rope["factor"]) is float
