"""`ctxext patch`, `ctxext methods` and `ctxext plot-freqs` from the command line, good and bad input."""

import hashlib
import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel

import ctxext
from tests.helpers import run_cli, save_tiny_checkpoint, tiny_model

REPO = Path(__file__).resolve().parents[1]
patch_module = importlib.import_module("ctxext.patching.patch")  # the package's `patch` is the function
forms_module = importlib.import_module("ctxext.patching.forms")


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return save_tiny_checkpoint(tmp_path_factory.mktemp("src") / "tiny-llama", tiny_model("llama"))


def digest(folder: Path) -> str:
    h = hashlib.sha256()
    for f in sorted(folder.rglob("*")):
        h.update(str(f.relative_to(folder)).encode())
        if f.is_file():
            h.update(f.read_bytes())
    return h.hexdigest()


def test_patch_writes_a_complete_checkpoint_and_leaves_the_source_alone(source, tmp_path, capsys):
    before = digest(source)
    out = tmp_path / "out"
    code, stdout, _ = run_cli(capsys, "patch", source, "--method", "yarn", "--factor", "4", "-o", out)
    assert code == 0, stdout
    assert digest(source) == before
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "ctxext.yaml"} <= names
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no staging directory left behind
    record = yaml.safe_load((out / "ctxext.yaml").read_text())
    assert record["method"] == "yarn" and record["factor"] == 4
    assert record["rope_parameters"]["rope_type"] == "yarn" and record["max_position_embeddings"] == 256

    reference = ctxext.patch(tiny_model("llama"), "yarn", factor=4.0)
    reloaded = AutoModelForCausalLM.from_pretrained(out).eval()
    tokens = torch.randint(0, 256, (1, 200), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(reloaded(tokens).logits, reference(tokens).logits)


@pytest.mark.parametrize("method", ["yarn", "self_extend"])
def test_patch_plans_once_and_writes_what_an_in_memory_patch_records(source, tmp_path, capsys, monkeypatch, method):
    """The plan `ctxext patch` makes on the config's skeleton before any weights load is the one carried out on the
    loaded model: one plan and one rope form per patch, and the same config as `ctxext.patch` on a fresh model (which plans itself)."""
    plans, forms = [], []
    planner, builder = patch_module.plan_patch, forms_module.rope_parameters_for
    monkeypatch.setattr(patch_module, "plan_patch", lambda *a, **k: plans.append(a[1]) or planner(*a, **k))
    monkeypatch.setattr(
        forms_module, "rope_parameters_for", lambda *a, **k: forms.append(a[0].name) or builder(*a, **k)
    )
    out = tmp_path / "out"
    code, stdout, _ = run_cli(
        capsys, "patch", source, "--method", method, "--factor", "2", "--format", "ctxext", "-o", out
    )
    assert code == 0, stdout
    assert plans == [method]
    assert forms == [method]  # the form decided once: config.json's is read from it (ctxext.patching.forms)
    monkeypatch.undo()
    in_memory = ctxext.patch(AutoModelForCausalLM.from_pretrained(source), method, factor=2)
    written = json.loads((out / "config.json").read_text())
    assert written["rope_parameters"] == json.loads(json.dumps(in_memory.config.rope_parameters))
    assert written["max_position_embeddings"] == in_memory.config.max_position_embeddings


def test_flags_override_yaml_keys(source, tmp_path, capsys):
    out = tmp_path / "out"
    config = REPO / "configs/methods/ntk_mixed.yaml"
    code, _, err = run_cli(capsys, "patch", source, "--config", config, "--factor", "2", "--beta", "0.5", "-o", out)
    assert code == 0, err
    record = yaml.safe_load((out / "ctxext.yaml").read_text())
    assert record["rope_parameters"] == {
        "rope_type": "ctxext_ntk_mixed",
        "rope_theta": 10000.0,
        "factor": 2,
        "beta": 0.5,
        "original_max_position_embeddings": 64,
    }


def test_every_method_yaml_is_valid_and_names_its_source():
    from ctxext.config import load_method_config

    files = sorted((REPO / "configs/methods").glob("*.yaml"))
    covered = {load_method_config(f).method for f in files}
    assert set(ctxext.METHODS) <= covered
    for f in files:
        assert f.read_text().startswith("#"), f"{f.name} should open with a comment naming its source"


def write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return path


BAD_INPUT = [
    (["--method", "yran"], "unknown method 'yran' (did you mean 'yarn'?)"),
    (["--method", "yarn", "--factor", "0.5"], "'factor' must be >= 1"),
    (["--method", "yarn", "--factor", "abc"], "'factor' must be a number"),
    (
        ["--method", "yarn", "--factor", "2", "--original-max-position-embeddings", "0"],
        "'original_max_position_embeddings' must be >= 1",
    ),
    (["--method", "yarn", "--factor", "2", "--original-max-position-embeddings", "-4096"], "must be >= 1, got -4096"),
    (["--config", "@typo.yaml"], "unknown key 'beta_fsat' for method 'yarn' (did you mean 'beta_fast'?)"),
    (["--config", "@list.yaml"], "must be a YAML mapping"),
    (["--config", "@broken.yaml"], "is not valid YAML"),
    (["--config", "@missing.yaml"], "does not exist"),
    ([], "give a method"),
]


@pytest.mark.parametrize("extra,message", BAD_INPUT, ids=[m for _, m in BAD_INPUT])
def test_bad_method_input_is_one_line_exit_2_nothing_written(source, tmp_path, capsys, extra, message):
    write(tmp_path, "typo.yaml", "method: yarn\nfactor: 2\nbeta_fsat: 16\n")
    write(tmp_path, "list.yaml", "- method: yarn\n")
    write(tmp_path, "broken.yaml", "method: yarn\nfactor: [2\n")
    extra = [str(tmp_path / e[1:]) if e.startswith("@") else e for e in extra]
    out = tmp_path / "out"
    code, stdout, err = run_cli(capsys, "patch", source, *extra, "-o", out)
    assert code == 2
    assert err.count("\n") == 1 and message in err and "Traceback" not in err, err
    assert not out.exists()


def test_bad_model_or_output_is_one_line_exit_2(source, tmp_path, capsys):
    gpt2 = tmp_path / "gpt2"
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64)).save_pretrained(gpt2)
    (tmp_path / "occupied").mkdir()
    (tmp_path / "occupied" / "keep.txt").write_text("precious")
    before = digest(source)
    capsys.readouterr()  # drop what the set-up printed
    cases = [
        ([tmp_path / "nope"], tmp_path / "o1", "does not exist"),
        ([gpt2], tmp_path / "o2", "has no rotary position embedding (RoPE)"),
        ([source], source, "overlaps the input"),
        ([source], source / "sub", "overlaps the input"),
        ([source], tmp_path / "occupied", "already exists and is not empty; use --overwrite"),
    ]
    for model, out, message in cases:
        code, _, err = run_cli(capsys, "patch", *model, "--method", "yarn", "--factor", "2", "-o", out)
        assert code == 2 and err.count("\n") == 1 and message in err, err
        assert out == source or out.name == "occupied" or not out.exists()
    assert digest(source) == before
    assert (tmp_path / "occupied" / "keep.txt").read_text() == "precious"


