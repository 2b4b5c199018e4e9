"""One set of validators (ctxext.validate) behind method parameters, method configs, recipes and patch()."""

import math

import pytest
import torch

import ctxext
from ctxext.config import MethodConfig
from ctxext.errors import CtxextError
from ctxext.train.recipe import recipe_from_mapping
from ctxext.validate import boolean, choice, number, string_list, whole_number
from tests.helpers import tiny_model


def test_a_whole_number_written_as_a_float_is_accepted_everywhere_patch_accepts_it():
    # patch() reads L = 64.0 as 64; the method config (YAML, CLI flags) used to reject it.
    config = MethodConfig.from_mapping({"method": "yarn", "factor": 2, "original_max_position_embeddings": 64.0})
    assert config.original_max_position_embeddings == 64 and type(config.original_max_position_embeddings) is int
    tokens = torch.randint(0, 256, (1, 80), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        via_config = config.apply(tiny_model("llama"))(tokens).logits
        via_patch = ctxext.patch(tiny_model("llama"), "yarn", factor=2, original_max_position_embeddings=64.0)(
            tokens
        ).logits
    assert torch.equal(via_config, via_patch)
    recipe = recipe_from_mapping(
        {
            "model": "m",
            "output_dir": "o",
            "seq_len": 8192.0,
            "data": {"dataset": "d"},
            "lora": {"r": 16.0},
            "eval": {"every": 0},
        }
    )
    assert (recipe.seq_len, recipe.lora.r) == (8192, 16) and type(recipe.seq_len) is int


@pytest.mark.parametrize("value", [2.5, True, float("nan"), float("inf"), "64", None])
def test_not_a_whole_number_is_refused_by_config_and_recipe(value):
    with pytest.raises(CtxextError, match="original_max_position_embeddings"):
        MethodConfig.from_mapping({"method": "yarn", "original_max_position_embeddings": value or "x"})
    with pytest.raises(CtxextError, match="'seq_len'"):
        recipe_from_mapping({"model": "m", "output_dir": "o", "seq_len": value, "data": {"dataset": "d"}})


def test_validators():
    assert whole_number("n", 4096.0) == 4096 and whole_number("n", 0, minimum=0) == 0
    assert whole_number("n", None, allow_none=True) is None
    for bad, message in [
        (0, "'n' must be >= 1, got 0"),
        (2.5, "'n' must be a whole number, got 2.5"),
        (True, "'n' must be a number, got True"),
        (math.inf, "'n' must be a number"),
    ]:
        with pytest.raises(CtxextError, match=message.replace("(", r"\(")):
            whole_number("n", bad)
    assert number("x", 0.5, minimum=0, maximum=1) == 0.5 and number("x", None, allow_none=True) is None
    for kwargs, message in [
        ({"minimum": 1}, "'x' must be >= 1, got 0.5"),
        ({"minimum": 0.5, "strict": True}, "'x' must be > 0.5"),
        ({"maximum": 0.25}, "'x' must be <= 0.25"),
        ({"minimum": 0.75, "maximum": 1}, "'x' must be between 0.75 and 1"),
    ]:
        with pytest.raises(CtxextError, match=message):
            number("x", 0.5, **kwargs)
    assert boolean("b", False) is False
    with pytest.raises(CtxextError, match="'b' must be true or false, got 'yes'"):
        boolean("b", "yes")
    with pytest.raises(CtxextError, match=r"did you mean 'cosine'\?"):
        choice("s", "cosnie", ("constant", "cosine"))
    assert string_list("l", "a") == ["a"]
    with pytest.raises(CtxextError, match="list of strings"):
        string_list("l", ["a", 1])
