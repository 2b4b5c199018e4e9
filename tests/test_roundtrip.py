"""Save a patched model, reload it in a fresh process, get the same rotary tables and the same logits.

Types transformers knows must load in plain transformers (ctxext never imported); ctxext-only types must
load after `import ctxext`. The rotary cos/sin must match bit for bit. Logits are compared to float32
rounding only: a matmul's last bits can depend on memory alignment (MKL without CNR), which differs between
processes, and a clean-clone CI run once saw that on one of 14 checkpoints."""

import pytest
import torch

import ctxext
from tests.helpers import LOGIT_TOLERANCE, reload_in_fresh_process, tiny_model

NATIVE = {
    "linear": ("linear", {"factor": 4.0}),
    "yarn": ("yarn", {"factor": 4.0}),
    "yarn_mscale": ("yarn", {"factor": 4.0, "mscale": 0.707, "mscale_all_dim": 1.0}),
    "dynamic": ("dynamic_ntk", {"factor": 2.0}),
    "llama3": ("llama3", {"factor": 8.0}),
    "longrope": ("longrope", {"factor": 4.0}),
}
CTXEXT_ONLY = {
    "ntk": ("ntk", {"factor": 4.0, "alpha": 5.0}),
    "ntk_fixed": ("ntk_fixed", {"factor": 4.0}),
    "ntk_mixed": ("ntk_mixed", {"factor": 4.0, "beta": 0.5}),
    "ntk_by_parts": ("ntk_by_parts", {"factor": 4.0}),
    "yarn_ratio_ramp": ("yarn", {"factor": 4.0, "ramp": "ratio"}),
    "dynamic_yarn": ("dynamic_yarn", {"factor": 4.0}),
    "linear_dynamic": ("linear", {"factor": 4.0, "dynamic": True}),
    "theta": ("theta", {"factor": 4.0, "new_base": 1e6}),
}


@pytest.mark.parametrize("mode,cases", [("plain", NATIVE), ("with-ctxext", CTXEXT_ONLY)])
def test_saved_checkpoint_reloads_with_identical_logits(tmp_path, mode, cases):
    tokens = torch.randint(0, 256, (1, 300), generator=torch.Generator().manual_seed(3))
    torch.save(tokens, tmp_path / "tokens.pt")
    expected, checkpoints = {}, {}
    for i, (case, (method, params)) in enumerate(cases.items()):
        family = ["llama", "mistral", "qwen2", "qwen3"][i % 4]
        unpatched = tiny_model(family, seed=i).eval()
        model = ctxext.patch(tiny_model(family, seed=i), method, **params).eval()
        with torch.no_grad():
            logits = model(tokens).logits
            cos, sin = model.model.rotary_emb(logits, torch.arange(tokens.shape[1])[None])
            # The tolerance below must be far tighter than the change the method makes.
            assert not torch.allclose(unpatched(tokens).logits, logits, **LOGIT_TOLERANCE), case
        expected[case] = (logits, cos, sin, model.config.rope_parameters["rope_type"])
        model.save_pretrained(tmp_path / case)
        checkpoints[case] = str(tmp_path / case)

    reloaded = reload_in_fresh_process(mode, tmp_path / "tokens.pt", checkpoints)
    assert reloaded["ctxext_imported"] == (mode == "with-ctxext")
    for case in cases:
        logits, cos, sin, rope_type = expected[case]
        assert reloaded[case] == rope_type
        assert rope_type.startswith("ctxext_") == (mode == "with-ctxext"), case
        got = torch.load(tmp_path / case / "reloaded.pt", weights_only=True)
        assert torch.equal(got["cos"], cos) and torch.equal(got["sin"], sin), case
        torch.testing.assert_close(got["logits"], logits, **LOGIT_TOLERANCE, msg=case)


@pytest.mark.parametrize("method", ["linear", "yarn", "ntk", "dynamic_ntk"])
def test_patching_a_saved_scaled_checkpoint_again_extends_it_or_replaces_its_scaling_when_asked(tmp_path, method):
    """A checkpoint saved at x4 (L = 64 -> 256) patched again at x2 extends what it has: 256 -> 512. Linear and NTK,
    whose rules go by pair index, compose exactly into x8 of the original model (the oracle: patching the original at
    x8). Asked to replace the shipped scaling (the old behaviour), x2 counts from the recorded L = 64 again, with the
    frequencies of patching the original model at x2. A dynamic method grows from L and replaces as before."""
    from transformers import AutoModelForCausalLM

    original = tiny_model("llama")  # L = 64
    ctxext.patch(original, method, factor=4.0).save_pretrained(tmp_path / "x4")
    assert original.config.rope_parameters["original_max_position_embeddings"] == 64
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "x4")
    if method != "dynamic_ntk":
        ctxext.patch(reloaded, method, factor=2.0)
        assert reloaded.config.max_position_embeddings == 512
        if method in ("linear", "ntk"):
            x8 = ctxext.patch(tiny_model("llama"), method, factor=8.0)
            torch.testing.assert_close(
                reloaded.model.rotary_emb.inv_freq, x8.model.rotary_emb.inv_freq, rtol=1e-6, atol=0
            )
        ctxext.unpatch(reloaded)
        with pytest.warns(UserWarning, match="shorter than the 256 it has now"):  # 128 < 256, said
            ctxext.patch(reloaded, method, factor=2.0, replace_shipped=True)
    else:  # its config keeps L = 64 as max_position_embeddings: it grows from there, never shorter
        ctxext.patch(reloaded, method, factor=2.0, replace_shipped=True)
    assert ctxext.applied_method(reloaded)["original_max_position_embeddings"] == 64
    reference = ctxext.patch(tiny_model("llama"), method, factor=2.0)
    assert reloaded.config.max_position_embeddings == reference.config.max_position_embeddings
    assert torch.equal(reloaded.model.rotary_emb.inv_freq, reference.model.rotary_emb.inv_freq)
