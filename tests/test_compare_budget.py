"""benchmarks/compare_budget.py (issue 46, "Budget that works"): its verdict on constructed results (holds, fails
on perplexity, fails on passkey), its count of forwards and seconds on constructed caches, and the full grid's 16k
totals read from the committed docs/comparison.json and docs/comparison_cells/, against a recount from the raw
files written here. Nothing loads a model."""

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SPEC = importlib.util.spec_from_file_location("compare_budget", REPO / "benchmarks" / "compare_budget.py")
budget = sys.modules.setdefault("compare_budget", importlib.util.module_from_spec(SPEC))  # dataclasses look it up
SPEC.loader.exec_module(budget)

N, L = 16384, 8192


# ------------------------------------------------------------------------------------------- constructed runs
def results_json(label: str, perplexity: float, correct: int, native: float = 30.0, trials: int = 3) -> dict:
    """A budgeted run's results.json, reduced to what the benchmark reads."""
    other = {"label": "none", "perplexity": {str(N): 60.0}, "passkey": {str(N): {"correct": 0, "trials": 3}}}
    row = {
        "label": label,
        "perplexity": {str(N): perplexity},
        "passkey": {str(N): {"correct": correct, "trials": trials}},
    }
    return {
        "machine": "a GPU machine",
        "native": {str(N): native},
        "rows": [other, row],
        "recommendations": {"ctxext": {"label": label}, "vllm": None},
        "budget": {"budget_seconds": 100.0, "spent_seconds": 90.0},
        "missing": [],
    }


def page_json(best: float = 30.0, native: float = 30.0, best_correct: int = 2) -> dict:
    """A page's json, reduced to what the benchmark reads: the best row is 'b (searched)'."""
    return {
        "machine": "a CPU machine",
        "table": {str(N): {"native": native, "perplexity": {"none": 20.0, "a": best * 1.1, "b (searched)": best}}},
        "passkey": [
            {"label": "none", "length": L, "correct": 3, "trials": 3, "seconds": 5.0, "key": {"keys": [[0.5, 1]] * 3}},
            {"label": "a", "length": N, "correct": 3, "trials": 3, "seconds": 7.0, "key": {"keys": [[0.5, 1]] * 3}},
            {
                "label": "b (searched)",
                "length": N,
                "correct": best_correct,
                "trials": 3,
                "seconds": 8.0,
                "key": {"keys": [[0.5, 1]] * 3},
            },
            {
                "label": "a",
                "length": 2 * N,
                "correct": 0,
                "trials": 3,
                "seconds": 100.0,
                "key": {"keys": [[0.5, 1]] * 3},
            },
        ],  # fmt: skip
        "cells": [
            {"label": "native", "length": N, "seconds": 4.0},
            {"label": "a", "length": N, "seconds": 2.0},
            {"label": "b (searched)", "length": N, "seconds": 3.0},
            {"label": "a", "length": 2 * N, "seconds": 50.0},
        ],
        "rows": [
            {"label": "a", "search": {}},
            {"label": "b (searched)", "search": {str(N): {"folder": "b-16384"}, str(2 * N): {"folder": "b-32768"}}},
        ],
    }


def write_study(folder: Path, objective: str, length: int, trials: list[dict], calibration=("cal",)) -> None:
    folder.mkdir(parents=True)
    settings = {
        "objective": objective,
        "length": length,
        "passkey": {"trials": 1, "depths": [0.1, 0.5, 0.9]} if "needle" in objective else None,
        "data": {"calibration": {"documents": list(calibration)}},
    }
    (folder / "search.json").write_text(json.dumps(settings))
    (folder / "trials.jsonl").write_text("".join(json.dumps(t) + "\n" for t in trials))


def trial(seconds: float, state: str = "complete") -> dict:
    return {"state": state, "seconds": seconds}


def write_cell(cells: Path, name: str, key: dict, seconds: float) -> None:
    cells.mkdir(parents=True, exist_ok=True)
    (cells / f"{name}.json").write_text(json.dumps({"key": key, "seconds": seconds}))


