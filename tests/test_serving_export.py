"""`ctxext export`: the engine table, its parity checks (which must be able to fail), and the copies it writes."""

import json
import math

import pytest
import yaml

from ctxext.checkpoint import write_patched_checkpoint
from ctxext.config import load_method_config
from tests.helpers import load_in_plain_transformers, run_cli, save_tiny_checkpoint, tiny_model


def patched(tmp_path, family, name, method, format="native", **params):
    source = tmp_path / f"source-{family}"
    if not source.exists():
        save_tiny_checkpoint(source, tiny_model(family, seed=4))
    out = tmp_path / name
    write_patched_checkpoint(str(source), load_method_config(None, {"method": method, **params}), out, format=format)
    return out


def table(tmp_path, capsys, model, *flags):
    report = tmp_path / f"{model.name}.json"
    code, stdout, err = run_cli(capsys, "export", model, "--json", report, *flags)
    rows = {r["engine"]: r for r in json.loads(report.read_text())["engines"]} if report.exists() else {}
    return code, rows, stdout, err


def test_a_native_checkpoint_is_exact_but_on_sglang_at_l_and_checked_in_plain_transformers(tmp_path, capsys):
    """A per-pair method is written as longrope with equal factor sets: exact in transformers, vLLM and llama.cpp;
    SGLang rotates position L as position 0 when nothing past L is in its batch (benchmarks/engine_parity.py)."""
    model = patched(tmp_path, "llama", "ntk_mixed", "ntk_mixed", factor=4.0)
    code, rows, _, err = table(tmp_path, capsys, model, "--check", "--tokens", 100)
    assert code == 0, err
    assert {e: r["level"] for e, r in rows.items()} == {
        "transformers": "exact",
        "vllm": "exact",
        "sglang": "approximate",
        "llama.cpp": "exact",
    }
    assert "max |logit diff|" in rows["transformers"]["checked"] and "DISAGREES" not in rows["transformers"]["checked"]
    assert "rope_freqs" in rows["llama.cpp"]["how"]
    assert "position L = 64" in rows["sglang"]["how"] and "--engine sglang -o OUT" in rows["sglang"]["how"]
    assert "--max-model-len 256" in rows["vllm"]["how"]
    for engine in ("vllm", "sglang"):  # where the engine is not installed, its own rotary code cannot run here
        checked = rows[engine]["checked"]
        assert checked.startswith("not run: ") or "own rotary code" in checked, checked


