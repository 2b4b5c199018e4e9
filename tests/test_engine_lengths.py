"""The length each engine derives from a config.json (ctxext.serving.lengths), against numbers worked by hand from the
engines' source, for the forms users have and for what `ctxext patch --factor 2` writes on each.

The hand-worked numbers (vLLM 18ec6629 `_get_and_verify_max_len`, SGLang 2aa2e2d0 `get_context_length`, llama.cpp
0024aa74 convert_hf_to_gguf.py; see the module's text):
- Llama 3.1/3.2 (llama3 x8/x32 over 8192, max_position_embeddings 131072): vLLM skips llama3's factor, SGLang too:
  131072 everywhere.
- Qwen2.5's card (yarn x4 over 32768, max_position_embeddings 32768): vLLM takes yarn's original 32768 x 4 = 131072;
  SGLang keeps max_position_embeddings (the scaling records original_max_position_embeddings): 32768, so 131072
  needs --context-length with SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1; llama.cpp's n_ctx_train is 32768, past
  which llama-server caps every slot. Qwen3 (40960): the same with 40960.
- Gemma 3 (linear x8 on the full-attention layers, 131072): vLLM skips the factor for "gemma3", SGLang sees
  parameters nested by layer type, with no top-level factor: 131072.
- gpt-oss (yarn x32 over 4096, 131072): vLLM 4096 x 32 = 131072; SGLang 131072.
- Phi-4-mini (longrope over 4096, 131072, original_max_position_embeddings 4096 at the top level too): vLLM
  derives 131072 but serves 4096 unless given --max-model-len; SGLang 131072.
After `--factor 2` (everything written as longrope with original_max_position_embeddings inside, and
max_position_embeddings 262144): 262144 everywhere, but vLLM on Phi-4-mini, which still serves 4096 unless told.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
from pathlib import Path

import pytest
from transformers import AutoConfig, AutoModelForCausalLM

from ctxext.cli import main
from ctxext.errors import CtxextError
from ctxext.serving.lengths import NAMES, READ, engine_lengths, serve_lines
from tests.family_models import build
from tests.helpers import run_cli, save_tiny_checkpoint

DOC = Path(__file__).resolve().parents[1] / "docs" / "guides" / "serving.md"
C = 131072  # every form's trained context
LLAMA3 = {
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
    "rope_type": "llama3",
}
CARD_YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
GPT_OSS_YARN = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False}
PHI4_PAIRS = 6  # the tiny model's rotated pairs: head_dim 16 x 0.75 / 2

# The forms as their config.json ships them on the hub (transformers 4.x spelling: rope_scaling + rope_theta)
SHIPPED = {
    "Llama 3.1": {
        "model_type": "llama",
        "max_position_embeddings": 131072,
        "rope_theta": 500000.0,
        "rope_scaling": {**LLAMA3, "factor": 8.0},
    },
    "Llama 3.2": {
        "model_type": "llama",
        "max_position_embeddings": 131072,
        "rope_theta": 500000.0,
        "rope_scaling": {**LLAMA3, "factor": 32.0},
    },
    "Qwen2.5 (card's yarn)": {
        "model_type": "qwen2",
        "max_position_embeddings": 32768,
        "rope_theta": 1000000.0,
        "rope_scaling": CARD_YARN,
    },
    "Qwen3 (card's yarn)": {
        "model_type": "qwen3",
        "max_position_embeddings": 40960,
        "rope_theta": 1000000.0,
        "rope_scaling": CARD_YARN,
    },
    "Gemma 3": {
        "model_type": "gemma3",
        "text_config": {
            "model_type": "gemma3_text",
            "max_position_embeddings": 131072,
            "rope_theta": 1000000.0,
            "rope_local_base_freq": 10000.0,
            "rope_scaling": {"rope_type": "linear", "factor": 8.0},
        },
    },
    "gpt-oss": {
        "model_type": "gpt_oss",
        "max_position_embeddings": 131072,
        "rope_theta": 150000.0,
        "rope_scaling": {**GPT_OSS_YARN, "original_max_position_embeddings": 4096},
    },
    "Phi-4-mini": {
        "model_type": "phi3",
        "max_position_embeddings": 131072,
        "original_max_position_embeddings": 4096,
        "partial_rotary_factor": 0.75,
        "rope_theta": 10000.0,
        "rope_scaling": {"type": "longrope", "short_factor": [1.0] * 48, "long_factor": [1.5] * 48},
    },
}
# form: (vLLM serves with no flag, vLLM's most, SGLang, llama.cpp's n_ctx_train), worked by hand (module's text)
AS_SHIPPED = {
    "Llama 3.1": (C, C, C, C),
    "Llama 3.2": (C, C, C, C),
    "Qwen2.5 (card's yarn)": (C, C, 32768, 32768),
    "Qwen3 (card's yarn)": (C, C, 40960, 40960),
    "Gemma 3": (C, C, C, C),
    "gpt-oss": (C, C, C, C),
    "Phi-4-mini": (4096, C, C, C),
}
# what to pass to serve C as shipped
TO_SERVE_C = {
    "Qwen2.5 (card's yarn)": {
        "sglang": f"SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1 --context-length {C}",
        "llama.cpp": f"--ctx-size {C} --override-kv qwen2.context_length=int:{C}",
    },
    "Qwen3 (card's yarn)": {
        "sglang": f"SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1 --context-length {C}",
        "llama.cpp": f"--ctx-size {C} --override-kv qwen3.context_length=int:{C}",
    },
    "Phi-4-mini": {"vllm": f"--max-model-len {C}"},
}
AFTER_FACTOR_2 = {form: (2 * C, 2 * C, 2 * C, 2 * C) for form in SHIPPED} | {"Phi-4-mini": (4096, 2 * C, 2 * C, 2 * C)}
TO_SERVE_2C = {"Phi-4-mini": {"vllm": f"--max-model-len {2 * C}"}}

# form: (the tiny model's family, its full-attention rope parameters, max_position_embeddings): the shipped shapes
# at their real lengths (tiny widths)
TINY = {
    "Llama 3.1": ("llama", {**LLAMA3, "factor": 8.0}, 131072),
    "Llama 3.2": ("llama", {**LLAMA3, "factor": 32.0}, 131072),
    "Qwen2.5 (card's yarn)": ("qwen2", CARD_YARN, 32768),
    "Qwen3 (card's yarn)": ("qwen3", CARD_YARN, 40960),
    "Gemma 3": ("gemma3_text", {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}, 131072),
    "gpt-oss": ("gpt_oss", {**GPT_OSS_YARN, "original_max_position_embeddings": 4096}, 131072),
    "Phi-4-mini": (
        "phi3",
        {
            "rope_type": "longrope",
            "short_factor": [1.0 + 0.05 * i for i in range(PHI4_PAIRS)],
            "long_factor": [1.0 + 6.0 * i for i in range(PHI4_PAIRS)],
            "original_max_position_embeddings": 4096,
            "partial_rotary_factor": 0.75,
        },
        131072,
    ),
}


def tiny(form: str):
    """A tiny random model of the shape `form`, with its shipped rope parameters and lengths."""
    family, rope, max_length = TINY[form]
    model, _ = build(family)
    values = model.config.to_dict()
    if family == "gemma3_text":  # per layer type: the sliding layers keep plain RoPE at base 1e4
        values["rope_parameters"]["full_attention"] = {**values["rope_parameters"]["full_attention"], **rope}
        values["rope_parameters"]["sliding_attention"]["rope_theta"] = 1e4
    else:
        values["rope_parameters"] = {**rope, "rope_theta": float(values["rope_parameters"]["rope_theta"])}
    if family == "phi3":  # Phi-3 keeps L0 and the partial rotary factor at the top level too
        values.update(original_max_position_embeddings=4096, partial_rotary_factor=0.75)
    values["max_position_embeddings"] = max_length
    config = AutoConfig.for_model(values.pop("model_type"), **values)
    return AutoModelForCausalLM.from_config(config).eval()


@pytest.fixture(scope="module")
def patched(tmp_path_factory):
    """form: (source dir, `ctxext patch --method yarn --factor 2` output dir, what patch printed)."""
    root = tmp_path_factory.mktemp("lengths")
    done = {}
    for index, form in enumerate(TINY):
        source, out = root / f"in{index}", root / f"out{index}"
        save_tiny_checkpoint(source, tiny(form))
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            code = main(["patch", str(source), "--method", "yarn", "--factor", "2", "-o", str(out)])
        assert code == 0, printed.getvalue()
        done[form] = (source, out, printed.getvalue())
    return done


def config_of(directory) -> dict:
    return json.loads((Path(directory) / "config.json").read_text())


def lengths(config: dict, target: int) -> tuple:
    """(vLLM served with no flag, vLLM's most, SGLang, llama.cpp) for `config`."""
    rows = {row.engine: row for row in engine_lengths(config, target)}
    return rows["vllm"].derived, rows["vllm"].limit, rows["sglang"].derived, rows["llama.cpp"].derived


def passes(config: dict, target: int) -> dict:
    """{engine: what to pass} for the engines that need something, but llama.cpp's --ctx-size alone."""
    rows = engine_lengths(config, target)
    return {r.engine: r.to_pass for r in rows if r.to_pass and r.to_pass != f"--ctx-size {target}"}


# ------------------------------------------------------------------------------------------------ the forms
@pytest.mark.parametrize("form", sorted(SHIPPED))
def test_the_forms_users_have_derive_the_hand_worked_lengths(form):
    assert lengths(SHIPPED[form], C) == AS_SHIPPED[form]
    assert passes(SHIPPED[form], C) == TO_SERVE_C.get(form, {})


def test_sglang_serves_qwen25_card_at_32768_and_needs_the_flag_and_the_variable_for_131072():
    """SGLang's get_context_length: factor 1 where rope_scaling records original_max_position_embeddings, so
    max_position_embeddings (32768) is all it derives, and _derive_context_length refuses a longer --context-length
    without SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1. vLLM takes yarn's original x factor."""
    rows = {row.engine: row for row in engine_lengths(SHIPPED["Qwen2.5 (card's yarn)"], C)}
    assert rows["sglang"].derived == 32768 and not rows["sglang"].reaches
    assert rows["sglang"].flags == (f"--context-length {C}",)
    assert rows["sglang"].env == ("SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1",)
    assert rows["vllm"].derived == C and rows["vllm"].reaches and rows["vllm"].flags == ()
    assert rows["transformers"].reaches  # transformers has no maximum


@pytest.mark.parametrize("form", sorted(TINY))
def test_the_tiny_sources_as_transformers_5_writes_them_derive_the_same(patched, form):
    """The same forms in transformers 5's spelling (rope_parameters, Gemma 3 nested by layer type)."""
    source, _, _ = patched[form]
    assert lengths(config_of(source), C) == AS_SHIPPED[form]


@pytest.mark.parametrize("form", sorted(TINY))
def test_what_ctxext_writes_with_factor_2_derives_2c(patched, form):
    _, out, _ = patched[form]
    config = config_of(out)
    assert config["max_position_embeddings"] == 2 * C
    assert lengths(config, 2 * C) == AFTER_FACTOR_2[form]
    assert passes(config, 2 * C) == TO_SERVE_2C.get(form, {})


@pytest.mark.parametrize("form", sorted(TINY))
def test_patch_prints_only_the_flags_each_engine_needs(patched, form):
    _, out, printed = patched[form]
    n = 2 * C
    assert f"  serve {n} tokens:" in printed
    vllm = f"  vLLM: vllm serve {out} --max-model-len {n}  (derives {n}, but serves 4096 unless told)"
    if form != "Phi-4-mini":
        vllm = f"  vLLM: vllm serve {out}  (derives {n} itself)"
    assert vllm in printed.splitlines()
    assert f"  SGLang: python -m sglang.launch_server --model-path {out}  (derives {n} itself)" in printed
    if form.startswith("Llama"):  # llama3 becomes rope_freqs in the GGUF, which `ctxext patch MODEL.gguf` extends
        assert f"  llama.cpp: llama-server -m MODEL.gguf --ctx-size {n}  (n_ctx_train {n}" in printed
    else:  # no GGUF carries the composition (or the layer types) exactly: no llama-server line (issue 63 item 4)
        assert "llama-server" not in printed and "  llama.cpp: no exact GGUF (" in printed
    assert "--hf-overrides" not in printed and "SGLANG_ALLOW" not in printed and "--override-kv" not in printed


def test_export_check_prints_the_lengths_table(patched, tmp_path, capsys):
    _, out, _ = patched["Phi-4-mini"]
    report = tmp_path / "table.json"
    code, stdout, err = run_cli(capsys, "export", out, "--check", "--tokens", 16, "--json", report)
    assert code == 0, stdout + err
    table = stdout[stdout.index("lengths (N = max_position_embeddings = 262144):") :].splitlines()
    rows = {line.split()[0]: line for line in table[2:6]}
    assert re.search(
        r"vLLM\s+4096 \(up to 262144\)\s+with flags\s+--max-model-len 262144\s+read: vLLM 18ec6629", rows["vLLM"]
    )
    assert re.search(r"SGLang\s+262144\s+yes\s+-\s+read: SGLang 2aa2e2d0", rows["SGLang"])
    assert re.search(r"llama.cpp\s+262144\s+yes\s+--ctx-size 262144\s+read: llama.cpp", rows["llama.cpp"])
    assert re.search(r"transformers\s+no maximum \(262144 written\)\s+yes", rows["transformers"])
    written = {row["engine"]: row for row in json.loads(report.read_text())["lengths"]}
    assert written["vllm"]["derived"] == 4096 and written["vllm"]["limit"] == 262144


def test_export_check_of_the_qwen_card_says_what_sglang_needs_past_max_position_embeddings(patched, capsys):
    """N is the checkpoint's max_position_embeddings: 32768 for the card's config, which every engine serves."""
    source, _, _ = patched["Qwen2.5 (card's yarn)"]
    code, stdout, err = run_cli(capsys, "export", source, "--check", "--tokens", 16)
    assert code == 0, stdout + err
    table = stdout[stdout.index("lengths (N = max_position_embeddings = 32768):") :]
    assert re.search(r"vLLM\s+131072\s+yes", table) and re.search(r"SGLang\s+32768\s+yes", table)


# --------------------------------------------------------------------------------------------- single rules
def test_vllm_past_its_limit_needs_the_override_or_cannot_serve_a_yarn():
    """Past vLLM's limit: a larger max_position_embeddings lifts it (--hf-overrides), but not under a yarn, whose
    limit is original x factor (its cos/sin cache ends there)."""
    plain = {"model_type": "llama", "max_position_embeddings": 4096, "rope_theta": 1e4}
    row = engine_lengths(plain, 8192)[1]
    assert row.derived == row.limit == 4096 and row.servable
    assert row.flags == ("--max-model-len 8192", """--hf-overrides '{"max_position_embeddings": 8192}'""")
    yarn = {**plain, "rope_scaling": {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 4096}}
    row = engine_lengths(yarn, 16384)[1]
    assert row.derived == 8192 and not row.servable and row.flags == () and "cos/sin cache ends at 8192" in row.why


def test_linear_factors_multiply_in_vllm_and_in_sglang_unless_the_original_is_recorded():
    linear = {"model_type": "llama", "max_position_embeddings": 256, "rope_scaling": {"type": "linear", "factor": 4.0}}
    assert lengths(linear, 256)[:3] == (1024, 1024, 1024)
    recorded = {
        **linear,
        "rope_parameters": {"rope_type": "linear", "factor": 4.0, "original_max_position_embeddings": 64},
    }
    assert lengths(recorded, 256)[:3] == (1024, 1024, 256)


def test_bad_input_is_one_line():
    with pytest.raises(CtxextError, match="whole number of tokens"):
        engine_lengths(SHIPPED["Llama 3.1"], 0)
    with pytest.raises(CtxextError, match="config.json dict"):
        engine_lengths("config.json", 4096)
    assert serve_lines(SHIPPED["Llama 3.1"], C, "OUT")[0] == "  vLLM: vllm serve OUT  (derives 131072 itself)"


# ---------------------------------------------------------------------------------------------- the guide's table
def doc_cells(config: dict, target: int) -> list[str]:
    """The guide's cells for one form: vLLM, SGLang, llama.cpp derive, and what to pass to serve `target`."""
    rows = {row.engine: row for row in engine_lengths(config, target)}
    vllm = rows["vllm"]
    derived = [f"{vllm.derived} (up to {vllm.limit})" if vllm.limit > vllm.derived else str(vllm.derived)]
    derived += [str(rows["sglang"].derived), str(rows["llama.cpp"].derived)]
    told = [f"{NAMES[e]}: `{rows[e].to_pass}`" for e in ("vllm", "sglang", "llama.cpp") if rows[e].to_pass]
    return [*derived, "; ".join(told) or "nothing", "read: " + ", ".join(READ.values())]


def doc_table(heading: str) -> dict:
    """{form: cells after the first two} of the markdown table under `heading` in docs/guides/serving.md."""
    text = DOC.read_text()
    lines = text[text.index(heading) :].splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| form"))
    table = {}
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        cells = [cell.strip() for cell in line.strip().strip("|").split(" | ")]
        table[cells[0]] = cells[2:]
    return table


def test_the_guides_table_of_the_forms_as_shipped_is_what_lengths_derives():
    assert doc_table("### As shipped") == {form: doc_cells(config, C) for form, config in SHIPPED.items()}


def test_the_guides_table_after_factor_2_is_what_lengths_derives(patched):
    expected = {form: doc_cells(config_of(out), 2 * C) for form, (_, out, _) in patched.items()}
    assert doc_table("### After `ctxext patch --factor 2`") == expected
