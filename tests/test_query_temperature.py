"""The query temperature (Llama 4, Ministral 3): q *= 1 + beta ln(1 + floor(p / L)) on top of any method.

Oracles: the formula written out here per position; transformers' own Ministral 3 attention, which applies it from
`llama_4_scaling_beta` (a LLaMA with the same weights patched by ctxext must give its logits); and the checkpoint
ctxext writes for Ministral 3, reloaded by plain transformers."""

import math

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.models.ministral3 import Ministral3Config

import ctxext
from ctxext.methods.attention import query_temperature_scale
from ctxext.patching.attention import installed_settings
from ctxext.patching.families import rotary_host
from tests.family_models import L, build
from tests.helpers import run_cli

BETA = 0.3


def test_the_scale_is_the_formula_at_every_position():
    positions = torch.arange(0, 7 * L + 3)[None]
    got = query_temperature_scale(positions, BETA, L)[0]
    expected = [1 + BETA * math.log(1 + math.floor(p / L)) for p in range(7 * L + 3)]
    assert torch.equal(got[:L], torch.ones(L))  # inside L: exactly 1, the query unchanged
    torch.testing.assert_close(got.double(), torch.tensor(expected, dtype=torch.float64), rtol=1e-7, atol=0)


def ministral3_twin(llama, beta):
    """A Ministral 3 with the LLaMA's sizes and weights, plain RoPE, and transformers' own query temperature."""
    values = llama.config.to_dict()
    for key in ("model_type", "architectures", "transformers_version"):
        values.pop(key, None)
    base = llama.config.rope_parameters["rope_theta"]
    values["rope_parameters"] = {
        "rope_type": "default",
        "rope_theta": base,
        "original_max_position_embeddings": L,
        "llama_4_scaling_beta": beta,
    }
    twin = AutoModelForCausalLM.from_config(Ministral3Config(**values), attn_implementation="sdpa").eval()
    twin.load_state_dict(llama.state_dict())
    return twin


def test_ctxext_on_llama_equals_transformers_ministral3_own_temperature():
    llama, _ = build("llama")
    twin = ministral3_twin(llama, BETA)
    tokens = torch.randint(0, llama.config.vocab_size, (1, 4 * L), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        plain = llama(tokens).logits
        ctxext.patch(llama, "none", original_max_position_embeddings=L, query_temperature=BETA)
        try:
            patched = llama(tokens).logits
        finally:
            ctxext.unpatch(llama)
        expected = twin(tokens).logits
    torch.testing.assert_close(patched, expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(patched[:, :L], plain[:, :L])  # nothing changes inside L
    assert (patched[:, L:] - plain[:, L:]).abs().max() > 1e-3  # and it acts past L


def test_on_ministral3_it_is_written_as_the_family_key_and_plain_transformers_reloads_it(tmp_path):
    llama, _ = build("llama")
    model = ministral3_twin(llama, 0.1)
    ctxext.patch(model, "yarn", 2.0, original_max_position_embeddings=L, query_temperature=BETA)
    assert model.config.rope_parameters["llama_4_scaling_beta"] == BETA
    assert installed_settings(rotary_host(model)) is None  # the family's attention applies it, not ctxext's
    tokens = torch.randint(0, 128, (1, 3 * L), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        patched = model(tokens).logits
    model.save_pretrained(tmp_path / "m3")
    ctxext.unpatch(model)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "m3", dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(tokens).logits, patched, atol=1e-5, rtol=1e-5)


def test_cli_records_it_and_the_checkpoint_applies_it(tmp_path, capsys):
    from tests.helpers import save_tiny_checkpoint

    llama, _ = build("llama")
    source = save_tiny_checkpoint(tmp_path / "llama", llama)
    code, out, err = run_cli(
        capsys, "patch", source, "--method", "yarn", "--factor", "2", "--query-temperature", BETA, "-o", tmp_path / "o"
    )
    assert code == 0, err
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "o", dtype=torch.float32).eval()
    assert reloaded.config.ctxext_attention["query_temperature"] == BETA
    tokens = torch.randint(0, 128, (1, 3 * L), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ctxext.patch(llama, "yarn", 2.0, original_max_position_embeddings=L, query_temperature=BETA)
        torch.testing.assert_close(reloaded(tokens).logits, llama(tokens).logits, atol=1e-5, rtol=1e-5)
        ctxext.unpatch(llama)


@pytest.mark.parametrize("value", ["-0.1", "nan", "true"])
def test_bad_beta_is_one_line_and_writes_nothing(tmp_path, capsys, value):
    from tests.helpers import save_tiny_checkpoint

    source = save_tiny_checkpoint(tmp_path / "llama", build("llama")[0])
    capsys.readouterr()  # the save's progress bar
    code, out, err = run_cli(
        capsys, "patch", source, "--method", "yarn", "--query-temperature", value, "-o", tmp_path / "o"
    )
    assert code == 2 and len(err.strip().splitlines()) == 1 and "query_temperature" in err, err
    assert not (tmp_path / "o").exists()
