"""`ctxext compare` (ctxext.compare): the ranking rule on constructed rows, the engine support it reads, and end to
end on tiny random models of two families: the recommendation follows the numbers, --write-best, resume after a
kill, and bad input."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ctxext.compare import CompareRequest, RowNumbers, needle_tier, rank_rows, recommend, run_compare
from ctxext.compare.ranking import mean_ratio
from ctxext.compare.searches import better_half, fit_trials, rung_trials
from ctxext.eval.setup import DataOptions, RuntimeOptions
from tests.conftest import save_tiny_checkpoint, tiny_model

REPO = Path(__file__).resolve().parents[1]
METHODS = "yarn,rerope,self_extend"  # a frequency method vLLM serves, and two it does not


# ------------------------------------------------------------------------------------- ranking, pure
def row(label, ratios, passkey, vllm=True, llama_cpp=True, prefill=None):
    return RowNumbers(
        label,
        dict(enumerate(ratios, start=1)),
        dict(enumerate(passkey, start=1)),
        {"ctxext": True, "vllm": vllm, "sglang": vllm, "llama.cpp": llama_cpp},
        prefill,
    )


def test_a_row_that_loses_the_needle_never_ranks_above_one_that_keeps_it():
    keeps = row("keeps", [1.02, 1.05], [(3, 3), (3, 3)])
    loses = row("loses", [1.02, 1.05], [(3, 3), (0, 3)])  # equal perplexity, needle lost at the longer length
    loses_better_ppl = row("loses, lower ppl", [0.99, 1.00], [(0, 3), (0, 3)])
    sometimes = row("sometimes", [1.00, 1.01], [(1, 3), (2, 3)])
    ranked = [r.label for r in rank_rows([loses_better_ppl, loses, sometimes, keeps], baseline_accuracy=1.0)]
    assert ranked == ["keeps", "sometimes", "loses, lower ppl", "loses"]
    assert recommend([loses, keeps], 1.0, ["ctxext"])["ctxext"].label == "keeps"
    unpatched = RowNumbers("none", {1: 0.9, 2: 0.9}, {1: (3, 3), 2: (3, 3)}, {"ctxext": True}, candidate=False)
    assert rank_rows([keeps, unpatched], 1.0)[0].label == "none"  # ranked as the reference ...
    assert recommend([keeps, unpatched], 1.0, ["ctxext"])["ctxext"].label == "keeps"  # ... never recommended


def test_within_a_tier_the_lower_mean_ratio_then_the_cheaper_row_wins():
    a = row("a", [1.10, 1.00], [(3, 3), (3, 3)], prefill=1.5)  # geometric mean 1.0488
    b = row("b", [1.04, 1.06], [(3, 3), (3, 3)], prefill=1.0)  # 1.0500
    c = row("c", [1.10, 1.00], [(3, 3), (3, 3)], prefill=1.2)  # a's ratios, cheaper
    assert mean_ratio(a.ratios) < mean_ratio(b.ratios)
    assert [r.label for r in rank_rows([b, a, c], 1.0)] == ["c", "a", "b"]


def test_the_needle_tier_is_relative_to_the_unpatched_model_inside_its_window():
    two_of_three = {1: (2, 3), 2: (2, 3)}
    assert needle_tier(two_of_three, baseline_accuracy=2 / 3) == 2  # as good as the model itself
    assert needle_tier(two_of_three, baseline_accuracy=1.0) == 1  # below 90% of it: sometimes
    assert needle_tier({1: (3, 3), 2: (0, 3)}, 1.0) == 0  # the worst length's tier
    assert needle_tier(two_of_three, baseline_accuracy=None) == 1  # not measured: against 1.0


def test_a_method_an_engine_cannot_serve_is_never_that_engines_row():
    best = row("rerope (searched)", [0.99, 0.99], [(3, 3), (3, 3)], vllm=False, llama_cpp=False)
    served = row("yarn", [1.10, 1.20], [(3, 3), (3, 3)], vllm=True, llama_cpp=False)
    incomplete = row("ntk", [1.00, None], [(3, 3), (3, 3)])  # a missing number: never ranked
    picks = recommend([best, served, incomplete], 1.0, ["ctxext", "vllm", "llama.cpp"])
    assert picks["ctxext"].label == "rerope (searched)"
    assert picks["vllm"].label == "yarn"
    assert picks["llama.cpp"] is None


def test_successive_halving_schedule():
    assert rung_trials(8) == [2, 4, 8] and rung_trials(12) == [3, 6, 12] and rung_trials(1) == [1]
    assert better_half({"a": 3.0, "b": 1.0, "c": 2.0}) == ["b", "c"]  # 3 -> 2 (rounded up), best first
    # 10 s left, 1 s per trial for each of two methods with 2 trials done: up to 7 trials each (5 more each)
    assert fit_trials(8, {"x": 2, "y": 2}, {"x": 1.0, "y": 1.0}, 10.0) == 7
    assert fit_trials(8, {"x": 2, "y": 2}, {"x": 1.0, "y": 1.0}, 1.0) == 0  # not one more trial each


# ----------------------------------------------------------------------------------- tiny models
@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """Tiny llama and qwen3 checkpoints (L = 64) and five documents of 600 words."""
    import random

    root = tmp_path_factory.mktemp("compare")
    models = {f: save_tiny_checkpoint(root / f, tiny_model(f, seed=1)) for f in ("llama", "qwen3")}
    docs = root / "docs"
    docs.mkdir()
    rng = random.Random(0)
    for name in "abcde":
        # repeated phrases: something a model can pick up from context
        phrases = [" ".join(f"w{rng.randint(1, 255)}" for _ in range(6)) for _ in range(12)]
        (docs / f"{name}.txt").write_text(" ".join(rng.choice(phrases) for _ in range(100)))
    return {"root": root, "models": models, "docs": docs}


def request(tiny, family, out, **extra):
    values = dict(
        model=str(tiny["models"][family]),
        lengths=[128],
        output=out,
        data=DataOptions(text_files=[str(tiny["docs"])]),
        methods=METHODS.split(","),
        held_out_docs=2,
        trials=2,
        runtime=RuntimeOptions(device="cpu", dtype="fp32", progress=False),
    )
    return CompareRequest(**{**values, **extra})


def expected_recommendation(results: dict, target: str) -> str | None:
    """From results.json's rows alone: the best (tier, mean ratio to native) row that `target` serves exactly."""
    tiers = {"keeps the needle": 2, "finds it sometimes": 1, "loses the needle": 0}
    candidates = []
    for r in results["rows"]:
        ratios = list(r["ratio"].values())
        if r["tier"] is None or None in ratios or r["method"] == "none":  # none: the reference, never recommended
            continue
        if target != "ctxext" and r["serving"].get(target, {}).get("level") != "exact":
            continue
        mean = float(torch.tensor(ratios, dtype=torch.float64).log().mean().exp())
        prefill = (r["cost"] or {}).get("prefill_ratio") or float("inf")
        candidates.append((-tiers[r["tier"]], mean, prefill, r["label"]))
    return min(candidates)[3] if candidates else None


