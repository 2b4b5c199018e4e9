"""scripts/device: the gate that stops a device run whose rebuilt weights differ from here (weights_digest.py),
the needle sweep of the comparison page (needle_sweep.py), and the CPU half of the GPU queue (cells.sh): its
steps in priority order within DEADLINE, each cell written to the cache copies that come back, and a second
run that resumes without computing anything again."""

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from tests.helpers import save_smollm2_llama

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


QUEUE = SCRIPT.with_name("cells.sh")
REPO = SCRIPT.parents[2]


def queue_env(tmp_path, model, **extra) -> dict:
    """cells.sh on the CPU: no GPU setup, the caches under tmp_path, lengths a tiny model answers in seconds."""
    env = {
        **os.environ,
        "SETUP": "0",
        "DEVICE": "cpu",
        "DTYPE": "fp32",
        "PY": sys.executable,
        "MODEL": str(model),
        "ROOT": str(tmp_path / "root"),
        "CMP_DIR": str(tmp_path / "cmp"),
        "WORK": str(tmp_path / "work"),
        "OUT": str(tmp_path / "out"),
        "OMP_NUM_THREADS": "1",
        "N16": "1024",
        "N8": "1024",
        "N32": "1024",
        "LIMIT": "1",
        "SAMPLE_TOKENS": "4",
        "SEARCH_METHODS": "dpe",  # its needle-ppl row has 32k parameters on the page: needle32 runs, no search
        **extra,
    }
    (tmp_path / "out").mkdir(exist_ok=True)
    return env


def run_queue(env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(QUEUE)], cwd=REPO, env=env, capture_output=True, text=True, timeout=3600)


def test_the_queue_skips_what_its_deadline_leaves_no_time_for_and_still_sends_the_caches_back(tmp_path):
    """Every step of the default queue, in priority order, is skipped when DEADLINE leaves under 30 s; the
    committed caches still come back whole in cells.tar. An unknown step is exit 2 before any step runs."""
    done = run_queue(queue_env(tmp_path, tmp_path / "no-model", DEADLINE="10"))
    assert done.returncode == 0, done.stderr
    skipped = [line.split()[1].rstrip(":") for line in done.stdout.splitlines() if line.startswith("skipped")]
    assert skipped == ["needle128", "ppl128", "needle32", "decode64"]  # rows32: the page has dpe's 32k row
    with tarfile.open(tmp_path / "out" / "cells.tar") as tar:
        names = {Path(n).as_posix().removeprefix("./") for n in tar.getnames()}
    committed = {p.relative_to(REPO / "benchmarks").as_posix() for p in (REPO / "benchmarks").glob("*_cells/**/*")}
    assert committed <= names
    wrong = run_queue(queue_env(tmp_path, tmp_path / "no-model", CELLS="needle128 nonsense"))
    assert wrong.returncode == 2 and "unknown step 'nonsense'" in wrong.stdout and "===" not in wrong.stdout


@pytest.fixture(scope="module")
def tiny_ruler_model(tmp_path_factory, smollm2_path):
    """A random 2-layer LLaMA with SmolLM2's tokenizer (RULER sizes its prompts with it), L = 512 (STRING's defaults need L > 388): at the
    queue's 1024 tokens the remapping methods run past their first region."""
    pytest.importorskip("lm_eval")  # the queue's `ctxext tasks` steps
    return save_smollm2_llama(tmp_path_factory.mktemp("queue-tiny"), smollm2_path, 512)


def cache_files(root: Path) -> dict:
    """Every file of the cache copies the queue extends, with its modification time."""
    return {p.relative_to(root).as_posix(): p.stat().st_mtime_ns for p in root.rglob("*") if p.is_file()}


@pytest.mark.slow  # real processes: two runs of the whole queue (lm-eval's task index in each `ctxext tasks`)
def test_the_queue_writes_every_cell_to_the_caches_and_a_second_run_resumes_without_computing_again(
    tmp_path, tiny_ruler_model
):
    """The default queue on the CPU at 1024 tokens (a tiny model): the 16x needle cells (one per method of
    moonshot128.yaml), the perplexity cells (native and each method), issue 24's 32k needle row and the
    decode cells land in the cache copies, and in cells.tar, laid out as benchmarks/ is. A second run computes
    nothing: every step finds its cells cached and no cache file is written again."""
    env = queue_env(tmp_path, tiny_ruler_model, DEADLINE="3000")  # no step cut short, even on a busy machine
    first = run_queue(env)
    assert first.returncode == 0, first.stdout + first.stderr
    assert "skipped" not in first.stdout, first.stdout
    order = [line.split()[1] for line in first.stdout.splitlines() if line.startswith("=== ")]
    assert order[:-1] == ["needle128", "ppl128", "needle32", "decode64", "sample64"], first.stdout
    root = tmp_path / "root"
    before = cache_files(root)
    committed = {p.relative_to(REPO / "benchmarks").as_posix() for p in (REPO / "benchmarks").rglob("*")}
    new = set(before) - committed - {".seeded"}  # the marker of a seeded ROOT stays on the machine

    def keys(folder):  # the keys of the cells this run added to a `ctxext tasks` cache
        return [
            json.loads((root / n).read_text())["key"]
            for n in sorted(new)
            if n.startswith(folder + "/") and n.endswith(".json")
        ]

    needles = [k for k in keys("moonshot_cells/tasks") if k["length"] == 1024]
    assert sorted(k["method"]["method"] for k in needles) == ["dpe", "dual_chunk", "gali", "self_extend"]
    assert {k["device"] for k in needles} == {"cpu"} and {k["limit"] for k in needles} == {1}
    assert [k["method"]["method"] for k in keys("needle_cells/tasks")] == ["dpe"]  # the page's 32k parameters
    ppl = json.loads((root / "moonshot_cells" / "quality_16x" / "cells.json").read_text())
    ppl = [cell for key, cell in ppl.items() if " @ 1024 on " in key]
    assert sorted(cell["method"]["method"] for cell in ppl) == ["dpe", "dual_chunk", "gali", "none", "self_extend"]
    decode = [json.loads((root / n).read_text()) for n in sorted(new) if n.startswith("moonshot_cells/decode/")]
    steps = sorted(d["key"]["variant"] for d in decode if "steps" in d["key"])
    assert steps == sorted(
        ["sdpa", "rerope", "leaky_rerope", "self_extend", "dual_chunk", "string", "dpe", "dpe_searched", "gali"]
    )
    samples = [d for d in decode if "sample_tokens" in d["key"]]
    assert sorted(d["key"]["variant"] for d in samples) == ["dpe_searched", "sdpa"]
    assert all(d["result"]["seconds"]["total"] > 0 for d in samples)
    assert len(list((tmp_path / "out" / "profiles").glob("profile_*.txt"))) == 9
    with tarfile.open(tmp_path / "out" / "cells.tar") as tar:
        sent = {Path(n).as_posix().removeprefix("./") for n in tar.getnames()}
    assert new <= sent

    second = run_queue(env)
    assert second.returncode == 0, second.stdout + second.stderr
    assert cache_files(root) == before  # nothing computed again, nothing rewritten
    assert "round 1:" not in second.stdout  # remap_decode measured nothing (it prints each round it measures)
