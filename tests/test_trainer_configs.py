"""Configs trainers edit (issue 64 item 6): LLaMA-Factory and axolotl assign `config.rope_scaling = {...}`, and
transformers 5's setter replaces `rope_parameters` by the scaling with `rope_theta` None. The oracle of the defect
is transformers itself: its own rotary cannot be built from such a config (`NoneType ** Tensor`). ctxext refuses
the config in one line naming the missing base, in the Python API and on the command line, and never writes a
config.json without a base."""

import contextlib
import json

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

import ctxext
from ctxext.errors import CtxextError
from ctxext.loading import load_config, load_model
from ctxext.patching.families import missing_base
from ctxext.serving.forms import with_both_spellings
from tests.helpers import requires_transformers, run_cli, save_tiny_checkpoint, tiny_model, transformers_at_least

TRAINER_SCALING = {"type": "linear", "factor": 2.0}  # LLaMA-Factory's and axolotl's assignment


def trainer_edited_llama():
    """A tiny llama after `config.rope_scaling = {...}`, as LLaMA-Factory and axolotl leave it."""
    model = tiny_model("llama")
    with setter_warning():
        model.config.rope_scaling = dict(TRAINER_SCALING)
    return model


def setter_warning():
    """transformers 5.21 and later deprecate the setter (and still run it); before, it replaces rope_parameters
    by the scaling silently (`{'type': 'linear', 'factor': 2.0}`: no rope_type, no rope_theta)."""
    return pytest.warns(FutureWarning) if transformers_at_least("5.21") else contextlib.nullcontext()


def test_the_setter_drops_the_base_and_transformers_cannot_build_its_rotary():
    model = trainer_edited_llama()
    assert model.config.rope_parameters.get("rope_theta") is None
    with pytest.raises(
        (TypeError, KeyError),
        match="NoneType|rope_t",  # transformers' own rotary, built from that config
    ):  # (a KeyError of rope_type before transformers 5.21)
        LlamaRotaryEmbedding(config=model.config)


def assert_names_the_base(text: str, fix: str):
    assert "\n" not in text.strip(), text
    assert "has no rope_theta" in text and "config.rope_scaling is assigned" in text and fix in text, text
    assert "NoneType" not in text, text


@pytest.mark.parametrize("method", ["yarn", "self_extend"])
def test_patch_refuses_a_config_without_its_base_in_one_line(method):
    model = trainer_edited_llama()
    with pytest.raises(CtxextError) as raised:
        ctxext.patch(model, method, factor=2)
    assert_names_the_base(str(raised.value), "set config.rope_parameters['rope_theta']")
    assert model.config.rope_parameters.get("rope_theta") is None  # nothing was changed


@requires_transformers("5.21", "the setter leaves {'type': ...} without rope_type, which its own model cannot build")
def test_the_base_put_back_as_the_error_says_patches_as_a_config_that_never_lost_it():
    config = trainer_edited_llama().config
    config.rope_parameters["rope_theta"] = 10000.0  # what the error asks for
    fixed = LlamaForCausalLM(config).eval()  # a trainer builds the model from the config it edited
    ctxext.patch(fixed, "yarn", factor=2)
    shipped = tiny_model("llama", rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0})
    ctxext.patch(shipped, "yarn", factor=2)
    positions = torch.arange(16)[None]
    hidden = torch.zeros(1, 16, 64)
    for got, want in zip(fixed.model.rotary_emb(hidden, positions), shipped.model.rotary_emb(hidden, positions)):
        torch.testing.assert_close(got, want)


def test_a_missing_base_beside_a_scaling_is_refused_too():
    model = tiny_model("llama")
    model.config.rope_parameters = {"rope_type": "linear", "factor": 2.0}  # assigned whole, without its base
    with pytest.raises(CtxextError, match="has no rope_theta"):
        ctxext.patch(model, "linear", factor=2)


@pytest.mark.parametrize(
    "rope_parameters, where",
    [
        ({"rope_type": "default", "rope_theta": 10000.0}, None),
        ({"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6}, None),
        ({"rope_type": "linear", "factor": 2.0, "rope_theta": None}, "rope_parameters"),
        ({"type": "linear", "factor": 2.0}, "rope_parameters"),
        ({"rope_type": "default", "rope_theta": None}, "rope_parameters"),
        (
            {
                "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": None},
            },
            "rope_parameters['sliding_attention']",
        ),
        (None, None),
    ],
)
def test_missing_base_names_the_set_without_one(rope_parameters, where):
    assert missing_base(rope_parameters) == where


@pytest.fixture
def saved_by_a_trainer(tmp_path):
    if not transformers_at_least("5.21"):
        pytest.skip("before transformers 5.21 a config.json without rope_theta loads with the class default base")
    """A checkpoint saved after the setter: config.json's rope_parameters carry rope_theta null."""
    path = save_tiny_checkpoint(tmp_path / "trained", trainer_edited_llama())
    config = json.loads((path / "config.json").read_text())
    assert config["rope_parameters"].get("rope_theta") is None and config.get("rope_theta") is None
    return path


@pytest.mark.parametrize("command", ["methods", "patch"])
def test_the_cli_refuses_such_a_checkpoint_in_one_line(command, saved_by_a_trainer, tmp_path, capsys):
    if command == "methods":
        argv = ["methods", "--model", saved_by_a_trainer]
    else:
        argv = ["patch", saved_by_a_trainer, "--method", "yarn", "--factor", "2", "-o", tmp_path / "out"]
    code, out, err = run_cli(capsys, *argv)
    assert code == 2, (out, err)
    assert err.count("\n") == 1, err
    assert_names_the_base(err, "rope_parameters['rope_theta'] in that file")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("load", [load_config, load_model])
def test_loading_such_a_checkpoint_names_the_base(load, saved_by_a_trainer):
    with pytest.raises(CtxextError) as raised:
        load(str(saved_by_a_trainer))
    assert_names_the_base(str(raised.value), "in that file")


def test_ctxext_writes_no_config_without_its_base(tmp_path):
    with pytest.raises(CtxextError, match="has no rope_theta"):
        with_both_spellings({}, {"rope_type": "linear", "factor": 2.0, "rope_theta": None})
    model = tiny_model("llama")
    ctxext.patch(model, "yarn", factor=2)
    with setter_warning():
        model.config.rope_scaling = dict(TRAINER_SCALING)  # a trainer's edit after the patch
    with pytest.raises(CtxextError, match="has no rope_theta"):
        ctxext.save_pretrained(model, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_every_config_ctxext_writes_has_its_base(tmp_path):
    model = tiny_model("llama")
    ctxext.patch(model, "yarn", factor=2)
    ctxext.save_pretrained(model, tmp_path / "out")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert missing_base(config["rope_parameters"]) is None and config["rope_theta"] == 10000.0
    assert LlamaConfig.from_pretrained(tmp_path / "out").rope_parameters["rope_theta"] == 10000.0