@pytest.mark.slow  # `make test-slow`: CI's second step
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_end_to_end_the_recommendation_follows_the_numbers(tiny, family, tmp_path, one_torch_thread):
    from ctxext.eval.perplexity import sliding_window_nll
    from ctxext.loading import load_model, load_tokenizer

    result = run_compare(request(tiny, family, tmp_path / "out"))
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert results == json.loads(json.dumps(result.results, default=str))
    assert {"report.md", "results.csv", "comparison.png"} <= {p.name for p in (tmp_path / "out").iterdir()}
    assert results["documents"]["calibration"] == [str(tiny["docs"] / "a.txt")]
    assert results["documents"]["held_out"] == [str(tiny["docs"] / n) for n in ("b.txt", "c.txt")]
    assert [r["label"] for r in results["rows"]][:4] == ["none", "yarn", "rerope", "self_extend"]
    assert any(r["kind"] == "searched" for r in results["rows"])  # the rungs searched someone

    for target in ("ctxext", "vllm", "sglang", "llama.cpp"):
        pick = results["recommendations"][target]
        assert (pick and pick["label"]) == expected_recommendation(results, target), target
    vllm = results["recommendations"]["vllm"]
    assert vllm is None or not vllm["label"].startswith(("rerope", "self_extend"))

    # native, recomputed here: the unpatched model in 64-token windows, stride 32, over the same held-out tokens
    model = load_model(str(tiny["models"][family]), dtype=torch.float32, device="cpu")
    tokenizer = load_tokenizer(str(tiny["models"][family]))
    nll = tokens = 0
    for name in ("b", "c"):
        ids = torch.tensor(tokenizer((tiny["docs"] / f"{name}.txt").read_text(), add_special_tokens=False).input_ids)
        n, t = sliding_window_nll(model, ids[:128], 64, 32, None)
        nll, tokens = nll + n, tokens + t
    assert results["native"]["128"] == pytest.approx(float(torch.tensor(nll / tokens).exp()), rel=1e-6)


