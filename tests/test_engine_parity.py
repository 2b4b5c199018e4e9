"""vLLM's and SGLang's own rotary code on the checkpoints `ctxext patch` writes (benchmarks/engine_parity.py).

The engine tier (marker `engines`) runs the script's comparison on a few cases from the engines' wheels. It runs where
the wheels are already in $CTXEXT_CACHE_DIR/engines (else .cache/engines); it downloads them (about 375 MB) only
when CTXEXT_ENGINE_WHEELS=1; otherwise it skips and says so. The float factor test runs by default: it checks the
types written, and, where the wheels are cached, runs `ctxext export --check` on it with the engines importable.
"""

import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest

from ctxext.cli import main
from ctxext.verification.engine_rope import ENGINES
from tests.helpers import run_cli, save_tiny_checkpoint, tiny_model

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "engine_parity.py"


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("engine_parity", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def cached_roots(script) -> dict | None:
    """{engine: its unpacked root} when every wheel is in the cache, else None."""
    roots = {engine: script.cached_root(engine) for engine in ENGINES}
    return None if None in roots.values() else {engine: str(root) for engine, root in roots.items()}


def engine_roots(script) -> dict:
    """The cached roots; else, with CTXEXT_ENGINE_WHEELS=1, the wheels downloaded now; else a skip that says why."""
    roots = cached_roots(script)
    if roots is not None:
        return roots
    if os.environ.get("CTXEXT_ENGINE_WHEELS") != "1":
        pytest.skip(
            f"the vLLM/SGLang wheels are not in {script.cache_dir()}: set CTXEXT_ENGINE_WHEELS=1 to download them "
            f"(about 375 MB), or run benchmarks/engine_parity.py once"
        )
    try:
        return {engine: str(script.fetch_root(engine)) for engine in ENGINES}
    except RuntimeError as error:
        pytest.skip(f"the vLLM/SGLang wheels could not be fetched: {error}")


@pytest.mark.engines
def test_the_documented_levels_hold_under_the_engines_own_rotary_code(script, tmp_path):
    """A per-pair method as written (vLLM exact; SGLang off at position L only) and after `ctxext export --engine
    sglang` (both exact), and dynamic NTK served with and without the printed overrides."""
    roots = engine_roots(script)
    names = ("ntk_fixed", "ntk_fixed-sglang", "dynamic_ntk", "dynamic_ntk-no-flags")
    cases = [case for case in script.CASES if case.name in names]
    rows = {(row["case"], row["engine"]): row for row in script.run(cases, ENGINES, roots, tmp_path)}
    assert script.broken_claims(list(rows.values())) == []
    for family in script.FAMILIES:
        measured = lambda case, engine, family=family: rows[case, engine]["measured"][family]  # noqa: E731
        assert measured("ntk_fixed", "vllm")["level"] == "exact"
        as_written = measured("ntk_fixed", "sglang")
        assert as_written["level"] == "approximate" and as_written["where"].startswith(f"position {script.L} "), (
            as_written
        )
        off = {name for name, value in as_written["per_scenario"].items() if value > 1e-4}
        assert off == {"prefill of L+1 tokens", "decode at L"}  # position L with none past it in the batch, only
        assert {measured("ntk_fixed-sglang", engine)["level"] for engine in ENGINES} == {"exact"}
        assert {measured("dynamic_ntk", engine)["level"] for engine in ENGINES} == {"approximate"}
        assert measured("dynamic_ntk-no-flags", "vllm")["error"].startswith("IndexError")


@pytest.mark.engines
def test_the_composed_forms_hold_their_documented_levels_under_the_engines_own_rotary_code(script, tmp_path):
    """Llama 3.1's llama3 x8, the Qwen3 card's yarn x4, gpt-oss's yarn x32 and Phi-4-mini's longrope, each patched
    with yarn x2 (the composed longrope over the shipped L0): each export copy in its own engine measures what
    engines.py says of it (exact; Phi-4's short != long sets refused by export, and approximate with
    --allow-approximate where transformers' short set serves a request of L0 tokens), and the patched checkpoint as
    written too (SGLang off at position L0 only, vLLM's gpt_oss code failing on the beta keys it reads, vLLM refused
    by export there)."""
    roots = engine_roots(script)
    shapes = ["llama3.1", "qwen3-card", "gpt-oss", "phi4-mini"]
    rows = {
        (r["shape"], r["checkpoint"], r["engine"]): r for r in script.run_composed(shapes, ENGINES, roots, tmp_path)
    }
    assert script.composed_disagreements(list(rows.values())) == []
    level = lambda shape, checkpoint, engine: rows[shape, checkpoint, engine]["measured"]["level"]  # noqa: E731
    for shape in ("llama3.1", "qwen3-card", "gpt-oss"):
        assert level(shape, "export --engine sglang", "sglang") == "exact"
        as_written = rows[shape, "as written", "sglang"]["measured"]
        assert as_written["where"] == "position 32 (prefill of L0+1 tokens)", as_written
    for shape in ("llama3.1", "qwen3-card"):
        assert level(shape, "export --engine vllm", "vllm") == level(shape, "as written", "vllm") == "exact"
    assert rows["gpt-oss", "export --engine vllm", "vllm"]["documented"].startswith("refused: ")
    assert rows["gpt-oss", "as written", "vllm"]["measured"]["error"] == "KeyError: 'beta_fast'"
    for engine, where in (("vllm", "prefill of L0 tokens"), ("sglang", "prefill of L0+1 tokens")):
        assert "--allow-approximate" in rows["phi4-mini", f"export --engine {engine}", engine]["documented"]
        phi = rows["phi4-mini", f"export --engine {engine} --allow-approximate", engine]["measured"]
        assert phi["level"] == "approximate" and phi["where"].endswith(f"({where})"), phi


def test_linear_factor_4_is_written_as_a_float_the_engines_load(script, tmp_path, capsys, monkeypatch):
    """`ctxext patch --method linear --factor 4` writes 4.0 (vLLM's and SGLang's linear rope take an int for a list
    and fail). Where the wheels are cached (else that half is skipped), `ctxext export --check` with the engines
    importable, as on a box where they are installed, runs their loaders and rotary code on it: exact."""
    source = save_tiny_checkpoint(tmp_path / "source", tiny_model("llama"))
    out = tmp_path / "linear"
    assert main(["patch", str(source), "-o", str(out), "--method", "linear", "--factor", "4"]) == 0
    config = json.loads((out / "config.json").read_text())
    for spelling in ("rope_parameters", "rope_scaling"):
        assert type(config[spelling]["factor"]) is float and config[spelling]["factor"] == 4.0
        assert type(config[spelling]["original_max_position_embeddings"]) is int
    roots = cached_roots(script)
    if roots is None:
        pytest.skip(
            f"the written types hold; the engines' half needs the vLLM/SGLang wheels in {script.cache_dir()} "
            f"(benchmarks/engine_parity.py fetches them)"
        )
    for root in roots.values():
        monkeypatch.syspath_prepend(root)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(roots.values()))
    code, stdout, err = run_cli(capsys, "export", out, "--check", "--tokens", 32)
    assert code == 0, err
    for engine in ENGINES:
        assert f"{engine}'s own rotary code vs plain transformers (rotated q, k): exact" in stdout, stdout