# ------------------------------------------------------------------------------------------------- the verdict
def test_a_row_within_one_percent_that_keeps_the_passkey_holds_the_claim():
    best = budget.page_best_row(page_json(best=30.0, best_correct=2), N)
    assert best["label"] == "b (searched)"  # the lowest perplexity but the unpatched model's
    row = budget.recommended_row(results_json("c (searched)", 30.25, correct=2), N)
    v = budget.verdict(row, best)
    assert v["holds"] and v["perplexity_within"] and v["passkey_at_least"]
    assert v["relative_perplexity"] == pytest.approx(30.25 / 30.0)


def test_more_than_one_percent_above_the_best_fails():
    best = budget.page_best_row(page_json(best=30.0), N)
    v = budget.verdict(budget.recommended_row(results_json("c", 30.0 * 1.0101, correct=3), N), best)
    assert not v["perplexity_within"] and v["passkey_at_least"] and not v["holds"]


def test_a_lower_passkey_than_the_best_rows_fails_at_equal_perplexity():
    best = budget.page_best_row(page_json(best=30.0, best_correct=2), N)
    v = budget.verdict(budget.recommended_row(results_json("c", 30.0, correct=1), N), best)
    assert v["perplexity_within"] and not v["passkey_at_least"] and not v["holds"]


def test_perplexity_is_compared_over_each_runs_native():
    best = budget.page_best_row(page_json(best=30.0, native=30.0), N)
    row = budget.recommended_row(results_json("c", 30.6, correct=2, native=30.6), N)  # another machine's kernels
    v = budget.verdict(row, best)
    assert v["relative_perplexity"] == pytest.approx(1.0) and v["plain_perplexity_ratio"] == pytest.approx(1.02)
    assert v["holds"]


def test_a_run_without_a_recommendation_is_bad_input():
    results = results_json("c", 30.0, correct=2)
    results["recommendations"]["ctxext"] = None
    with pytest.raises(budget.BadInput, match="recommends no row"):
        budget.recommended_row(results, N)


# ---------------------------------------------------------------------------------------- forwards and seconds
def test_forwards_and_seconds_of_a_cache_count_every_cell_and_trial_of_the_length(tmp_path):
    cells = tmp_path / "cells"
    one = {"kind": "perplexity", "length": N, "protocol": "one window"}
    write_cell(cells, "a", one, 2.0)  # 1 forward
    write_cell(cells, "native", {**one, "protocol": f"{L}/{L // 2}"}, 3.0)  # windows at 0, 4096, 8192: 3
    write_cell(cells, "pk", {"kind": "passkey", "length": N, "keys": [[0.1, 1], [0.5, 2], [0.9, 3]]}, 5.0)  # 3
    write_cell(cells, "pk8", {"kind": "passkey", "length": L, "keys": [[0.1, 1], [0.5, 2], [0.9, 3]]}, 4.0)  # 3
    write_cell(cells, "long", {**one, "length": 2 * N}, 100.0)  # another length: not counted
    write_cell(cells, "ppl8", {**one, "length": L}, 100.0)  # a perplexity cell at L is no part of the column
    searches = tmp_path / "searches"
    write_study(searches / "a", "ppl", N, [trial(1.0), trial(1.5), trial(0.5, "invalid")])  # 1 + 1 + 0
    write_study(searches / "b", "needle-ppl", N, [trial(6.0), trial(6.0)])  # 3 + 3
    write_study(searches / "c", "ppl+needle-ppl", N, [trial(7.0)], calibration=("x", "y"))  # 2 + 3
    write_study(searches / "d", "ppl", 2 * N, [trial(50.0)])  # another length: not counted
    work = budget.cache_work(tmp_path, N, L)
    assert work.forwards == 1 + 3 + 3 + 3 + (1 + 1 + 0) + (3 + 3) + (2 + 3)
    assert work.seconds == pytest.approx(2 + 3 + 5 + 4 + 3 + 12 + 7)
    assert (work.cells, work.trials) == (4, 6)


