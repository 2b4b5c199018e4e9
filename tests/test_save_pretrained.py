"""`ctxext.save_pretrained(model, dir)` writes a model patched in memory in the native form `ctxext patch` writes:
a process that never imports ctxext loads it with plain transformers and computes the patched model's logits,
where `model.save_pretrained` would have written ctxext's own types."""

import json
import subprocess
import sys
import textwrap

import pytest
import torch
import yaml

import ctxext
from ctxext.errors import CtxextError
from tests.helpers import tiny_model

# Methods whose in-memory rope type is ctxext's own, and whose native form is one of transformers' types.
CASES = {
    "ntk_fixed": ("ntk_fixed", {"factor": 4.0}, "longrope"),
    "ntk_by_parts": ("ntk_by_parts", {"factor": 4.0}, "longrope"),
    "ntk": ("ntk", {"factor": 4.0}, "default"),
    "yarn": ("yarn", {"factor": 4.0}, "yarn"),
}
RELOAD = textwrap.dedent("""
    import json, sys, torch
    from transformers import AutoModelForCausalLM
    tokens = torch.load(sys.argv[1], weights_only=True)
    out = {"ctxext_imported": False}
    for name, path in json.loads(sys.argv[2]).items():
        model = AutoModelForCausalLM.from_pretrained(path).eval()
        with torch.no_grad():
            torch.save(model(tokens).logits, path + "/reloaded.pt")
        out[name] = model.config.rope_parameters["rope_type"]
    out["ctxext_imported"] = "ctxext" in sys.modules
    print(json.dumps(out))
""")


def test_a_model_patched_in_memory_is_saved_in_the_form_plain_transformers_loads(tmp_path):
    tokens = torch.randint(0, 256, (1, 200), generator=torch.Generator().manual_seed(5))
    torch.save(tokens, tmp_path / "tokens.pt")
    expected, paths = {}, {}
    for i, (case, (method, params, native)) in enumerate(CASES.items()):
        model = ctxext.patch(tiny_model("llama", seed=i), method, **params).eval()
        with torch.no_grad():
            expected[case] = model(tokens).logits
        if native != method:  # in memory: ctxext's own type, which model.save_pretrained would write
            assert model.config.rope_parameters["rope_type"].startswith("ctxext_"), case
        form = ctxext.save_pretrained(model, tmp_path / case)
        assert form.native and form.rope_parameters["rope_type"] == native
        record = yaml.safe_load((tmp_path / case / "ctxext.yaml").read_text())
        assert record["method"] == method and record["written_as"]["format"] == "native"
        paths[case] = str(tmp_path / case)
    result = subprocess.run(
        [sys.executable, "-c", RELOAD, str(tmp_path / "tokens.pt"), json.dumps(paths)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    reloaded = json.loads(result.stdout.strip().splitlines()[-1])
    assert reloaded["ctxext_imported"] is False
    for case, (_, _, native) in CASES.items():
        assert reloaded[case] == native
        torch.testing.assert_close(torch.load(tmp_path / case / "reloaded.pt"), expected[case], rtol=1e-5, atol=1e-6)


def test_an_unpatched_model_is_refused(tmp_path):
    with pytest.raises(CtxextError, match="not patched by ctxext"):
        ctxext.save_pretrained(tiny_model("llama"), tmp_path / "out")
    assert not (tmp_path / "out").exists()
