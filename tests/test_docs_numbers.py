"""Numbers the documentation states come from their source: the family count from the families table, the test
budget from the Makefile. A figure that drifts from its source fails here."""

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]


STATUSES = {"patched", "refused", "not built"}


def table_rows(text: str, header: str) -> list[list[str]]:
    """The cells of every row of the markdown table whose header line starts with `header`, as the table is: every
    line from the header on that starts with '|', the separator skipped."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header))
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
    return rows


def family_statuses() -> list[str]:
    """The status column of docs/guides/families.md's table (one row per RoPE family of transformers), every row."""
    rows = table_rows((REPO / "docs/guides/families.md").read_text(), "| family | status |")
    statuses = [row[1] for row in rows]
    assert set(statuses) <= STATUSES, sorted(set(statuses) - STATUSES)
    assert len({row[0] for row in rows}) == len(rows), "a family has two rows"
    return statuses


def test_the_family_table_reader_counts_rows_of_any_name():
    text = (
        "| family | status | what |\n|---|---|---|\n| a | patched | x |\n| modernbert-decoder | patched | y |\n\nafter"
    )
    assert [row[:2] for row in table_rows(text, "| family | status |")] == [
        ["a", "patched"],
        ["modernbert-decoder", "patched"],
    ]


def test_the_readmes_family_count_is_the_families_table():
    statuses = family_statuses()
    claimed = re.search(r"(\d+) of the (\d+) RoPE families", (REPO / "README.md").read_text())
    assert claimed, "README.md no longer states 'N of the M RoPE families'"
    table = (statuses.count("patched"), len(statuses))
    assert (int(claimed[1]), int(claimed[2])) == table, (
        f"README.md says {claimed[0]}; docs/guides/families.md's table has {table[0]} patched of {table[1]} rows: "
        "change README.md's first paragraph with the table"
    )


def test_every_stated_test_budget_is_the_makefiles():
    (budget,) = re.findall(r"budget: (\d+ minutes on \d+ CPU cores)", (REPO / "Makefile").read_text())
    stated = {
        (doc.relative_to(REPO), figure)
        for doc in DOCS
        for figure in re.findall(r"budget: (\d+ minutes on \d+ CPU cores)", doc.read_text())
    }
    assert stated, "no document states the test budget any more"
    assert {figure for _, figure in stated} == {budget}, sorted(stated)


def test_the_budget_is_stated_with_its_fresh_clone_measurement():
    """Where the budget is stated, the default tier's measured time from a fresh clone is too: BENCHMARKS.md's."""
    section = (REPO / "BENCHMARKS.md").read_text().split("## The test suite: `make test` from a fresh clone", 1)[1]
    (measured,) = re.findall(r"\*\*(\d+ min \d+ s)\*\* of wall time", section.split("\n## ")[0])
    minutes, seconds = map(int, re.findall(r"\d+", measured))
    (budget,) = re.findall(r"budget: (\d+) minutes on 2 CPU cores", (REPO / "Makefile").read_text())
    within = "within the budget" if minutes * 60 + seconds <= int(budget) * 60 else "over the budget"
    assert within in section, within
    for doc in [REPO / "Makefile", *DOCS]:
        for line in doc.read_text().splitlines():
            if "budget: " in line and "CPU cores" in line:
                assert re.search(rf"measured: {measured}, (idle|loaded)", line), (doc, line)


def test_benchmarks_date_range_spans_its_dates():
    text = (REPO / "BENCHMARKS.md").read_text()
    first, last = re.search(r"\((\d{4}-\d\d-\d\d) to (\d{4}-\d\d-\d\d);", text).groups()
    dates = re.findall(r"\d{4}-\d\d-\d\d", text.replace(f"({first} to {last};", "", 1))
    assert (first, last) == (min(dates), max(dates))


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


def comparison_ratio(label: str, length: int) -> float:
    import json

    table = json.loads((REPO / "docs" / "comparison.json").read_text())["table"][str(length)]
    return table["perplexity"][label] / table["native"]