def test_write_best_writes_a_checkpoint_that_reloads_with_the_recommended_rows_logits(tiny, tmp_path, one_torch_thread):
    import ctxext
    from ctxext.config import MethodConfig
    from ctxext.loading import load_model

    written = tmp_path / "best"
    result = run_compare(request(tiny, "llama", tmp_path / "out", write_best=f"vllm:{written}", search=False))
    pick = result.results["recommendations"]["vllm"]
    assert pick["label"] == "yarn"  # the only method of the three that vLLM serves exactly
    ids = torch.randint(1, 256, (1, 128), generator=torch.Generator().manual_seed(0))
    reloaded = load_model(str(written), dtype=torch.float32, device="cpu")
    expected = load_model(str(tiny["models"]["llama"]), dtype=torch.float32, device="cpu")
    MethodConfig.from_mapping(pick["config"]).apply(expected)
    with torch.no_grad():
        assert torch.allclose(reloaded(ids).logits, expected(ids).logits, atol=1e-5)
        assert not torch.allclose(expected(ids).logits, tiny_model("llama", seed=1)(ids).logits, atol=1e-3)
    assert ctxext.__name__  # `import ctxext` is what re-installs a method on load


def cli(*args, env=None, cwd=REPO):
    return subprocess.Popen(
        [sys.executable, "-m", "ctxext", "compare", *args],
        cwd=cwd,
        env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def table(out: Path) -> dict:
    results = json.loads((out / "results.json").read_text())
    # the recommendation is left out: at equal ratios it falls to the measured prefill times (test_end_to_end)
    rows = {r["label"]: (r["perplexity"], r["passkey"], r["configs"], r["tier"]) for r in results["rows"]}
    return {**rows, "native": results["native"], "searches": results["searches"]}


@pytest.mark.slow  # `make test-slow`: CI's second step
def test_a_killed_compare_resumes_to_the_table_of_an_uninterrupted_run(tiny, tmp_path, one_torch_thread):
    args = [str(tiny["models"]["qwen3"]), "--lengths", "128", "--text-file", str(tiny["docs"]), "--methods",
            "yarn,rerope", "--held-out-docs", "2", "--trials", "2", "--device", "cpu", "--dtype", "fp32",
            "--no-progress"]  # fmt: skip
    killed = cli(*args, "-o", str(tmp_path / "resumed"), env={"CTXEXT_COMPARE_STOP_AFTER_CELLS": "4"})
    _, err = killed.communicate(timeout=300)
    assert killed.returncode == 3, err[-2000:]  # stopped as if killed, after its 4th new cell
    kept = list((tmp_path / "resumed" / "cells").glob("*.json"))
    assert len(kept) == 4 and not (tmp_path / "resumed" / "searches").exists()
    resumed = cli(*args, "-o", str(tmp_path / "resumed"))
    out, err = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, err[-2000:]
    assert "(" in out and out.count(" @ 128 on ") < 2 * 3 + 2  # the 4 kept cells were not computed again
    run_compare(request(tiny, "qwen3", tmp_path / "whole", methods=["yarn", "rerope"]))
    assert table(tmp_path / "resumed") == table(tmp_path / "whole")


def test_bad_input_is_one_line_exit_2_and_writes_nothing(tiny, tmp_path, capsys):
    model, docs = str(tiny["models"]["llama"]), str(tiny["docs"])
    one_doc = tmp_path / "one.txt"
    one_doc.write_text((tiny["docs"] / "a.txt").read_text())
    cases = {
        "no held-out text left after the split": ["--lengths", "128", "--text-file", str(one_doc)],
        "compare is for lengths past the model's trained L = 64; 64 is not above it": [
            "--lengths", "64,128", "--text-file", docs],
        "cannot fit even the screen": ["--lengths", "128", "--text-file", docs, "--budget", "1ms"],
        "unknown method or preset 'yarm' (did you mean 'yarn'?)": [
            "--lengths", "128", "--text-file", docs, "--methods", "yarm"],
        "unknown method or preset 'servable:vlm'": ["--lengths", "128", "--text-file", docs, "--methods",
                                                     "servable:vlm"],
    }  # fmt: skip
    from ctxext.cli import main

    for i, (message, args) in enumerate(cases.items()):
        if i < 2:  # in a subprocess, as a user runs it
            process = cli(model, *args, "-o", str(tmp_path / f"out{i}"), "--device", "cpu")
            _, err = process.communicate(timeout=300)
            code = process.returncode
        else:  # the same command line in this process (each subprocess costs its imports)
            code = main(["compare", model, *args, "-o", str(tmp_path / f"out{i}"), "--device", "cpu"])
            err = capsys.readouterr().err
        assert code == 2, (message, err[-2000:])
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("ctxext compare: error: ") and message in lines[0], lines
        if "screen" in message:
            assert "it needs about" in lines[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["one.txt"]  # no output directory was created


@pytest.mark.slow  # `make test-slow`: CI's second step
def test_full_searches_write_the_page_layout_and_a_report_only_run_rebuilds_it(tiny, tmp_path, one_torch_thread):
    """--full-search kinds (the protocol of docs/comparison.md) give one row per method and kind, each search an
    ordinary study run to its trials; --page writes the page; report-only rebuilds it from the cells alone."""
    from dataclasses import replace

    from ctxext.compare.request import FullSearch
    from ctxext.compare.searches import read_history
    from tests.test_compare_methods import page_numbers

    page = tmp_path / "page" / "comparison.md"
    cache = tmp_path / "cache"
    kinds = [FullSearch("ppl", 2), FullSearch("needle-ppl", 1, ("rerope",))]
    asked = request(tiny, "llama", None, methods=["yarn", "rerope"], cache=cache, page=page, full_searches=kinds,
                    passkey_lengths=[128])  # fmt: skip
    result = run_compare(asked)
    assert result.results["failed"] == {}
    record = json.loads(page.with_suffix(".json").read_text())
    assert [r["label"] for r in record["rows"]] == [
        "none", "yarn", "yarn (searched)", "rerope", "rerope (searched)", "rerope (searched, needle-ppl)"
    ]  # fmt: skip
    folders = {f.name: len(read_history(f)) for f in (cache / "searches").iterdir() if f.is_dir()}
    assert folders == {"yarn-128": 2, "rerope-128": 2, "rerope-128-needle-ppl": 1}
    assert record["missing"] == [] and "Every cell is computed." in page.read_text()
    assert not (tmp_path / "out").exists() and page.with_suffix(".png").is_file()
    cells = sorted(p.name for p in (cache / "cells").iterdir())
    first = page_numbers(page.read_text())
    assert ("main", "rerope (searched, needle-ppl)") in first

    run_compare(replace(asked, report_only=True, page=tmp_path / "again.md"))
    assert page_numbers((tmp_path / "again.md").read_text()) == first
    assert sorted(p.name for p in (cache / "cells").iterdir()) == cells  # nothing computed again
