"""`ctxext eval` end to end on a tiny checkpoint: numbers against the naive HF-docs loop, outputs, bad input."""

import ast
import csv
import json
import shutil
import subprocess
import sys

import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM, AutoTokenizer

from ctxext import patch
from ctxext.cli import main
from tests.helpers import REPO, naive_nll, run_cli, save_smollm2_llama, self_extend_relative, write_hamlet_texts


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory, smollm2_path):
    """A random 2-layer LLaMA (L=256) with SmolLM2's real tokenizer, saved like any checkpoint."""
    return save_smollm2_llama(tmp_path_factory.mktemp("tiny"), smollm2_path, 256, tie_word_embeddings=True)


@pytest.fixture(scope="module")
def texts(tmp_path_factory):
    return write_hamlet_texts(tmp_path_factory.mktemp("texts"))


def test_eval_matches_naive_loop_for_every_method(tiny_checkpoint, texts, tmp_path, capsys):
    out = tmp_path / "out"
    code, _, err = run_cli(
        capsys,
        "eval",
        tiny_checkpoint,
        "--method",
        "linear",
        "--method",
        "yarn",
        "--factor",
        "2",
        "--lengths",
        "256,1024",
        "--stride",
        "256",
        "--text-file",
        texts,
        "--dtype",
        "fp32",
        "--no-progress",
        "-o",
        out,
    )
    assert code == 0, err
    results = json.loads((out / "results.json").read_text())
    assert [m["label"] for m in results["methods"]] == ["none", "linear x2", "yarn x2"]
    assert results["model"]["dtype"] == "float32"
    assert results["protocol"]["bos"]["windows_start_with_bos"] is False  # SmolLM2's tokenizer adds no BOS
    rows = {(r["method"], r["length"]): r for r in results["results"]}
    assert results["protocol"]["mode"] == "sliding window"
    assert results["protocol"]["stride_per_length"] == {"256": 128, "1024": 256}
    assert (rows[("none", 256)]["stride"], rows[("none", 1024)]["stride"]) == (128, 256)

    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoint)
    docs = [
        torch.tensor(tokenizer((texts / name).read_text(), add_special_tokens=False).input_ids)
        for name in ("a.txt", "b.txt")
    ]
    for label, method in (("none", None), ("linear x2", "linear"), ("yarn x2", "yarn")):
        model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32).eval()
        if method:
            patch(model, method, factor=2)
        for length in (256,) if method == "linear" else (256, 1024):  # the naive loop is the slow part
            long_enough = [d for d in docs if len(d) >= length]
            # --stride 256 slides at 1024; the 256 window is not longer than it, so it slides by 128 (not one pass).
            ref = [naive_nll(model, d, length, 128 if length == 256 else 256) for d in long_enough]
            row = rows[(label, length)]
            assert row["tokens_scored"] == sum(c for _, c in ref)
            assert row["nll_sum"] == pytest.approx(sum(n for n, _ in ref), rel=1e-5)
            assert row["documents_skipped"] == len(docs) - len(long_enough)
    # The same tokens for every method, and the short document is skipped (and said so) only at 1024.
    for length in (256, 1024):
        assert len({rows[(m, length)]["tokens_sha256"] for m in ("none", "linear x2", "yarn x2")}) == 1
    assert rows[("none", 256)]["documents_skipped"] == 0 and rows[("none", 1024)]["skipped"] == [str(texts / "b.txt")]

    with open(out / "results.csv") as handle:
        csv_rows = list(csv.DictReader(handle))
    assert len(csv_rows) == 6 and float(csv_rows[0]["perplexity"]) == pytest.approx(rows[("none", 256)]["perplexity"])
    assert (out / "perplexity.png").stat().st_size > 1000
    assert "none" in (out / "table.txt").read_text()
    for key in ("torch", "transformers", "accelerate", "datasets", "time_utc"):
        assert key in results["environment"]


def test_stride_window_is_one_pass_and_sweep_yaml(tiny_checkpoint, texts, tmp_path, capsys):
    sweep = tmp_path / "sweep.yaml"
    sweep.write_text(yaml.safe_dump({"factor": 4, "methods": ["ntk", {"method": "yarn", "beta_fast": 16}]}))
    out = tmp_path / "out"
    assert (
        run_cli(
            capsys,
            "eval",
            tiny_checkpoint,
            "--config",
            sweep,
            "--lengths",
            "256,1k",
            "--stride",
            "window",
            "--text-file",
            texts / "a.txt",
            "--dtype",
            "fp32",
            "--no-progress",
            "-o",
            out,
        )[0]
        == 0
    )
    results = json.loads((out / "results.json").read_text())
    assert [m["label"] for m in results["methods"]] == ["none", "ntk x4", "yarn x4"]
    assert results["methods"][2]["beta_fast"] == 16
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32).eval()
    patch(model, "yarn", factor=4, beta_fast=16)
    ids = torch.tensor(
        AutoTokenizer.from_pretrained(tiny_checkpoint)(
            (texts / "a.txt").read_text(), add_special_tokens=False
        ).input_ids
    )
    row = next(r for r in results["results"] if r["method"] == "yarn x4" and r["length"] == 1024)
    nll, count = naive_nll(model, ids, 1024, 1024)
    assert (row["windows"], row["tokens_scored"]) == (1, 1023) and count == 1023
    assert row["nll_sum"] == pytest.approx(nll, rel=1e-5)


