"""`ctxext check` on the CPU: every method agrees with the per-cell reference under every implementation here,
a broken backend is caught (exit 1), and bad input is one line with exit 2."""

import json

import pytest

from ctxext.cli import main
from ctxext.patching import remap_kernel
from tests.helpers import tiny_config


@pytest.fixture(scope="module")
def tiny_shape(tmp_path_factory):
    path = tmp_path_factory.mktemp("shape") / "config.json"
    tiny_config("qwen3", num_attention_heads=4, num_key_value_heads=2, head_dim=16).to_json_file(path)
    return path


def run_check(capsys, *flags):
    code = main(["check", "--device", "cpu", *flags])
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.slow  # `make test-slow`: CI's second step
def test_every_method_agrees_under_every_cpu_implementation(tiny_shape, tmp_path, capsys):
    code, out, _ = run_check(
        capsys, "--model", str(tiny_shape), "--lengths", "256", "--repeats", "1", "--json", str(tmp_path / "check.json")
    )
    assert code == 0, out
    result = json.loads((tmp_path / "check.json").read_text())
    cases = {(row["implementation"], row["method"]) for row in result["agreement"]}
    assert cases == {
        (i, m)
        for i in ("eager", "sdpa", "flex_attention")
        for m in ("rerope", "leaky_rerope", "self_extend", "dual_chunk", "string", "dpe", "gali", "logn")
    }
    for row in result["agreement"]:
        assert row["ok"] and row["forward_error"] < 1e-4
        if row["method"] != "logn":  # the remapping ones run ctxext's backends: lse to infer, blockwise to train
            assert (row["backend"], row["backward_backend"]) == ("lse", "blockwise")
            assert row["backward_error"] < 1e-4
        assert row["decode_error"] < 1e-4
    assert [row["method"] for row in result["cost"]][0] == "native"
    assert all(row["seconds"] > 0 and row["x_native_time"] > 0 for row in result["cost"])
    assert "all methods agree" in out and "DISAGREES" not in out


def test_a_wrong_backend_is_caught(tiny_shape, capsys, monkeypatch):
    def drops_the_last_region(queries, keys, value, plan, scale):
        plan.key_hi[-1] = plan.key_lo[-1]  # as if the farthest keys were forgotten
        return remap_kernel.naive_backend(queries, keys, value, plan, scale)

    monkeypatch.setitem(remap_kernel.REMAP_BACKENDS, "lse", drops_the_last_region)
    code, out, _ = run_check(
        capsys, "--model", str(tiny_shape), "--lengths", "", "--method", "dual_chunk,logn", "--implementations", "sdpa"
    )
    assert code == 1
    assert "DISAGREEMENT: dual_chunk under sdpa" in out
    assert "logn" not in out.split("DISAGREEMENT")[1]  # log-n does not use the backend