def test_overwrite_replaces_only_an_output_ctxext_wrote(source, tmp_path, capsys):
    out = tmp_path / "out"
    code, _, err = run_cli(capsys, "patch", source, "--method", "yarn", "--factor", "2", "-o", out)
    assert code == 0, err
    (out / "stale.txt").write_text("old")
    code, _, err = run_cli(capsys, "patch", source, "--method", "linear", "--factor", "2", "-o", out, "--overwrite")
    assert code == 0, err
    assert not (out / "stale.txt").exists() and (out / "model.safetensors").exists()
    assert json.loads((out / "config.json").read_text())["rope_scaling"]["rope_type"] == "linear"

    foreign = tmp_path / "foreign"  # a directory ctxext did not write: --overwrite leaves it alone
    foreign.mkdir()
    (foreign / "thesis.tex").write_text("precious")
    code, _, err = run_cli(capsys, "patch", source, "--method", "linear", "--factor", "2", "-o", foreign, "--overwrite")
    assert code == 2 and err.count("\n") == 1 and "was not written by ctxext" in err, err
    assert sorted(p.name for p in foreign.iterdir()) == ["thesis.tex"]


def test_console_entry_point_exit_code_and_one_line_error(tmp_path):
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "ctxext",
            "patch",
            str(tmp_path / "none"),
            "--method",
            "yarn",
            "-o",
            str(tmp_path / "o"),
        ],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"ctxext patch: error: model path '{tmp_path / 'none'}' does not exist"
    ]


def test_methods_lists_every_method_with_parameters(capsys):
    code, out, _ = run_cli(capsys, "methods", "-v")
    assert code == 0
    for name, method in ctxext.METHODS.items():
        assert f"{name} " in out and method.summary in out
    assert "--beta-fast" in out and "--new-base" in out and "--low-freq-factor" in out


def test_methods_default_listing_names_each_methods_parameters(capsys):
    code, out, _ = run_cli(capsys, "methods")
    assert code == 0
    for name, method in ctxext.METHODS.items():
        names = ", ".join(p for p, _, _ in method.param_help())
        assert f"{name:<13} {method.summary}\n{'':13} parameters: {names}" in out


def test_plot_freqs_draws_each_method(tmp_path, capsys):
    png = tmp_path / "freqs.png"
    code, out, _ = run_cli(
        capsys,
        "plot-freqs",
        "--method",
        "linear",
        "--method",
        "yarn",
        "--method",
        "ntk_mixed",
        "--factor",
        "4",
        "--head-dim",
        "128",
        "--base",
        "10000",
        "-o",
        png,
    )
    assert code == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    lines = {line.split()[0]: line for line in out.splitlines() if "pairs" in line}
    assert "kept   0, interpolated by s  64" in lines["linear"]
    # YaRN with d=128, b=1e4, L=4096: pairs up to floor(corr(32)) = 20 kept, from ceil(corr(1)) = 46 interpolated.
    assert "kept  21, interpolated by s  18" in lines["yarn"]


def test_plot_freqs_reads_the_method_from_config(tmp_path, capsys):
    # Written out: YaRN keeps pair i (ratio 1) up to floor(corr(beta_fast)) and fully interpolates from
    # ceil(corr(beta_slow)), corr(beta) = d ln(L / (2 pi beta)) / (2 ln b).
    import math

    d, b, L, beta_fast, beta_slow = 128, 10000.0, 2048, 16, 1
    corr = lambda beta: d * math.log(L / (2 * math.pi * beta)) / (2 * math.log(b))  # noqa: E731
    kept, interpolated = math.floor(corr(beta_fast)) + 1, d // 2 - math.ceil(corr(beta_slow))
    config = write(
        tmp_path,
        "yarn16.yaml",
        f"method: yarn\nfactor: 4\nbeta_fast: {beta_fast}\noriginal_max_position_embeddings: {L}\n",
    )
    code, out, err = run_cli(capsys, "plot-freqs", "--config", config, "--head-dim", d, "-o", tmp_path / "f.png")
    assert code == 0, err
    assert f"{'yarn x4':<16} kept {kept:3d}, interpolated by s {interpolated:3d}" in out, out