def test_a_setting_that_reaches_past_l_is_named_with_the_one_that_does_not(tiny_checkpoint, texts, tmp_path, capsys):
    """SelfExtend G 2, w 64 on the L = 256 checkpoint: within L at 256 tokens, past it at 1024. The reach and the
    smallest group size that stays within L come from every (i, j) pair through the formula written out."""

    def largest(length, group_size):
        i, j = torch.tril_indices(length, length)
        return self_extend_relative(i, j, group_size, 64).max().item()

    assert largest(256, 2) <= 255 < largest(1024, 2)
    G = next(G for G in range(2, 1024) if largest(1024, G) <= 255)
    argv = ["eval", tiny_checkpoint, "--method", "self_extend", "--group-size", "2", "--window", "64", "--method",
            "yarn", "--factor", "2", "--lengths", "256,1024", "--text-file", texts / "a.txt", "--no-progress",
            "-o", tmp_path / "out"]  # fmt: skip
    code, out, err = run_cli(capsys, *argv)
    assert code == 0, err
    notes = [line for line in out.splitlines() if line.startswith("note:")]
    assert notes == [
        f"note: self_extend G2 w64 uses relative positions up to {largest(1024, 2)} at 1024 tokens, past the 256 "
        f"the model was trained on (at 1024); group_size >= {G} keeps them below 256"
    ]
    assert json.loads((tmp_path / "out" / "results.json").read_text())["notes"] == notes


def test_bos_yes_starts_every_window_with_bos_and_never_scores_it(tiny_checkpoint, texts, tmp_path, capsys):
    out = tmp_path / "out"
    assert (
        run_cli(
            capsys,
            "eval",
            tiny_checkpoint,
            "--bos",
            "yes",
            "--lengths",
            "256",
            "--stride",
            "200",
            "--text-file",
            texts / "b.txt",
            "--dtype",
            "fp32",
            "--no-progress",
            "-o",
            out,
        )[0]
        == 0
    )
    results = json.loads((out / "results.json").read_text())
    bos = results["protocol"]["bos"]
    assert bos["windows_start_with_bos"] and bos["bos_token_id"] == 1 and not bos["bos_scored"]
    (row,) = results["results"]
    ids = torch.tensor(
        AutoTokenizer.from_pretrained(tiny_checkpoint)(
            (texts / "b.txt").read_text(), add_special_tokens=False
        ).input_ids
    )
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32).eval()
    nll, count = naive_nll(model, ids, 256, 200, bos_token_id=1)
    assert row["tokens_scored"] == count == len(ids)  # every text token, BOS none
    assert row["nll_sum"] == pytest.approx(nll, rel=1e-5)


def test_patched_checkpoint_evaluates_as_loaded(tiny_checkpoint, texts, tmp_path, capsys):
    """A `ctxext patch` checkpoint, evaluated as loaded, scores what the in-memory method scores."""
    patched = tmp_path / "patched"
    assert run_cli(capsys, "patch", tiny_checkpoint, "--method", "yarn", "--factor", "2", "-o", patched)[0] == 0
    out = tmp_path / "out"
    assert (
        run_cli(
            capsys,
            "eval",
            patched,
            "--lengths",
            "512",
            "--stride",
            "256",
            "--text-file",
            texts / "a.txt",
            "--dtype",
            "fp32",
            "--no-progress",
            "-o",
            out,
        )[0]
        == 0
    )
    rows = {r["method"]: r for r in json.loads((out / "results.json").read_text())["results"]}
    out2 = tmp_path / "out2"
    assert (
        run_cli(
            capsys,
            "eval",
            tiny_checkpoint,
            "--method",
            "yarn",
            "--factor",
            "2",
            "--lengths",
            "512",
            "--stride",
            "256",
            "--text-file",
            texts / "a.txt",
            "--dtype",
            "fp32",
            "--no-progress",
            "-o",
            out2,
        )[0]
        == 0
    )
    direct = {r["method"]: r for r in json.loads((out2 / "results.json").read_text())["results"]}
    assert set(rows) == {"none", "as loaded (yarn x2)"}
    assert rows["as loaded (yarn x2)"]["nll_sum"] == pytest.approx(direct["yarn x2"]["nll_sum"], rel=1e-6)
    assert rows["none"]["nll_sum"] == pytest.approx(direct["none"]["nll_sum"], rel=1e-6)


