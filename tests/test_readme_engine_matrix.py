"""The README's method x engine matrix says what `ctxext export` (the engine table, ctxext.serving.engines) says,
for each method of each row on a tiny LLaMA at 2x: a cell's level word is the table's level, engine by engine."""

import re
from pathlib import Path

import pytest

from ctxext.compare.serving import engine_support
from tests.helpers import tiny_config

README = Path(__file__).resolve().parents[1] / "README.md"
COLUMNS = ("transformers", "vllm+sglang", "llama.cpp", "ctxext")
# Names in the first column that are not a method name, as the method mapping they stand for.
SPECIAL = {"yarn's ratio ramp": {"method": "yarn", "ramp": "ratio"}, "`--logn`": {"method": "yarn", "logn": True}}


def matrix_rows() -> list[tuple[list[dict], list[str]]]:
    """(method mappings, cells) of each row of the README's table under 'Which engine serves which method'."""
    text = README.read_text().split("## Which engine serves which method", 1)[1]
    rows = [line for line in text.splitlines() if line.startswith("| ")][1:]  # after the header
    parsed = []
    for row in rows:
        first, *cells = [cell.strip() for cell in row.strip("|").split("|")]
        names = [name.replace(" with short != long", "") for name in first.split(", ")]
        parsed.append(([SPECIAL.get(name, {"method": name}) for name in names], cells))
    return parsed


def stated_level(column: str, cell: str, method: str, engine: str) -> str:
    """The level a README cell states for `engine` (one of the column's engines) and `method`."""
    if column == "transformers":
        return "no" if "after `import ctxext`" in cell else cell.split()[0]  # plain transformers, no import
    if column == "vllm+sglang" and "; " in cell.split(" (")[0]:
        named = dict(part.split()[:2] for part in cell.split(" (")[0].split("; "))
        return named[{"vllm": "vLLM", "sglang": "SGLang"}[engine]]
    if column == "llama.cpp" and cell.startswith("llama arch:"):
        return "exact"  # the tiny model is a LLaMA
    if column == "llama.cpp" and cell.split()[0] in {"self_extend"}:
        return cell.split()[1] if method == cell.split()[0] else "no"
    return cell.split()[0]


CASES = [(methods, cells) for methods, cells in matrix_rows()]


def test_the_matrix_has_its_four_rows():
    assert len(CASES) == 4 and all(len(cells) == len(COLUMNS) for _, cells in CASES)


@pytest.mark.parametrize("methods,cells", CASES, ids=[",".join(m["method"] for m in ms) for ms, _ in CASES])
def test_each_cell_is_what_the_engine_table_says(methods, cells):
    for mapping in methods:
        method = mapping["method"]
        config = {**mapping, "factor": 2.0}
        if method == "theta":
            config["new_base"] = 40000.0
        support = engine_support(config, tiny_config("llama"), 64)
        for column, cell in zip(COLUMNS, cells):
            for engine in column.split("+"):
                stated = stated_level(column, cell, method, engine)
                assert stated == support[engine]["level"], (method, engine, cell, support[engine])


def test_export_gives_every_verdict_its_evidence_word(tmp_path, capsys):
    from ctxext.cli import main
    from tests.helpers import save_tiny_checkpoint, tiny_model

    source = save_tiny_checkpoint(tmp_path / "src", tiny_model("llama"))
    for method, words in {"yarn": ["tested", "measured", "measured", "measured"], "rerope": ["tested", "read"]}.items():
        out = tmp_path / method
        assert main(["patch", str(source), "--method", method, "--factor", "2", "-o", str(out)]) == 0
        capsys.readouterr()
        assert main(["export", str(out)]) == 0
        stated = re.findall(r"evidence: (\w+):", capsys.readouterr().out)
        assert len(stated) == 4 and stated[: len(words)] == words, stated