FAKE_VLLM = {
    "vllm/__init__.py": "",
    "vllm/config/__init__.py": "",
    "vllm/model_executor/__init__.py": "",
    "vllm/model_executor/layers/__init__.py": "",
    "vllm/transformers_utils/__init__.py": "",
    "vllm/transformers_utils/config.py": (
        "from transformers import AutoConfig\n"
        "def get_config(path, trust_remote_code, hf_overrides_kw=None):\n"
        "    return AutoConfig.from_pretrained(path)\n"
        "def set_default_rope_theta(config, default_theta):\n"
        "    pass\n"
    ),
    "vllm/model_executor/layers/rotary_embedding/__init__.py": (
        "import os, signal\n"
        "_ROPE_DICT = {}\n"
        "class Unrotated:\n"
        "    def forward_native(self, positions, q, k):\n"
        "        return q, k\n"
        "def get_rope(head_size, max_position, rope_parameters=None, is_neox_style=True):\n"
        "    kind = rope_parameters['rope_type']\n"
        "    if kind == 'linear':\n"
        "        os.kill(os.getpid(), signal.SIGSEGV)\n"
        "    if kind == 'yarn':\n"
        "        raise ValueError('a stand-in that refuses yarn')\n"
        "    return Unrotated()\n"
    ),
}


@pytest.mark.slow  # `make test-slow`: CI's second step
def test_an_engine_that_crashes_or_raises_is_a_one_line_finding(tmp_path):
    """A stand-in vLLM package that dies with SIGSEGV on the first checkpoint, raises on the second and rotates
    nothing on the third: each is one finding, and the run goes on past the crash."""
    from ctxext.checkpoint import write_patched_checkpoint
    from ctxext.config import load_method_config
    from ctxext.verification.engine_rope import run_parity, target_for

    fake = tmp_path / "fake"
    for name, text in FAKE_VLLM.items():
        (fake / name).parent.mkdir(parents=True, exist_ok=True)
        (fake / name).write_text(text)
    source = save_tiny_checkpoint(tmp_path / "source", tiny_model("llama"))
    targets = []
    for method in ("linear", "yarn", "ntk"):
        out = tmp_path / method
        write_patched_checkpoint(str(source), load_method_config(None, {"method": method, "factor": 4.0}), out)
        targets.append(target_for(out))
    findings = run_parity(targets, ("vllm",), tmp_path / "runs", {"vllm": str(fake)})
    crashed, raised, unrotated = (findings[name]["vllm"] for name in ("linear", "yarn", "ntk"))
    assert (crashed.level, crashed.error.split(":")[0]) == ("fails", "vllm process died (SIGSEGV)")
    assert (raised.level, raised.error) == ("fails", "ValueError: a stand-in that refuses yarn")
    assert unrotated.level == "approximate" and unrotated.max_dq > 0.1