BAD_INPUTS = [
    (["--text-file", "MISSING"], "does not exist"),
    (["--text-file", "EMPTY"], "is empty"),
    (["--text-file", "TEXT", "--lengths", "2k,abc"], "--lengths"),
    (["--text-file", "TEXT", "--lengths", ""], "--lengths"),
    (["--text-file", "TEXT", "--stride", "0"], "--stride"),
    (["--text-file", "TEXT", "--stride", "-5"], "--stride"),
    (["--text-file", "TEXT", "--lengths", "4096"], "too short for length 4096"),
    (["--dataset", "NOFIELD"], "no text field 'text'"),
    (["--dataset", "pg91"], "pg19"),
    (["--text-file", "TEXT", "--method", "yran"], "yarn"),
    (["--text-file", "TEXT", "--method", "linear", "--beta-fast", "3"], "beta-fast"),
    ([], "--dataset NAME or --text-file"),
]


@pytest.fixture
def bad_input_files(tmp_path):
    import datasets

    (tmp_path / "empty.txt").write_text("  \n")
    (tmp_path / "text.txt").write_text("To be, or not to be, that is the question. " * 40)
    datasets.Dataset.from_dict({"body": ["some text " * 50]}).save_to_disk(str(tmp_path / "nofield"))
    return {
        "MISSING": tmp_path / "missing.txt",
        "EMPTY": tmp_path / "empty.txt",
        "TEXT": tmp_path / "text.txt",
        "NOFIELD": tmp_path / "nofield",
    }


def _argv(checkpoint, out, args, files):
    argv = ["eval", str(checkpoint), "--no-progress", "-o", str(out)]
    if "--lengths" not in args:
        argv += ["--lengths", "256"]
    return argv + [str(files.get(a, a)) for a in args]


@pytest.mark.parametrize("args,message", BAD_INPUTS)
def test_bad_input_is_one_line_exit_2_and_writes_nothing(
    tiny_checkpoint, tmp_path, bad_input_files, capsys, args, message
):
    out = tmp_path / "out"
    assert main(_argv(tiny_checkpoint, out, args, bad_input_files)) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]  # --no-progress: no bar, transformers' own too
    assert len(lines) == 1 and lines[0].startswith("ctxext eval: error:") and message in lines[0], err
    assert not out.exists()
    from transformers.utils import logging

    assert logging.is_progress_bar_enabled()  # turned off for the load only


def test_bad_input_from_the_real_command(tiny_checkpoint, tmp_path, bad_input_files):
    """The installed entry point, as a user runs it: exit code 2 and one line on stderr."""
    out = tmp_path / "out"
    argv = _argv(tiny_checkpoint, out, ["--text-file", "TEXT", "--stride", "0"], bad_input_files)
    result = subprocess.run([sys.executable, "-m", "ctxext", *argv], capture_output=True, text=True)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [result.stderr.strip()] and "--stride" in result.stderr
    assert not out.exists()


def test_results_name_each_length_by_what_it_is(tiny_checkpoint, texts, tmp_path, capsys):
    """A checkpoint shipping yarn x2 over L0 = 128 (served at C = 256): results.json's model block has L0 as
    pretraining_length and C as trained_context (and C under the older key); each method row its method_length L,
    C by default and L0 with --replace-shipped (METHODS.md: a scaling on a scaling counts from what it replaces)."""
    shipped = tmp_path / "shipped"
    shutil.copytree(tiny_checkpoint, shipped)
    config = json.loads((shipped / "config.json").read_text())
    L0 = config["max_position_embeddings"] // 2
    yarn = {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": L0}
    config["rope_parameters"] = {**config["rope_parameters"], **yarn}
    (shipped / "config.json").write_text(json.dumps(config))
    C = int(yarn["factor"] * L0)
    for flags, L in (([], C), (["--replace-shipped"], L0)):
        argv = ["eval", shipped, "--method", "linear", "--factor", "2", *flags, "--no-baseline", "--lengths", "128",
                "--text-file", texts / "a.txt", "--no-progress", "-o", tmp_path / str(L)]  # fmt: skip
        code, _, err = run_cli(capsys, *argv)
        assert code == 0, err
        results = json.loads((tmp_path / str(L) / "results.json").read_text())
        model = results["model"]
        assert (model["pretraining_length"], model["trained_context"]) == (L0, C)
        assert model["original_max_position_embeddings"] == C  # the key older readers read
        assert [row["method_length"] for row in results["methods"]] == [L]


def test_no_identifier_is_named_original_length():
    """One name for each length: pretraining_length (L0), trained_context (C), method_length (L). The ambiguous
    `original_length` (it named all three) is no identifier, argument or attribute in ctxext/."""
    found = []
    for path in sorted((REPO / "ctxext").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [getattr(node, field, None) for field in ("id", "arg", "attr", "name")]
            if "original_length" in names or "model_original_length" in names:
                found.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert not found, found
    probe = ast.parse("def f(original_length): return x.original_length")
    assert sum("original_length" in (getattr(n, "arg", None), getattr(n, "attr", None)) for n in ast.walk(probe)) == 2
