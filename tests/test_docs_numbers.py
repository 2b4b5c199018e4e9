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
