"""`ctxext export`: the engine table, its parity checks (which must be able to fail), and the copies it writes."""

import json

import pytest
import yaml

from ctxext.checkpoint import write_patched_checkpoint
from ctxext.config import load_method_config
from tests.conftest import save_tiny_checkpoint, tiny_model
from tests.test_search import run_cli
from tests.test_serving_forms import load_in_plain_transformers


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


def test_a_native_checkpoint_is_exact_everywhere_and_checked_in_plain_transformers(tmp_path, capsys):
    model = patched(tmp_path, "llama", "ntk_mixed", "ntk_mixed", factor=4.0)
    code, rows, _, err = table(tmp_path, capsys, model, "--check", "--tokens", 100)
    assert code == 0, err
    assert {e: r["level"] for e, r in rows.items()} == {
        "transformers": "exact",
        "vllm": "exact",
        "sglang": "exact",
        "llama.cpp": "exact",
    }
    assert "max |logit diff|" in rows["transformers"]["checked"] and "DISAGREES" not in rows["transformers"]["checked"]
    assert "rope_freqs" in rows["llama.cpp"]["how"]


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
            {"transformers": "exact", "vllm": "exact", "sglang": "exact", "llama.cpp": "no"},
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
    code, rows, _, err = table(tmp_path, capsys, model, "--engine", "sglang", "-o", out)
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
