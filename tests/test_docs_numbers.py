"""Numbers the documentation states come from their source: the family count from the families table, the test
budget from the Makefile. A figure that drifts from its source fails here."""

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]


def family_statuses() -> list[str]:
    """The status column of docs/guides/families.md's table (one row per RoPE family of transformers)."""
    rows = re.findall(r"^\| [a-z0-9_]+ \| ([a-z ]+?) \|", (REPO / "docs/guides/families.md").read_text(), re.M)
    return [status for status in rows if status != "status"]


def test_the_readmes_family_count_is_the_families_table():
    statuses = family_statuses()
    claimed = re.search(r"(\d+) of the (\d+) RoPE families", (REPO / "README.md").read_text())
    assert claimed, "README.md no longer states 'N of the M RoPE families'"
    assert (int(claimed[1]), int(claimed[2])) == (statuses.count("patched"), len(statuses))


def test_every_stated_test_budget_is_the_makefiles():
    (budget,) = re.findall(r"budget: (\d+ minutes on \d+ CPU cores)", (REPO / "Makefile").read_text())
    stated = {
        (doc.relative_to(REPO), figure)
        for doc in DOCS
        for figure in re.findall(r"budget: (\d+ minutes on \d+ CPU cores)", doc.read_text())
    }
    assert stated, "no document states the test budget any more"
    assert {figure for _, figure in stated} == {budget}, sorted(stated)


def test_the_comparison_pages_run_time_and_missing_count_are_its_cells():
    import json
    import math

    from ctxext.compare.page import search_totals

    cells = REPO / "docs" / "comparison_cells"
    seconds = math.fsum(json.loads(p.read_text()).get("seconds", 0.0) for p in (cells / "cells").glob("*.json"))
    seconds += search_totals(cells / "searches")[0]
    page = (REPO / "docs" / "comparison.md").read_text()
    stated = re.search(r"\*\*Run time\*\*: ([\d.]+) h of computation", page)
    assert stated and float(stated[1]) == round(seconds / 3600, 1)
    missing = json.loads((REPO / "docs" / "comparison.json").read_text())["missing"]
    count = re.search(r"\*\*Partial report: (\d+) cells are missing\*\*", page)
    assert (int(count[1]) if count else 0) == len(missing)
    assert not re.search(r"\d+ h of computation on a 2-core", (REPO / "docs/guides/methods.md").read_text())


def test_the_readmes_cost_of_256k_is_the_cost_line():
    """README's step 1 quotes the cost line of Llama-3.1-8B at 256k (tests/test_cost.py checks it by hand)."""
    from transformers import AutoConfig

    from ctxext.cost import DATA_OPTIONS, SHAKESPEARE_TOKENS, context_cost, render_cost

    readme = (REPO / "README.md").read_text()
    assert "ctxext methods --model meta-llama/Llama-3.1-8B --target-length 256k" in readme
    config = AutoConfig.from_pretrained(REPO / "tests/fixtures/configs/llama-3.1-8b")
    printed = "\n".join(render_cost("meta-llama/Llama-3.1-8B", context_cost(config, 262144)))
    quoted = " ".join(readme.split())
    for claim in re.findall(r"\*\*(KV cache: [^*]+|prefill: [^*]+)\*\*", quoted):
        assert claim in printed, claim
    assert len(re.findall(r"\*\*(KV cache: |prefill: )", quoted)) == 2
    assert f"average {DATA_OPTIONS['pg19'][0]:,} words" in quoted
    assert f"make at most {SHAKESPEARE_TOKENS // 262144} such documents" in quoted
    assert "window needs one document of 262,144 tokens and compare 4 of them" in quoted