@pytest.mark.parametrize(
    "method,params",
    [
        ("ntk_by_parts", {"factor": 4.0}),
        ("longrope", {"factor": 4.0, "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.2, 4.0]}),  # no attention factor
    ],
)
def test_engine_sglang_moves_the_longrope_switch_past_the_served_length(tmp_path, capsys, method, params):
    """With equal factor sets the switch only matters to SGLang, which rotates the position it switches at as position
    0: the copy switches at 4L instead, with the attention factor written as transformers computes it from L, and
    plain transformers' load of the copy still equals ctxext.patch (the --check)."""
    if method == "longrope":
        params = {**params, "long_factor": params["short_factor"]}
    model = patched(tmp_path, "qwen2", method, method, **params)
    out = tmp_path / "for-sglang"
    code, rows, stdout, err = table(tmp_path, capsys, model, "--engine", "sglang", "-o", out, "--check", "--tokens", 80)
    assert code == 0, err
    rope = json.loads((out / "config.json").read_text())["rope_parameters"]
    written = json.loads((model / "config.json").read_text())["rope_parameters"]
    assert rope["original_max_position_embeddings"] == 256 and written["original_max_position_embeddings"] == 64
    assert rope["short_factor"] == rope["long_factor"] == written["short_factor"]
    assert rope["short_mscale"] == rope["long_mscale"] == rope["attention_factor"]
    if method == "longrope":  # transformers' default from L: sqrt(1 + ln 4 / ln 64)
        assert rope["attention_factor"] == pytest.approx((1 + math.log(4) / math.log(64)) ** 0.5)
    assert rows["sglang"]["level"] == rows["vllm"]["level"] == "exact"
    assert "DISAGREES" not in rows["transformers"]["checked"] and "max |logit diff|" in rows["transformers"]["checked"]
    assert "switch moved from L = 64 to 256" in stdout


def test_an_integer_linear_factor_is_refused_by_the_engines_until_exported(tmp_path, capsys):
    """vLLM's and SGLang's linear rope take an integer factor for a list ('int' object is not iterable)."""
    model = patched(tmp_path, "llama", "linear", "linear", factor=4.0)
    config = json.loads((model / "config.json").read_text())
    for spelling in ("rope_parameters", "rope_scaling"):
        config[spelling]["factor"] = 4
    (model / "config.json").write_text(json.dumps(config))
    code, rows, _, err = table(tmp_path, capsys, model)
    assert code == 0, err
    assert rows["vllm"]["level"] == rows["sglang"]["level"] == "no" and "integer 4" in rows["vllm"]["how"]
    out = tmp_path / "for-vllm"
    code, rows, _, err = table(tmp_path, capsys, model, "--engine", "vllm", "-o", out)
    assert code == 0, err
    assert json.loads((out / "config.json").read_text())["rope_parameters"]["factor"] == 4.0
    assert rows["vllm"]["level"] == "exact"


def test_dynamic_ntk_prints_how_to_serve_it_past_l(tmp_path, capsys):
    """config.json keeps max_position_embeddings = L (transformers' 'dynamic' scales from it): vLLM's cos/sin cache
    ends there and SGLang's context too, so the table prints the overrides; vLLM reads max_trained_positions."""
    model = patched(tmp_path, "llama", "dynamic", "dynamic_ntk", factor=4.0)
    code, rows, _, err = table(tmp_path, capsys, model)
    assert code == 0, err
    assert """--max-model-len 256 --hf-overrides '{"max_position_embeddings": 256}'""" in rows["vllm"]["how"]
    assert "--context-length 256" in rows["sglang"]["how"]
    assert "SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1" in rows["sglang"]["how"]
    config = json.loads((model / "config.json").read_text())
    del config["rope_parameters"]["max_trained_positions"]  # as ctxext wrote it before
    (model / "config.json").write_text(json.dumps(config))
    code, rows, _, err = table(tmp_path, capsys, model)
    assert rows["vllm"]["level"] == "no" and "max_trained_positions" in rows["vllm"]["how"]
    assert rows["sglang"]["level"] == "approximate"


def test_the_parity_check_fails_when_the_written_config_is_wrong(tmp_path, capsys):
    model = patched(tmp_path, "qwen2", "tampered", "ntk_by_parts", factor=4.0)
    config = json.loads((model / "config.json").read_text())
    for spelling in ("rope_parameters", "rope_scaling"):  # transformers 5.24 reads rope_scaling when both are there
        config[spelling]["long_factor"][0] *= 1.5  # the fastest pair
        config[spelling]["short_factor"][0] *= 1.5
    (model / "config.json").write_text(json.dumps(config))
    code, rows, _, _ = table(tmp_path, capsys, model, "--check", "--tokens", 100)
    assert code == 1 and rows["transformers"]["checked"].endswith("DISAGREES")


@pytest.mark.parametrize(
    "method,params,family,expected",
    [
        (
            "ntk_mixed",
            {"factor": 4.0, "format": "ctxext"},
            "llama",
            {"transformers": "no", "vllm": "no", "sglang": "no", "llama.cpp": "exact"},
        ),
        (
            "dynamic_yarn",
            {"factor": 4.0},
            "mistral",
            {"transformers": "no", "vllm": "no", "sglang": "no", "llama.cpp": "no"},
        ),
        (
            "dynamic_ntk",
            {"factor": 2.0},
            "llama",
            {"transformers": "exact", "vllm": "approximate", "sglang": "approximate", "llama.cpp": "no"},
        ),
        (
            "ntk_by_parts",
            {"factor": 4.0},
            "qwen3",
            {"transformers": "exact", "vllm": "exact", "sglang": "approximate", "llama.cpp": "no"},
        ),
        (
            "longrope",
            {"factor": 4.0},  # short 1, long 4: each engine switches differently from transformers
            "llama",
            {"transformers": "exact", "vllm": "approximate", "sglang": "approximate", "llama.cpp": "no"},
        ),
        (
            "yarn",
            {"factor": 4.0},
            "qwen2",
            {"transformers": "exact", "vllm": "exact", "sglang": "exact", "llama.cpp": "exact"},
        ),
        ("self_extend", {}, "llama", {"transformers": "no", "vllm": "no", "sglang": "no", "llama.cpp": "approximate"}),
        ("dual_chunk", {}, "qwen2", {"transformers": "no", "vllm": "no", "sglang": "approximate", "llama.cpp": "no"}),
        ("rerope", {}, "llama", {"transformers": "no", "vllm": "no", "sglang": "no", "llama.cpp": "no"}),
    ],
)
def test_the_table_says_which_engine_serves_what(tmp_path, capsys, method, params, family, expected):
    params = dict(params)
    model = patched(tmp_path, family, method, method, format=params.pop("format", "native"), **params)
    code, rows, _, err = table(tmp_path, capsys, model)
    assert code == 0, err
    assert {e: r["level"] for e, r in rows.items()} == expected
    if method == "rerope":
        assert "ctxext.patch" in rows["vllm"]["how"]
    if method == "self_extend":
        assert "--grp-attn-n 4 --grp-attn-w 1024" in rows["llama.cpp"]["how"]
    if family == "qwen3" and method == "ntk_by_parts":
        assert "only for the llama architecture" in rows["llama.cpp"]["how"]


def test_engine_vllm_rewrites_a_ctxext_format_checkpoint_in_its_native_form(tmp_path, capsys):
    model = patched(tmp_path, "mistral", "old", "ntk_fixed", format="ctxext", factor=4.0)
    out = tmp_path / "for-vllm"
    code, rows, stdout, err = table(tmp_path, capsys, model, "--engine", "vllm", "-o", out, "--check", "--tokens", 64)
    assert code == 0, err
    config = json.loads((out / "config.json").read_text())
    assert config["rope_parameters"]["rope_type"] == "longrope" == config["rope_scaling"]["rope_type"]
    assert config["rope_parameters"]["short_mscale"] == config["rope_parameters"]["attention_factor"] == 1.0
    assert rows["vllm"]["level"] == "exact" and "DISAGREES" not in rows["transformers"]["checked"]
    assert json.loads((model / "config.json").read_text())["rope_parameters"]["rope_type"] == "ctxext_ntk_fixed"
    load_in_plain_transformers(tmp_path, [out])  # and a process without ctxext loads it


def test_engine_sglang_writes_the_dual_chunk_config_for_qwen2(tmp_path, capsys):
    model = patched(tmp_path, "qwen2", "dca", "dual_chunk", chunk_size=48, local_window=8)
    out = tmp_path / "for-sglang"
    code, _, err = run_cli(capsys, "export", model, "--engine", "sglang", "-o", out)
    assert code == 2 and "only an approximate one" in err and "--allow-approximate" in err and not out.exists()
    code, rows, _, err = table(tmp_path, capsys, model, "--engine", "sglang", "--allow-approximate", "-o", out)
    assert code == 0, err
    config = json.loads((out / "config.json").read_text())
    assert config["dual_chunk_attention_config"] == {
        "chunk_size": 48,
        "local_size": 8,
        "original_max_position_embeddings": 64,
    }
    assert config["rope_parameters"]["rope_type"] == "default" and config["rope_scaling"] is None
    assert rows["sglang"]["level"] == "approximate" and "0.1 ln(len/L) + 1" in rows["sglang"]["how"]
    assert yaml.safe_load((out / "ctxext.yaml").read_text())["exported_for"] == "sglang"


@pytest.mark.parametrize(
    "case,message",
    [
        ("no_exact_form", "vllm cannot serve dual_chunk exactly: .*possible: --engine sglang on a Qwen2-family model"),
        ("logn", "no serving engine runs log-n scaling"),
        ("engine_without_output", "--engine and -o go together"),
        ("llama_cpp_from_a_checkpoint", "convert_hf_to_gguf.py"),
        ("over_input", "overlaps the input"),
        ("not_a_model", "neither a checkpoint directory"),
    ],
)
def test_bad_export_input_is_one_line_exit_2_and_writes_nothing(tmp_path, capsys, case, message):
    import re

    method, params = ("dual_chunk", {}) if case == "no_exact_form" else ("yarn", {"factor": 2.0})
    if case == "logn":
        params["logn"] = True
    model = patched(tmp_path, "qwen2", "model", method, **params)
    out = tmp_path / "out"
    flags = {
        "engine_without_output": ["--engine", "vllm"],
        "llama_cpp_from_a_checkpoint": ["--engine", "llama.cpp", "-o", out],
        "over_input": ["--engine", "vllm", "-o", model],
    }.get(case, ["--engine", "vllm", "-o", out])
    target = tmp_path / "nothing-here" if case == "not_a_model" else model
    before = sorted(p.name for p in tmp_path.iterdir())
    capsys.readouterr()  # what building the model printed
    code, stdout, err = run_cli(capsys, "export", target, *flags)
    assert code == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert re.search(message, err), err
    assert sorted(p.name for p in tmp_path.iterdir()) == before