def test_the_page_work_counts_its_cells_passkey_and_the_searches_its_rows_name(tmp_path):
    write_study(tmp_path / "b-16384", "ppl", N, [trial(1.0)] * 12)
    write_study(tmp_path / "b-32768", "ppl", 2 * N, [trial(9.0)] * 12)
    write_study(tmp_path / "stray-16384", "ppl", N, [trial(99.0)])  # no row names it: not the page's
    work = budget.page_work(page_json(), tmp_path, N, L)
    assert work.forwards == 3 + 1 + 1 + 3 + 3 + 3 + 12  # native windows, two cells, three passkey cells, trials
    assert work.seconds == pytest.approx(4 + 2 + 3 + 5 + 7 + 8 + 12)
    assert (work.cells, work.trials) == (6, 12)
    assert budget.shares(budget.Work(10, 6.0), work) == {"forwards": 10 / work.forwards, "seconds": 6.0 / work.seconds}


def test_native_windows_follow_the_stride():
    assert [budget.native_windows(n, L, L // 2) for n in (L, 12288, N, 2 * N)] == [1, 2, 3, 7]


def test_the_default_budget_is_the_fraction_of_the_grid_scaled_to_this_machine():
    assert budget.scaled_budget(1000.0, 0.1, None, 50.0) == pytest.approx(100.0)
    assert budget.scaled_budget(1000.0, 0.1, 0.5, 50.0) == pytest.approx(1.0)  # 100x faster here


def test_the_budgeted_command_is_the_pages_protocol_with_a_budget_and_no_fixed_search(tmp_path):
    args = budget.parse_args(["--cache", str(tmp_path), "--device", "cuda"])
    argv = budget.budgeted_argv("/m", args, 1234.4)
    assert argv[argv.index("--budget") + 1] == "1234s" and "--no-search" not in argv
    assert "--full-search" not in argv and argv[argv.index("--lengths") + 1] == str(N)
    assert argv[argv.index("--calibration") + 1] == budget.page_protocol.CALIBRATION
    assert argv[argv.index("--passkey-lengths") + 1] == f"{L},{N}"
    assert argv[argv.index("--dtype") + 1] == "bf16" and argv[argv.index("--device") + 1] == "cuda"
    assert argv[argv.index("--cache-dir") + 1] == str(tmp_path)
    assert "--no-search" in budget.defaults_argv("/m", args)


# ------------------------------------------------------------------------------------------ --report-only
def report_only(tmp_path, results: dict | None, page: dict) -> int:
    cache = tmp_path / "cache"
    if results is not None:
        (cache / "report").mkdir(parents=True)
        (cache / "report" / "results.json").write_text(json.dumps(results))
    (tmp_path / "page.json").write_text(json.dumps(page))
    write_study(tmp_path / "grid" / "searches" / "b-16384", "ppl", N, [trial(1.0)] * 12)
    write_study(tmp_path / "grid" / "searches" / "b-32768", "ppl", 2 * N, [trial(1.0)] * 12)
    argv = ["--report-only", "--cache", str(cache), "--page", str(tmp_path / "page.json")]
    return budget.main([*argv, "--page-cells", str(tmp_path / "grid"), "--json", str(tmp_path / "v.json")])


def test_report_only_exits_0_when_the_claim_holds_and_1_when_it_fails(tmp_path, capsys):
    assert report_only(tmp_path / "ok", results_json("c", 30.1, correct=2), page_json()) == 0
    record = json.loads((tmp_path / "ok" / "v.json").read_text())
    assert record["verdict"]["holds"] and record["machine"] and record["budgeted_machine"] == "a GPU machine"
    assert record["work"]["full_grid"]["forwards"] == 26 and record["work"]["budgeted"]["forwards"] == 0
    assert "budget claim: HOLDS" in capsys.readouterr().out
    assert report_only(tmp_path / "bad", results_json("c", 31.0, correct=2), page_json()) == 1
    assert "budget claim: FAILS" in capsys.readouterr().out


def test_report_only_without_a_budgeted_run_is_one_line_and_exit_2(tmp_path, capsys):
    assert report_only(tmp_path, None, page_json()) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "run without --report-only" in err
    assert not (tmp_path / "v.json").exists()


def test_a_bad_budget_is_one_line_and_exit_2(tmp_path, capsys):
    (tmp_path / "page.json").write_text(json.dumps(page_json()))
    (tmp_path / "grid" / "searches").mkdir(parents=True)
    write_study(tmp_path / "grid" / "searches" / "b-16384", "ppl", N, [trial(1.0)])
    argv = ["--budget", "soon", "--page", str(tmp_path / "page.json"), "--page-cells", str(tmp_path / "grid")]
    assert budget.main([*argv, "--model", str(tmp_path / "no-model"), "--cache", str(tmp_path / "c")]) == 2
    assert capsys.readouterr().err.count("\n") == 1 and not (tmp_path / "c").exists()
    assert budget.main([*argv[2:], "--fraction", "2", "--cache", str(tmp_path / "c")]) == 2
    assert capsys.readouterr().err == "compare_budget: --fraction must be in (0, 1], got 2.0\n"


# ------------------------------------------------------------------------------------- the committed full grid
def recount_committed_16k() -> tuple[int, float, int, int]:
    """(forwards, seconds, cells, trials) of the committed grid at 16k, straight from the raw files: every cell file
    at 16384 and the passkey baseline at 8192; every search whose settings say 16384."""
    root = REPO / "docs" / "comparison_cells"
    forwards, seconds, cells, trials = 0, [], 0, 0
    for path in (root / "cells").glob("*.json"):
        cell = json.loads(path.read_text())
        key = cell["key"]
        if key["length"] == N or (key["kind"] == "passkey" and key["length"] == L):
            cells += 1
            seconds.append(cell["seconds"])
            if key["kind"] == "passkey":
                forwards += len(key["keys"])  # one prefill per key
            elif key["protocol"] == "one window":
                forwards += 1
            else:
                assert key["protocol"] == "8192/4096"
                forwards += 3  # windows starting at 0, 4096, 8192 over 16384 tokens
    for settings_path in (root / "searches").glob("*/search.json"):
        settings = json.loads(settings_path.read_text())
        if settings["length"] != N:
            continue
        per_trial = {"ppl": len(settings["data"]["calibration"]["documents"])}.get(settings["objective"])
        if per_trial is None:
            assert settings["objective"] == "needle-ppl"
            per_trial = settings["passkey"]["trials"] * len(settings["passkey"]["depths"])
        for line in (settings_path.parent / "trials.jsonl").read_text().splitlines():
            record = json.loads(line)
            trials += 1
            seconds.append(record["seconds"])
            forwards += per_trial if record["state"] == "complete" else 0
    return forwards, math.fsum(seconds), cells, trials


def test_the_full_grids_16k_totals_read_from_the_page_match_a_recount_of_the_raw_files():
    page = json.loads((REPO / "docs" / "comparison.json").read_text())
    work = budget.page_work(page, REPO / "docs" / "comparison_cells" / "searches", N, L)
    assert work.forwards > 0 and work.seconds > 0 and work.cells > 0 and work.trials > 0
    forwards, seconds, cells, trials = recount_committed_16k()
    assert (work.forwards, work.cells, work.trials) == (forwards, cells, trials)
    assert work.seconds == pytest.approx(seconds, rel=1e-12)
    cached = budget.cache_work(REPO / "docs" / "comparison_cells", N, L)  # the reader of a run's own cache
    assert (cached.forwards, cached.cells, cached.trials) == (forwards, cells, trials)
    assert cached.seconds == pytest.approx(seconds, rel=1e-12)
