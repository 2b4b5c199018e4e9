"""scripts/device/weights_digest.py: the gate that stops a device run whose rebuilt weights differ from here."""

import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "device" / "weights_digest.py"


def digest(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True)


def test_check_passes_on_the_same_weights_and_fails_on_one_changed_bit(tmp_path):
    weights = {"a": torch.randn(4, 3), "b": torch.arange(6, dtype=torch.float32)}
    save_file(weights, tmp_path / "here.safetensors")
    assert digest("write", str(tmp_path / "here.safetensors"), str(tmp_path / "ref.json")).returncode == 0

    save_file({k: v.clone() for k, v in weights.items()}, tmp_path / "same.safetensors")
    same = digest("check", str(tmp_path / "same.safetensors"), str(tmp_path / "ref.json"))
    assert same.returncode == 0 and "2 of 2" in same.stdout

    changed = weights["a"].clone()
    changed.view(torch.int32)[0, 0] ^= 1  # the lowest mantissa bit of one value
    save_file({"a": changed, "b": weights["b"]}, tmp_path / "changed.safetensors")
    differs = digest("check", str(tmp_path / "changed.safetensors"), str(tmp_path / "ref.json"))
    assert differs.returncode == 1 and "1 of 2" in differs.stdout

    save_file({**weights, "extra": torch.zeros(1)}, tmp_path / "extra.safetensors")
    assert digest("check", str(tmp_path / "extra.safetensors"), str(tmp_path / "ref.json")).returncode == 1


def test_the_needle_sweep_holds_the_page_parameters_and_ctxext_tasks_reads_them_back(tmp_path):
    """scripts/device/needle_sweep.py on the committed page: the needle rows with parameters at 32k (dpe's at
    least) go in, those without are named on stderr; the sweep it writes is read back by `ctxext tasks --config` as exactly the page's configs."""
    import json

    from ctxext.eval.rows import MethodSelection

    script = SCRIPT.with_name("needle_sweep.py")
    page = json.loads((SCRIPT.parents[2] / "docs" / "comparison.json").read_text())
    needle = [r for r in page["rows"] if r.get("objective") == "needle-ppl" or r["kind"] == "needle"]
    rows = [r for r in needle if r["method"] in ("dpe", "leaky_rerope")]
    expected = [r["configs"]["32768"] for r in rows if r["configs"].get("32768") is not None]
    run = lambda *a: subprocess.run([sys.executable, str(script), *a], capture_output=True, text=True)  # noqa: E731
    out = tmp_path / "sweep.yaml"
    done = run(str(SCRIPT.parents[2] / "docs" / "comparison.json"), "32768", "dpe,leaky_rerope", str(out))
    assert done.returncode == 0, done.stderr
    assert MethodSelection(config=str(out)).mappings() == expected != []  # dpe's, at least
    unfinished = [r["label"] for r in rows if r["configs"].get("32768") is None]
    assert [line.split(": ")[1].split(" has")[0] for line in done.stderr.splitlines()] == unfinished
    none = run(str(SCRIPT.parents[2] / "docs" / "comparison.json"), "32768", "no_such_method", str(tmp_path / "x"))
    assert none.returncode == 1 and not (tmp_path / "x").exists()
