"""Low-frequency clipping: `proportional` (p-RoPE) against transformers' own `proportional` rope type, `cope`
(CoPE, and its HardClip) against its formula written out here in float64 Python, their defaults from L, their bad
input from the command line, the checkpoint they write and what `ctxext export` says of it."""

import json
import math

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

import ctxext
from ctxext.checkpoint import write_patched_checkpoint
from ctxext.cli import main
from ctxext.config import load_method_config
from ctxext.errors import CtxextError
from ctxext.methods import compute_inv_freq, get_method
from ctxext.methods.frequency import proportional_fraction
from ctxext.patching.families import own_partial_rotary_factor
from ctxext.patching.rope_types import rope_parameters_for
from ctxext.serving.engines import engine_rope, engine_table, read_served_model
from tests.helpers import (
    LOGIT_TOLERANCE,
    reload_in_fresh_process,
    requires_transformers,
    save_tiny_checkpoint,
    tiny_config,
    tiny_model,
)


def ours(name, rotary_dim, base, original, **params):
    method = get_method(name)
    return compute_inv_freq(method, method.make_params(**params), rotary_dim, base, original)


def wavelength_count(rotary_dim, base, length):
    """Oracle: how many pairs have 2 pi / theta_i > length, theta_i = base^(-2i/d) in float64."""
    return sum(2 * math.pi / base ** (-2 * i / rotary_dim) > length for i in range(rotary_dim // 2))


def cope_oracle(rotary_dim, base, clip_pairs, clip="soft"):
    """CoPE written out pair by pair: theta_j times 0.5 * (1 + cos(pi * k / (c - 1))) for the k-th of the last c
    pairs (k = 0..c-1; one clipped pair keeps weight 1, as torch.linspace(0, pi, 1) = [0]); 0 for HardClip."""
    pairs = rotary_dim // 2
    out = []
    for j in range(pairs):
        theta = base ** (-2 * j / rotary_dim)
        k = j - (pairs - clip_pairs)
        if k >= 0:
            if clip == "hard":
                weight = 0.0
            else:
                weight = 1.0 if clip_pairs == 1 else 0.5 * (1 + math.cos(math.pi * k / (clip_pairs - 1)))
            theta *= weight
        out.append(theta)
    return torch.tensor(out, dtype=torch.float64)


def assert_matches(actual, expected, rtol=1e-6):
    """Relative error at most rtol (float32 rounding of float64 values), and exactly 0 where expected is 0."""
    expected = torch.as_tensor(expected, dtype=torch.float64)
    assert actual.dtype == torch.float32 and actual.shape == expected.shape
    zero = expected == 0
    assert torch.equal(actual[zero], torch.zeros_like(actual[zero]))
    rel = ((actual.double() - expected).abs() / expected.abs())[~zero]
    assert rel.numel() == 0 or rel.max().item() <= rtol, rel.max().item()


# ------------------------------------------------------------------- proportional vs transformers' own type
@pytest.mark.parametrize("head_dim", [16, 64, 80, 128, 256])
@pytest.mark.parametrize("p", [0.25, 0.3, 0.5, 0.77, 1.0])
@pytest.mark.parametrize("factor", [1.0, 2.5, 8.0])
def test_proportional_equals_transformers_proportional(head_dim, p, factor):
    rope_parameters = {"rope_type": "proportional", "rope_theta": 1e4, "partial_rotary_factor": p, "factor": factor}
    config = tiny_config("llama", head_dim=head_dim, rope_parameters=rope_parameters)
    expected, expected_attention = ROPE_INIT_FUNCTIONS["proportional"](config, None)
    inv_freq, attention = ours("proportional", head_dim, 1e4, 64, factor=factor, rope_proportion=p)
    torch.testing.assert_close(inv_freq, expected, rtol=1e-5, atol=0)
    assert torch.equal(inv_freq == 0, expected == 0) and attention == expected_attention == 1.0


@pytest.mark.parametrize("head_dim,base,L", [(64, 1e5, 8192), (128, 5e5, 8192), (80, 1e4, 2048), (16, 1e4, 64)])
def test_proportional_default_keeps_the_pairs_that_fit_in_L_and_writes_that_p(head_dim, base, L):
    method = get_method("proportional")
    params = method.make_params(factor=4.0)
    kept = head_dim // 2 - wavelength_count(head_dim, base, L)
    inv_freq, _ = compute_inv_freq(method, params, head_dim, base, L)
    assert int((inv_freq > 0).sum()) == kept and torch.all(inv_freq[kept:] == 0)
    p = proportional_fraction(head_dim, base, L, params)
    assert int(p * head_dim // 2) == kept and int(head_dim * p) // 2 == kept  # transformers; vLLM and SGLang
    rope_parameters = {"rope_type": "proportional", "rope_theta": base, "partial_rotary_factor": p, "factor": 4.0}
    config = tiny_config("llama", head_dim=head_dim, rope_parameters=rope_parameters)
    assert torch.equal(inv_freq, ROPE_INIT_FUNCTIONS["proportional"](config, None)[0])


def test_proportional_is_written_natively_unless_the_model_rotates_part_of_each_head():
    method = get_method("proportional")
    params = method.make_params(factor=4.0, rope_proportion=0.5)
    native = rope_parameters_for(method, params, 64, 1e4, 4096)
    assert native == {
        "rope_type": "proportional",
        "rope_theta": 1e4,
        "factor": 4.0,
        "original_max_position_embeddings": 4096,
        "partial_rotary_factor": 0.5,
    }
    assert rope_parameters_for(method, params, 64, 1e4, 4096, partial_rotary_factor=1.0) == native
    # a model that shipped p-RoPE rotates its whole head: its own partial rotary factor is None, not p
    assert own_partial_rotary_factor(native) is None
    assert own_partial_rotary_factor({"rope_type": "yarn", "partial_rotary_factor": 0.5}) == 0.5
    partial = rope_parameters_for(method, params, 16, 1e4, 4096, partial_rotary_factor=0.25)  # a phi-like model
    assert partial["rope_type"] == "ctxext_proportional" and partial["partial_rotary_factor"] == 0.25
    assert partial["rope_proportion"] == 0.5


# --------------------------------------------------------------------------------- cope vs its formula
@pytest.mark.parametrize("head_dim,base", [(16, 1e4), (64, 1e5), (128, 5e5)])
@pytest.mark.parametrize("clip_pairs", [1, 2, 3, 8])
def test_cope_equals_its_formula(head_dim, base, clip_pairs):
    inv_freq, attention = ours("cope", head_dim, base, 64, factor=4.0, clip_pairs=clip_pairs)
    assert_matches(inv_freq, cope_oracle(head_dim, base, clip_pairs))
    assert attention == 1.0
    first_clipped = head_dim // 2 - clip_pairs
    assert inv_freq[first_clipped] == ours("none", head_dim, base, 64)[0][first_clipped]  # weight 1
    if clip_pairs > 1:
        assert inv_freq[-1] == 0  # the taper ends at exactly 0


@pytest.mark.parametrize("head_dim,clip_pairs", [(16, 1), (16, 8), (64, 12), (128, 29)])
def test_hardclip_zeroes_the_last_c_pairs_and_keeps_the_rest(head_dim, clip_pairs):
    inv_freq, _ = ours("cope", head_dim, 1e4, 64, factor=2.0, clip_pairs=clip_pairs, clip="hard")
    plain, _ = ours("none", head_dim, 1e4, 64)
    kept = head_dim // 2 - clip_pairs
    assert torch.equal(inv_freq[:kept], plain[:kept]) and torch.all(inv_freq[kept:] == 0)
    assert_matches(inv_freq, cope_oracle(head_dim, 1e4, clip_pairs, "hard"))
    if kept:  # HardClip at factor 1 is p-RoPE keeping the other pairs
        same, _ = ours("proportional", head_dim, 1e4, 64, factor=1.0, rope_proportion=kept / (head_dim // 2))
        assert torch.equal(inv_freq, same)


@pytest.mark.parametrize(
    "head_dim,base,L,count",
    [(128, 5e5, 8192, 29), (64, 1e5, 8192, 12), (128, 1e4, 4096, 18), (16, 1e4, 64, 5)],
)
def test_cope_default_c_is_the_number_of_pairs_whose_wavelength_exceeds_L(head_dim, base, L, count):
    assert wavelength_count(head_dim, base, L) == count  # Llama-3-8B, SmolLM2, Llama-2-7B, the tiny test model
    for clip in ("soft", "hard"):
        inv_freq, _ = ours("cope", head_dim, base, L, factor=4.0, clip=clip)
        assert_matches(inv_freq, cope_oracle(head_dim, base, count, clip))
    # factor only sets the recorded length: the frequencies do not depend on it
    assert torch.equal(ours("cope", head_dim, base, L, factor=1.0)[0], ours("cope", head_dim, base, L, factor=8.0)[0])


@pytest.mark.parametrize(
    "name,params,message",
    [
        ("proportional", {"rope_proportion": 0}, "'rope_proportion' must be in (0, 1], got 0"),
        ("proportional", {"rope_proportion": 1.5}, "'rope_proportion' must be in (0, 1]"),
        ("proportional", {"rope_proportion": "half"}, "'rope_proportion' must be a number"),
        ("cope", {"clip_pairs": 0}, "'clip_pairs' must be >= 1"),
        ("cope", {"clip_pairs": 2.5}, "'clip_pairs' must be a whole number"),
        ("cope", {"clip": "medium"}, "'clip' must be one of soft, hard"),
    ],
)
def test_bad_parameters_are_one_line_errors(name, params, message):
    with pytest.raises(CtxextError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        get_method(name).make_params(factor=2.0, **params)


def test_c_beyond_the_models_pairs_and_an_empty_default_are_one_line_errors():
    with pytest.raises(CtxextError, match=r"'clip_pairs' must be in \[1, 8\] \(this model has 8 rotary pairs\), got 9"):
        ours("cope", 16, 1e4, 64, factor=2.0, clip_pairs=9)
    with pytest.raises(CtxextError, match="no pair's wavelength exceeds L = 1000000000, so the default clips nothing"):
        ours("cope", 16, 1e4, 10**9, factor=2.0)
    with pytest.raises(CtxextError, match="every pair's wavelength exceeds L = 1, so the default keeps none"):
        ours("proportional", 16, 1e4, 1, factor=2.0)


# ------------------------------------------------------------------------------ the command line, bad input
@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return save_tiny_checkpoint(tmp_path_factory.mktemp("src") / "tiny-llama", tiny_model("llama"))


BAD_INPUT = [
    (["--method", "cope", "--clip-pairs", "0"], "'clip_pairs' must be >= 1, got 0"),
    (["--method", "cope", "--clip-pairs", "9"], "'clip_pairs' must be in [1, 8] (this model has 8 rotary pairs)"),
    (["--method", "cope", "--clip", "medium"], "'clip' must be one of soft, hard"),
    (["--method", "proportional", "--rope-proportion", "0"], "'rope_proportion' must be in (0, 1], got 0"),
    (["--method", "proportional", "--rope-proportion", "1.5"], "'rope_proportion' must be in (0, 1], got 1.5"),
    (["--method", "proportional", "--rope-proportion", "-0.25"], "'rope_proportion' must be in (0, 1], got -0.25"),
]


@pytest.mark.parametrize("extra,message", BAD_INPUT, ids=[m for _, m in BAD_INPUT])
def test_bad_input_from_the_command_line_is_one_line_exit_2_nothing_written(source, tmp_path, capsys, extra, message):
    out = tmp_path / "out"
    code = main(["patch", str(source), *extra, "--factor", "2", "-o", str(out)])
    err = capsys.readouterr().err
    assert code == 2
    assert err.count("\n") == 1 and message in err and "Traceback" not in err, err
    assert not out.exists()


# ------------------------------------------------------------------------- the checkpoint, reloaded, served
def test_patched_checkpoints_reload_with_the_same_logits(tmp_path):
    """proportional is transformers' own type: plain transformers reloads it. cope is ctxext's type as
    save_pretrained writes it: it reloads after `import ctxext`."""
    tokens = torch.randint(0, 256, (1, 120), generator=torch.Generator().manual_seed(3))
    torch.save(tokens, tmp_path / "tokens.pt")
    cases = {
        "plain": {"proportional": {"factor": 4.0, "rope_proportion": 0.5}, "proportional_default": {"factor": 2.0}},
        "with-ctxext": {"cope": {"factor": 4.0}, "cope_hard": {"factor": 4.0, "clip": "hard", "clip_pairs": 2}},
    }
    for mode, methods in cases.items():
        expected, checkpoints = {}, {}
        for case, params in methods.items():
            unpatched = tiny_model("llama", seed=1)
            model = ctxext.patch(tiny_model("llama", seed=1), case.split("_")[0], **params)
            with torch.no_grad():
                logits = model(tokens).logits
                assert not torch.allclose(unpatched(tokens).logits, logits, **LOGIT_TOLERANCE), case
            expected[case] = (logits, model.config.rope_parameters["rope_type"])
            model.save_pretrained(tmp_path / case)
            checkpoints[case] = str(tmp_path / case)
        reloaded = reload_in_fresh_process(mode, tmp_path / "tokens.pt", checkpoints)
        for case, (logits, rope_type) in expected.items():
            assert reloaded[case] == rope_type == ("proportional" if mode == "plain" else "ctxext_cope"), case
            got = torch.load(tmp_path / case / "reloaded.pt", weights_only=True)
            torch.testing.assert_close(got["logits"], logits, **LOGIT_TOLERANCE, msg=case)


def write(source, out, method, format="native", **params):
    write_patched_checkpoint(str(source), load_method_config(None, {"method": method, **params}), out, format=format)
    return out


def test_ctxext_patch_writes_proportional_as_transformers_type(source, tmp_path):
    out = write(source, tmp_path / "p", "proportional", factor=4.0, rope_proportion=0.5)
    config = json.loads((out / "config.json").read_text())
    assert config["rope_parameters"] == {
        "rope_type": "proportional",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 64,
        "partial_rotary_factor": 0.5,
    }
    reference = ctxext.patch(tiny_model("llama"), "proportional", factor=4.0, rope_proportion=0.5)
    tokens = torch.randint(0, 256, (1, 100), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(AutoModelForCausalLM.from_pretrained(out).eval()(tokens).logits, reference(tokens).logits)


@requires_transformers(
    "5.20",
    "transformers 5.19 and older keep a loaded config.json's top-level partial_rotary_factor as an attribute and write it "
    "back, and their loader folds it into the new rope parameters (compat.py names it)",
)
def test_a_saved_proportional_checkpoint_patched_again_keeps_its_p_rope_pairs(source, tmp_path):
    """Its partial_rotary_factor is p, not a share of the head: yarn on top is turned over the whole head's pairs,
    keeps the p-RoPE pairs that do not turn (as on Gemma 4's full layers), and the checkpoint written reloads with
    the logits of that patch in memory. Transformers' types would turn every pair (a longrope with equal factor
    sets has no factor for a frequency of 0), so it is written as ctxext's type with the p it keeps."""
    first = write(source, tmp_path / "p", "proportional", factor=2.0, rope_proportion=0.5)
    again = write(first, tmp_path / "y", "yarn", factor=4.0)
    rope = json.loads((again / "config.json").read_text())["rope_parameters"]
    assert rope["rope_type"] == "ctxext_yarn" and rope["rope_proportion"] == 0.5
    assert "partial_rotary_factor" not in rope
    in_memory = ctxext.patch(AutoModelForCausalLM.from_pretrained(first).eval(), "yarn", factor=4.0)
    whole_head = ctxext.patch(tiny_model("llama"), "yarn", factor=4.0)
    tokens = torch.randint(0, 256, (1, 100), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        reloaded = AutoModelForCausalLM.from_pretrained(again).eval()(tokens).logits
        torch.testing.assert_close(reloaded, in_memory(tokens).logits, **LOGIT_TOLERANCE)
        assert (reloaded - whole_head(tokens).logits).abs().max() > 1e-4  # the pairs that do not turn matter


def levels(rows):
    return {row.engine: row.level for row in rows}


def test_export_says_which_engines_read_proportional(source, tmp_path):
    at_scale = read_served_model(write(source, tmp_path / "x4", "proportional", factor=4.0, rope_proportion=0.5))
    rows = engine_table(at_scale)
    assert levels(rows) == {"transformers": "exact", "vllm": "no", "sglang": "no", "llama.cpp": "no"}
    assert "takes no factor" in rows[1].how and "'proportional'" in rows[0].how
    with pytest.raises(CtxextError, match="vllm cannot serve proportional exactly: .*takes no factor"):
        engine_rope(at_scale, "vllm")
    unscaled = read_served_model(write(source, tmp_path / "x1", "proportional", factor=1.0, rope_proportion=0.5))
    assert levels(engine_table(unscaled)) == {
        "transformers": "exact",
        "vllm": "exact",
        "sglang": "exact",
        "llama.cpp": "no",
    }
    rope, extra, how = engine_rope(unscaled, "sglang")
    assert rope == unscaled.rope_parameters and extra == {} and "as written" in how


def test_export_says_cope_has_no_llama_cpp_form_and_no_rope_type_of_its_own(source, tmp_path):
    served = read_served_model(write(source, tmp_path / "cope", "cope", factor=4.0, format="ctxext"))
    assert served.rope_parameters["rope_type"] == "ctxext_cope"
    assert levels(engine_table(served)) == {"transformers": "no", "vllm": "no", "sglang": "no", "llama.cpp": "no"}