def test_a_backend_wrong_only_when_decoding_is_caught(tiny_shape, tmp_path, capsys, monkeypatch):
    right = remap_kernel.REMAP_BACKENDS["lse"]

    def forgets_far_keys_in_decode(queries, keys, value, plan, scale):
        if plan.q_len == 1:  # a decode step through the cache; the prefill stays right
            plan.key_hi[-1] = plan.key_lo[-1]
        return right(queries, keys, value, plan, scale)

    monkeypatch.setitem(remap_kernel.REMAP_BACKENDS, "lse", forgets_far_keys_in_decode)
    code, out, _ = run_check(
        capsys,
        "--model",
        str(tiny_shape),
        "--lengths",
        "",
        "--method",
        "rerope",
        "--implementations",
        "sdpa",
        "--json",
        str(tmp_path / "check.json"),
    )
    (row,) = json.loads((tmp_path / "check.json").read_text())["agreement"]
    assert code == 1 and "DISAGREEMENT: rerope under sdpa" in out
    assert row["forward_error"] < 1e-4 and row["decode_error"] > 1e-3


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--method", "yarn"], "unknown method(s) yarn for ctxext check"),
        (["--implementations", "flash_attention_2"], "not available on cpu"),
        (["--lengths", "100"], "at least 256 tokens"),
        (["--layers", "0"], "--layers and --repeats must be >= 1"),
        (["--model", "/nonexistent/model"], "/nonexistent/model"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(tiny_shape, capsys, flags, message):
    code, out, err = run_check(capsys, "--model", str(tiny_shape), *flags)
    assert code == 2
    assert message in err and len(err.strip().splitlines()) == 1


def test_a_model_without_rope_is_refused(tmp_path, capsys):
    from transformers import GPT2Config

    GPT2Config(n_layer=1).to_json_file(tmp_path / "config.json")
    code, _, err = run_check(capsys, "--model", str(tmp_path / "config.json"))
    assert code == 2 and "has no rotary position embedding (RoPE)" in err


def test_smollm2_shape_passes(smollm2_path, capsys):
    code, out, _ = run_check(
        capsys,
        "--model",
        str(smollm2_path),
        "--lengths",
        "",
        "--method",
        "dual_chunk,leaky_rerope",
        "--implementations",
        "sdpa",
    )
    assert code == 0, out
    assert "'head_dim': 64" in out and "'num_attention_heads': 9" in out


def test_the_help_names_the_methods_that_are_checked_by_default():
    """The CLI spells the default list out (it must not import torch for --help); it must not drift from
    the cases `ctxext check` runs."""
    import argparse
    import re

    from ctxext.cli import check as check_cli
    from ctxext.verification.check import AGREEMENT_CASES, COST_CASES, CheckOptions

    parser = argparse.ArgumentParser()
    check_cli.add_arguments(parser)
    methods_help = next(a.help for a in parser._actions if "--method" in a.option_strings)
    listed_in_help = re.search(r"default: ([\w,]+)\)", methods_help).group(1).split(",")
    listed_in_description = re.search(r"each method \(([\w, ]+)\)", check_cli.DESCRIPTION).group(1).split(", ")
    assert listed_in_help == listed_in_description == list(AGREEMENT_CASES) == list(COST_CASES)
    assert CheckOptions().methods == list(AGREEMENT_CASES)


@pytest.mark.slow  # `make test-slow`: CI's second step
@pytest.mark.parametrize("family", ["gemma3_text", "phi"])
def test_a_sliding_window_and_a_partial_rotary_family_agree(family, tmp_path, capsys):
    """Gemma 3 (one set of frequencies per layer type, sliding layers) and Phi (partial rotary): the check's
    per-cell reference reads the family's own rotary; every method it runs agrees."""
    from tests.family_models import build

    model, _ = build(family)
    model.config.save_pretrained(tmp_path / family)
    flags = ["--model", str(tmp_path / family), "--method", "self_extend,logn", "--implementations", "sdpa"]
    code, out, err = run_check(capsys, *flags, "--lengths", "256", "--json", str(tmp_path / "check.json"))
    assert code == 0, err
    rows = json.loads((tmp_path / "check.json").read_text())["agreement"]
    assert {row["method"] for row in rows} == {"self_extend", "logn"}
    assert all(row["ok"] for row in rows), rows


def test_dash_o_writes_the_json_and_the_printed_tables_and_refuses_a_used_directory(tiny_shape, tmp_path, capsys):
    out = tmp_path / "out"
    flags = ["--model", str(tiny_shape), "--lengths", "", "--method", "logn", "--implementations", "sdpa"]
    code, printed, _ = run_check(capsys, *flags, "--json", str(tmp_path / "check.json"), "-o", str(out))
    assert code == 0
    assert json.loads((out / "results.json").read_text()) == json.loads((tmp_path / "check.json").read_text())
    assert "agreement with the per-cell reference" in (out / "tables.txt").read_text() and "logn" in printed
    code, _, err = run_check(capsys, *flags, "-o", str(out))
    assert code == 2 and err.count("\n") == 1
