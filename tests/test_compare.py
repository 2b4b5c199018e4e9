"""`ctxext compare` (ctxext.compare): the ranking rule on constructed rows, the engine support it reads, and end to
end on tiny random models of two families: the recommendation follows the numbers, --write-best, resume after a
kill, and bad input."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ctxext.compare import CompareRequest, RowNumbers, needle_tier, rank_rows, recommend, run_compare
from ctxext.compare.ranking import mean_ratio
from ctxext.compare.searches import better_half, fit_trials, rung_trials
from ctxext.run_options import DataOptions, RuntimeOptions
from tests.helpers import (
    compare_request,
    compare_table,
    page_numbers,
    save_smollm2_llama,
    save_tiny_checkpoint,
    tiny_model,
    write_compare_inputs,
)

REPO = Path(__file__).resolve().parents[1]


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


def test_wilson_intervals_are_the_published_ones():
    from ctxext.compare.ranking import wilson_interval

    for correct, trials in [(2, 3), (3, 3), (0, 3), (7, 10), (0, 1)]:
        assert wilson_interval(correct, trials) == pytest.approx(wilson(correct, trials), abs=1e-12)
    assert wilson_interval(2, 3) == pytest.approx((0.2077, 0.9385), abs=1e-4)  # the "0.21 to 0.94"


def test_rows_the_evidence_does_not_separate_are_tied_and_the_better_retrieval_is_recommended():
    from ctxext.compare.ranking import separated, tie_note, tied_rows

    # ranked first on perplexity, but 2/3 against 3/3 is one trial, and the documents' spreads overlap
    lower_ppl = row("rerope (searched)", [0.998, 0.997], [(2, 3), (2, 3)])
    lower_ppl.spreads, lower_ppl.searched = {1: (0.990, 1.006), 2: (0.985, 1.010)}, 1
    finds_all = row("self_extend", [1.004, 1.007], [(3, 3), (3, 3)])
    finds_all.spreads = {1: (0.996, 1.012), 2: (0.999, 1.015)}
    assert [r.label for r in rank_rows([finds_all, lower_ppl], 2 / 3)] == ["rerope (searched)", "self_extend"]
    assert not separated(lower_ppl, finds_all)
    assert recommend([lower_ppl, finds_all], 2 / 3, ["ctxext"])["ctxext"].label == "self_extend"
    tied = tied_rows([lower_ppl, finds_all], 2 / 3, "ctxext")
    assert tie_note(finds_all, tied).startswith("self_extend and rerope (searched) are not separated by 3 passkey")
    # ten trials a length separate them, and so does a spread that does not overlap
    assert separated(row("a", [1.0], [(10, 10)]), row("b", [1.0], [(2, 10)]))
    far = row("far", [1.10, 1.10], [(3, 3), (3, 3)])
    far.spreads = {1: (1.08, 1.12), 2: (1.09, 1.11)}
    assert separated(lower_ppl, far) and recommend([lower_ppl, far], 2 / 3, ["ctxext"])["ctxext"] is lower_ppl
    # tied on retrieval too: the row at its defaults
    defaults = row("yarn", [1.000, 1.000], [(2, 3), (2, 3)])
    defaults.spreads = {1: (0.99, 1.01), 2: (0.99, 1.01)}
    assert recommend([lower_ppl, defaults], 2 / 3, ["ctxext"])["ctxext"].label == "yarn"


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
    return write_compare_inputs(tmp_path_factory.mktemp("compare"))


def wilson(correct: int, trials: int) -> tuple[float, float]:
    """The 95% Wilson score interval, written out (Wilson 1927): the test's own, not ctxext's."""
    z, n = 1.96, trials
    centre, spread = correct + z * z / 2, z * math.sqrt(correct * (n - correct) / n + z * z / 4)
    return (centre - spread) / (n + z * z), (centre + spread) / (n + z * z)


def not_separated(a: dict, b: dict) -> bool:
    """From results.json: every passkey length's Wilson intervals and every length's per-document ratio ranges
    overlap."""
    for n, cell in a["passkey"].items():
        other = b["passkey"].get(n)
        if other and n in a["ratio"]:
            (lo_a, hi_a), (lo_b, hi_b) = (
                wilson(cell["correct"], cell["trials"]),
                wilson(other["correct"], other["trials"]),
            )
            if hi_a < lo_b or hi_b < lo_a:
                return False
    for n, ratios in a["document_ratios"].items():
        others = b["document_ratios"][n]
        if max(ratios) < min(others) or max(others) < min(ratios):
            return False
    return True


def expected_recommendation(results: dict, target: str) -> str | None:
    """From results.json's rows alone: the best (tier, mean ratio to native) row that `target` serves exactly, or
    among the rows not separated from it, the most passkey answers, then a row at its defaults."""
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
        candidates.append(((-tiers[r["tier"]], mean, prefill, r["label"]), r))
    if not candidates:
        return None
    best = min(candidates, key=lambda c: c[0])[1]
    tied = [(key, r) for key, r in candidates if r is best or not_separated(best, r)]
    asked = {str(n) for n in results["lengths"]}

    def retrieval(r):
        cells = [c for n, c in r["passkey"].items() if n in asked]
        return sum(c["correct"] for c in cells) / sum(c["trials"] for c in cells)

    def searched(r):
        keys = {k for config in r["configs"].values() for k in (config or {}) if k not in ("method", "factor")}
        return 0 if r["kind"] == "defaults" else max(1, len(keys))

    return min(tied, key=lambda c: (-retrieval(c[1]), searched(c[1]), c[0]))[1]["label"]


@pytest.mark.slow  # `make test-slow`: CI's second step
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_end_to_end_the_recommendation_follows_the_numbers(tiny, family, tmp_path, one_torch_thread):
    from ctxext.eval.perplexity import sliding_window_nll
    from ctxext.loading import load_model, load_tokenizer

    result = run_compare(compare_request(tiny, family, tmp_path / "out"))
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
    result = run_compare(compare_request(tiny, "llama", tmp_path / "out", write_best=f"vllm:{written}", search=False))
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


@pytest.mark.slow  # `make test-slow`: CI's second step
def test_a_killed_compare_resumes_to_the_table_of_an_uninterrupted_run(tiny, tmp_path, one_torch_thread):
    args = [str(tiny["models"]["qwen3"]), "--lengths", "128", "--text-file", str(tiny["docs"]), "--method",
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
    run_compare(compare_request(tiny, "qwen3", tmp_path / "whole", methods=["yarn", "rerope"]))
    assert compare_table(tmp_path / "resumed") == compare_table(tmp_path / "whole")


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
            "--lengths", "128", "--text-file", docs, "--method", "yarm"],
        "unknown method or preset 'servable:vlm'": ["--lengths", "128", "--text-file", docs, "--method",
                                                     "servable:vlm"],
        "--page-notes goes under the page's table: give --page too": [
            "--lengths", "128", "--text-file", docs, "--page-notes", str(one_doc)],
        "--page-notes: no such file": ["--lengths", "128", "--text-file", docs, "--page", str(tmp_path / "p.md"),
                                       "--page-notes", str(tmp_path / "notes.md")],
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

    page = tmp_path / "page" / "comparison.md"
    cache = tmp_path / "cache"
    kinds = [FullSearch("ppl", 2), FullSearch("needle-ppl", 1, ("rerope",))]
    asked = compare_request(tiny, "llama", None, methods=["yarn", "rerope"], cache=cache, page=page, full_searches=kinds,
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

    notes = tmp_path / "notes.md"
    notes.write_text("- **rerope**: a finding about a row that the cells cannot show.\n")
    run_compare(replace(asked, report_only=True, page=tmp_path / "again.md", page_notes=notes))
    again = (tmp_path / "again.md").read_text()
    assert page_numbers(again) == first
    table_end = again.index("\n\n", again.index("| method | parameters |"))  # the notes come right under the table
    assert again[table_end:].startswith("\n\n## Notes on rows\n\n- **rerope**: a finding about a row")
    assert json.loads((tmp_path / "again.json").read_text())["notes"] == notes.read_text()
    assert "## Notes on rows" not in page.read_text()  # none without --page-notes
    assert sorted(p.name for p in (cache / "cells").iterdir()) == cells  # nothing computed again


# --------------------------------------------------------------------------------- killed mid-search
HOLD_AT = 14  # the searches' 14th forward: the screen takes 3 trials of 3 forwards, so this one is inside rung 1


def trials_by_study(cache: Path) -> dict[str, list[dict]]:
    from ctxext.compare.searches import read_history

    return {f.name: read_history(f) for f in sorted((cache / "searches").iterdir()) if f.is_dir()}


def without_seconds(studies: dict) -> dict:
    return {name: [{k: v for k, v in t.items() if k != "seconds"} for t in h] for name, h in studies.items()}


@pytest.mark.slow  # `make test-slow`: CI's second step
def test_a_compare_killed_inside_a_search_trial_resumes_to_the_table_of_an_uninterrupted_run(
    tiny, tmp_path, one_torch_thread
):
    """SIGKILL while a successive-halving rung's trial runs (the process holds inside a forward pass of the search,
    $CTXEXT_COMPARE_HOLD_IN_SEARCH, and is killed there); the same command then finishes with the uninterrupted
    run's table and the same trials, keeping the ones finished before the kill as they were."""
    import signal
    import time

    from ctxext.compare.searches import HOLD_ENV

    methods = "yarn,rerope,self_extend"
    whole = tmp_path / "whole"
    run_compare(compare_request(tiny, "llama", whole, methods=methods.split(","), trials=4))
    expected = trials_by_study(whole)
    total, screened = sum(map(len, expected.values())), len(expected)  # the screen: trial 0 of each study

    out, marker = tmp_path / "resumed", tmp_path / "held"
    args = [str(tiny["models"]["llama"]), "--lengths", "128", "--text-file", str(tiny["docs"]), "--method", methods,
            "--held-out-docs", "2", "--trials", "4", "--device", "cpu", "--dtype", "fp32", "--no-progress",
            "-o", str(out)]  # fmt: skip
    log = (tmp_path / "held.log").open("w")
    held = subprocess.Popen(
        [sys.executable, "-m", "ctxext", "compare", *args],
        cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1", HOLD_ENV: f"{HOLD_AT}:{marker}"},
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    deadline = time.monotonic() + 300
    while not marker.exists():  # written by the held process, which then waits inside the forward
        assert held.poll() is None, (tmp_path / "held.log").read_text()[-2000:]
        assert time.monotonic() < deadline, "the compare never reached the search's forward pass"
        time.sleep(0.05)
    os.kill(held.pid, signal.SIGKILL)
    assert held.wait(timeout=60) == -signal.SIGKILL
    log.close()
    kept = trials_by_study(out)
    finished = sum(map(len, kept.values()))
    assert screened < finished < total, (finished, total)  # killed inside the rungs, with trials left to run

    resumed = cli(*args)
    _, err = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, err[-2000:]
    assert compare_table(out) == compare_table(whole)
    final = trials_by_study(out)
    assert without_seconds(final) == without_seconds(expected)  # the same trials, the interrupted one run again
    for name, before in kept.items():
        assert final[name][: len(before)] == before  # the finished ones kept, not recomputed (their seconds too)


# ------------------------------------------------------------------------------- the effective length
def table_columns(report: str) -> dict[str, dict[str, str]]:
    """report.md's main table: row label -> column name -> cell text."""
    lines = report.split("## Table", 1)[1].strip().splitlines()
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    rows = {}
    for line in lines[2:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows[cells[0]] = dict(zip(header, cells))
    return rows


def plant_passkey(cells: Path, accuracy: dict) -> None:
    """Set the passkey cells of (method, length) to `accuracy` correct answers: what a model that finds the key
    would have given (a random tiny model never does)."""
    for path in cells.glob("*.json"):
        record = json.loads(path.read_text())
        key = record["key"]
        wanted = accuracy.get((key["config"]["method"], key["length"])) if key["kind"] == "passkey" else None
        if wanted is not None:
            for i, trial in enumerate(record["records"]):
                trial["correct"] = i < wanted
            path.write_text(json.dumps({**record, "correct": wanted}))


def test_the_effective_length_is_a_column_of_the_table_and_the_csv_under_its_rule(tmp_path, one_torch_thread):
    """With passkey cells of a model that finds the key, the report's effective-length column (and the CSV's) is
    the longest passkey length whose accuracy is at least 85% of the unpatched model's at L, recomputed here from
    the planted accuracies; the rule is stated once under the table; a missing passkey cell makes it pending."""
    import csv
    from dataclasses import replace

    model = save_tiny_checkpoint(tmp_path / "m", tiny_model("llama", seed=1, max_position_embeddings=128))
    docs = tmp_path / "docs"
    docs.mkdir()
    for name in "abc":
        (docs / f"{name}.txt").write_text(" ".join(f"w{(i * 7 + ord(name)) % 256}" for i in range(400)))
    asked = CompareRequest(
        model=str(model),
        lengths=[256],
        output=tmp_path / "out",
        data=DataOptions(text_files=[str(docs)]),
        methods=["yarn", "rerope"],
        held_out_docs=2,
        search=False,
        max_passkey_trials=0,  # the table's passkey cells only (the decide stage: tests/test_compare_trials.py)
        runtime=RuntimeOptions(device="cpu", dtype="fp32", progress=False),
    )
    run_compare(asked)
    accuracy = {("none", 128): 3, ("none", 256): 1, ("yarn", 256): 3, ("rerope", 256): 2}  # of 3 keys each
    plant_passkey(tmp_path / "out" / "cells", accuracy)
    results = run_compare(replace(asked, report_only=True)).results

    threshold = 0.85 * accuracy[("none", 128)] / 3
    oracle = {
        label: max((n for (m, n), c in accuracy.items() if m == label and c / 3 >= threshold), default=None)
        for label in ("none", "yarn", "rerope")
    }
    assert oracle == {"none": 128, "yarn": 256, "rerope": None}
    assert {r["label"]: r["effective_length"] for r in results["rows"]} == oracle
    report = (tmp_path / "out" / "report.md").read_text()
    shown = {label: row["effective length"] for label, row in table_columns(report).items()}
    assert shown == {"**native** (unpatched, L-token windows)": "-", "none": "128", "yarn": "256", "rerope": "< 256"}
    rules = [line for line in report.splitlines() if line.startswith("Effective length: ")]
    assert len(rules) == 1 and "at least 85% of the unpatched model's score at the shortest length" in rules[0]
    assert "threshold 0.85" in rules[0] and "1.00 at 128" in rules[0]
    with open(tmp_path / "out" / "results.csv", newline="") as f:
        assert {r["label"]: r["effective_length"] for r in csv.DictReader(f)} == {
            "none": "128", "yarn": "256", "rerope": ""
        }  # fmt: skip

    for path in (tmp_path / "out" / "cells").glob("*.json"):  # rerope's passkey cell at 256 goes missing
        key = json.loads(path.read_text())["key"]
        if key["kind"] == "passkey" and key["config"]["method"] == "rerope":
            path.unlink()
    results = run_compare(replace(asked, report_only=True)).results
    assert {r["label"]: r["effective_length"] for r in results["rows"]} == {**oracle, "rerope": "pending"}
    assert table_columns((tmp_path / "out" / "report.md").read_text())["rerope"]["effective length"] == "..."


# ------------------------------------------------------------------------------------------ --tasks
def test_tasks_without_lm_eval_or_with_a_bad_limit_is_one_line_exit_2(tiny, tmp_path, capsys, monkeypatch):
    from ctxext.cli import main

    base = ["compare", str(tiny["models"]["llama"]), "--lengths", "128", "--text-file", str(tiny["docs"])]
    cases = {
        "--task-limit must be at least 1, got 0": ["--tasks", "niah_single_1", "--task-limit", "0"],
        "--task-limit limits the samples of --tasks; give --tasks too": ["--task-limit", "2"],
        "--tasks needs lm-evaluation-harness, which is not installed; install it with: pip install": [
            "--tasks", "niah_single_1"],
    }  # fmt: skip
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # `import lm_eval` fails as if it were not installed
    for i, (message, args) in enumerate(cases.items()):
        assert main([*base, *args, "-o", str(tmp_path / f"out{i}"), "--device", "cpu"]) == 2, message
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("ctxext compare: error: ") and message in lines[0], lines
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow  # `make test-slow`: CI's second step (lm-eval's task index alone takes 5-25 s)
def test_tasks_give_each_row_lm_evals_own_scores_and_answers_at_each_length(
    tmp_path, smollm2_path, monkeypatch, capsys, one_torch_thread
):
    """--tasks niah_single_1: each row at each length through `ctxext tasks`' cells gives what lm-eval gives on
    HFLM over the model patched with `ctxext.patch` (same prompts, same answers, the score their mean), as a column
    of the table, the JSON and the CSV; a report-only run reads the cells back without lm-eval; bad task input is
    one line, exit 2."""
    import csv
    import random
    from dataclasses import replace

    pytest.importorskip("lm_eval")
    import lm_eval
    import lm_eval.tasks
    from lm_eval.tasks import TaskManager

    from ctxext.cli import main

    length, limit = 1024, 2
    checkpoint = save_smollm2_llama(tmp_path / "ruler", smollm2_path, 512, attention_std=0.3)
    docs = tmp_path / "docs"
    docs.mkdir()
    rng = random.Random(0)
    words = ("the", "king", "said", "a", "man", "of", "city", "would", "ride", "north", "to", "see", "his", "sea")
    for name in "ab":
        (docs / f"{name}.txt").write_text(" ".join(rng.choice(words) for _ in range(1600)))
    asked = CompareRequest(
        model=str(checkpoint),
        lengths=[length],
        output=tmp_path / "out",
        data=DataOptions(text_files=[str(docs)]),
        methods=["yarn"],
        held_out_docs=1,
        search=False,
        passkey_lengths=[length],
        tasks=["niah_single_1"],
        task_limit=limit,
        runtime=RuntimeOptions(device="cpu", dtype="fp32", progress=False),
    )
    results = run_compare(asked).results
    assert results["failed"] == {} and results["missing"] == []
    assert results["tasks"]["columns"] == ["niah_single_1"]

    manager = TaskManager(  # lm-eval's own, indexing RULER's folder only, with what simple_evaluate(metadata=) sets
        include_defaults=False,
        include_path=str(Path(lm_eval.tasks.__file__).parent / "ruler"),
        metadata={"max_seq_lengths": [length], "tokenizer": str(checkpoint), "pretrained": str(checkpoint)},
    )
    cells = [json.loads(p.read_text()) for p in (tmp_path / "out" / "tasks").glob("*.json")]
    answers = {}
    for label, method in (("none", None), ("yarn", "yarn")):
        reference = lm_eval_answers(checkpoint, method, length, limit, manager)
        (cell,) = [c for c in cells if (c["key"]["method"].get("method") or "none") == (method or "none")]
        samples = cell["result"]["samples"]["niah_single_1"]
        assert [(s["prompt_hash"], s["response"]) for s in samples] == [
            (want["prompt_hash"], want["filtered_resps"][0]) for want in reference
        ]  # the same prompts, the same answers
        row = next(r for r in results["rows"] if r["label"] == label)
        expected = sum(want[str(length)] for want in reference) / limit
        assert row["tasks"] == {str(length): {"niah_single_1": pytest.approx(expected)}}
        answers[label] = [s["response"] for s in samples]
    assert answers["none"] != answers["yarn"]  # each row's patch reached the model lm-eval ran

    shown = table_columns((tmp_path / "out" / "report.md").read_text())
    assert shown["yarn"]["niah_single_1 1k"] == f"{results['rows'][1]['tasks']['1024']['niah_single_1']:.3f}"
    with open(tmp_path / "out" / "results.csv", newline="") as f:
        assert [float(r["niah_single_1"]) for r in csv.DictReader(f)] == [
            r["tasks"]["1024"]["niah_single_1"] for r in results["rows"]
        ]

    def not_called(*args, **kwargs):
        raise AssertionError("a kept task cell ran again")

    monkeypatch.setattr(lm_eval, "simple_evaluate", not_called)
    again = run_compare(replace(asked, report_only=True)).results
    assert [r["tasks"] for r in again["rows"]] == [r["tasks"] for r in results["rows"]]

    base = ["compare", str(checkpoint), "--text-file", str(docs), "--device", "cpu", "--no-search"]
    cases = {
        "unknown lm-eval task 'niah_singel_1' (did you mean 'niah_single_1'?)": [
            "--lengths", "1024", "--tasks", "niah_singel_1"],
        "RULER tasks (niah_single_1) need --lengths of at least 1024": ["--lengths", "768", "--tasks", "niah_single_1"],
    }  # fmt: skip
    for i, (message, args) in enumerate(cases.items()):
        capsys.readouterr()  # what the runs above wrote
        code = main([*base, *args, "-o", str(tmp_path / f"bad{i}")])
        lines = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(lines) == 1 and message in lines[0], lines
        assert not (tmp_path / f"bad{i}").exists()


def lm_eval_answers(checkpoint, method: str | None, length: int, limit: int, manager) -> list[dict]:
    """lm-eval's samples of niah_single_1 on HFLM over the checkpoint, patched with ctxext.patch (x2) or not."""
    import lm_eval
    from lm_eval.models.huggingface import HFLM
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import ctxext

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    if method is not None:
        ctxext.patch(model, method, factor=2)
    lm = HFLM(pretrained=model, tokenizer=AutoTokenizer.from_pretrained(checkpoint), max_length=length + 256)
    out = lm_eval.simple_evaluate(model=lm, tasks=["niah_single_1"], limit=limit, task_manager=manager)
    return sorted(out["samples"]["niah_single_1"], key=lambda s: int(s["doc_id"]))