def comparison_passkey(label: str, length: int) -> str:
    import json

    (found,) = [
        p for p in json.loads((REPO / "docs" / "comparison.json").read_text())["passkey"]
        if p["label"] == label and p["length"] == length
    ]  # fmt: skip
    return f"{found['correct']}/{found['trials']}"


def served_by(label: str) -> str:
    """The comparison page's 'served exactly by' column of a row, as the README words it."""
    rows = table_rows((REPO / "docs" / "comparison.md").read_text(), "| method | parameters |")
    (row,) = [row for row in rows if row[0] == label]
    names = [name.replace("ctxext runtime", "ctxext's runtime") for name in row[-1].split(", ")]
    return names[0] + " alone" if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


def test_the_readmes_results_are_the_comparison_pages_and_benchmarks():
    results = " ".join((REPO / "README.md").read_text().split("## Results", 1)[1].split("## Guides")[0].split())
    r = comparison_ratio
    claims = [
        f"SelfExtend at its defaults is {r('self_extend', 16384):.3f} x native at 16k and "
        f"{r('self_extend', 32768):.3f} at 32k and finds the passkey {comparison_passkey('self_extend', 16384)} at 16k",
        f"Served by {served_by('self_extend')} (`ctxext serve`)",
        f"yarn {r('yarn', 32768):.3f}, ntk {r('ntk', 32768):.3f} and dynamic_yarn {r('dynamic_yarn', 32768):.3f} x "
        "native at 32k",
        f"yarn and ntk are served exactly by {served_by('yarn')}, dynamic_yarn by {served_by('dynamic_yarn')}",
        f"GALI** has the best perplexity at its defaults ({r('gali', 16384):.3f} x native at 16k) but finds "
        f"{comparison_passkey('gali', 16384).replace('/', ' passkey of ')} there",
    ]
    for claim in claims:
        assert claim in results, claim
    assert served_by("ntk") == served_by("yarn")
    moonshot = (REPO / "docs" / "benchmarks" / "moonshot.md").read_text()
    (row,) = [line for line in moonshot.splitlines() if line.startswith("| **self_extend G 12, w 2048** |")]
    hamlet, othello, needle = re.findall(r"\*\*([\d./]+)\*\*", row)  # the table's two texts, the needle
    assert (
        f"at 64k (8x), G = 12, w = 2048: {hamlet} x native on Hamlet + Richard III and {othello} on Othello + Lear, "
        f"RULER's needle {needle.replace('/', ' of ')}"
    ) in results
    # next to the recommendation: the evidence is from the 135M model
    assert "the recommendation (evidence from the 135M model only)" in results
    assert results.startswith("Every figure below is from one small model, **SmolLM2-135M**")


def test_the_readmes_llamacpp_measurement_is_benchmarks():
    """The matrix's llama.cpp 'measured' cell names exactly the methods BENCHMARKS' llama.cpp table measured."""
    readme = (REPO / "README.md").read_text()
    cell = re.search(r"\| exact \(measured within ([\d.]+%): ([a-z0-9_, ]+); ([a-z0-9_, ]+) not measured\) \|", readme)
    assert cell, "README's llama.cpp cell of the first row changed shape"
    bench = (REPO / "BENCHMARKS.md").read_text()
    (header,) = [line for line in bench.splitlines() if line.startswith("| perplexity at 16k, 2x | none")]
    measured = {name.split()[0] for name in header.strip("|").split("|")[2:]}
    first_row = {"linear", "yarn", "llama3", "ntk", "theta"}
    assert set(cell[2].split(", ")) == first_row & measured
    assert set(cell[3].split(", ")) == first_row - measured
    assert f"within {cell[1]}" in bench


def test_the_four_families_are_named_where_they_are_counted():
    """'the four (tiny test) families' are tests/helpers.FAMILIES; every page that counts them names them."""
    from tests.helpers import FAMILIES

    named = "(LLaMA, Mistral, Qwen2, Qwen3)"
    assert [n.lower() for n in named.strip("()").split(", ")] == sorted(FAMILIES)
    for doc in DOCS:
        text = " ".join(doc.read_text().split())
        for found in re.finditer(r"four (tiny test )?families", text):
            assert text[found.end() :].lstrip(" :(").startswith(named.strip("()")), (doc, text[found.start() :][:80])
