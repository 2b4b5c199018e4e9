"""docs/comparison.md, written by `ctxext compare --page` with the page's settings (scripts/compare_methods.py): its
committed cells must be found again by any fresh checkout that builds the model (the cells are named by
ctxext.outputs.CellCache under ctxext.outputs.content_fingerprint), and the page rebuilt from them must be the
committed page, number for number."""

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

from safetensors.torch import load_file, save_file

from ctxext.outputs import CellCache, content_fingerprint
from tests.helpers import page_numbers, save_tiny_checkpoint, tiny_model

REPO = Path(__file__).resolve().parents[1]
CELLS = REPO / "docs" / "comparison_cells"


def test_the_fingerprint_ignores_the_writers_release_and_sees_any_change_to_the_model(tmp_path):
    path = save_tiny_checkpoint(tmp_path / "m", tiny_model("llama"))
    reference = content_fingerprint(path)
    config = json.loads((path / "config.json").read_text())

    (path / "config.json").write_text(json.dumps({**config, "transformers_version": "0.0.1"}, indent=4))
    assert content_fingerprint(path) == reference  # another transformers wrote the same model

    (path / "config.json").write_text(json.dumps({**config, "vocab_size": config["vocab_size"] + 1}))
    assert content_fingerprint(path) != reference
    (path / "config.json").write_text(json.dumps(config))
    assert content_fingerprint(path) == reference

    weights = load_file(path / "model.safetensors")
    name = sorted(weights)[0]
    weights[name] = weights[name].clone()
    weights[name].view(-1)[0] += 1e-3  # one number of one tensor, same file size
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    assert content_fingerprint(path) != reference


def test_every_committed_cell_is_keyed_to_the_model_this_checkout_builds(smollm2_path):
    """The report reuses a cell only under its key; a key that no checkout reproduces means recomputing hours."""
    fingerprint = content_fingerprint(Path(smollm2_path))
    cells = sorted((CELLS / "cells").glob("*.json"))
    assert cells, "no committed cells"
    for path in cells:
        key = json.loads(path.read_text())["key"]
        assert key["model"] == fingerprint, f"{path.name} was computed on another model"
        assert CellCache(CELLS / "cells").get(key) is not None  # named by its key (context + fields)
        assert CellCache(CELLS / "cells").path(key) == path
    for recorded in (CELLS / "searches").glob("*.model.json"):
        assert json.loads(recorded.read_text())["model_fingerprint"] == fingerprint, recorded.name


def test_a_narrowed_run_still_writes_every_row_and_length_of_the_page(tmp_path, smollm2_path):
    """--methods and --lengths narrow the computing, not the page: the report of one method at one length, built
    from the committed cells, has the committed page's rows and columns (it once held that method's rows alone)."""
    result = subprocess.run(
        [sys.executable, "scripts/compare_methods.py", "--report-only", "--methods", "leaky_rerope"]
        + ["--lengths", "32768", "--output", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    written = json.loads((tmp_path / "comparison.json").read_text())
    committed = json.loads((REPO / "docs" / "comparison.json").read_text())
    assert written["lengths"] == committed["lengths"] == [16384, 32768]
    assert [row["label"] for row in written["rows"]] == [row["label"] for row in committed["rows"]]
    assert written["table"] == committed["table"]


def test_an_unknown_device_is_one_line_exit_2_and_writes_nothing(tmp_path):
    result = subprocess.run(
        [sys.executable, "scripts/compare_methods.py", "--report-only", "--device", "tpu"]
        + ["--output", str(tmp_path / "out"), "--cells", str(tmp_path / "cells")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "ctxext compare: error: unknown device 'tpu'; use auto, cpu, cuda, cuda:N or mps"
    ]
    assert list(tmp_path.iterdir()) == []


def page_script():
    spec = importlib.util.spec_from_file_location("compare_methods", REPO / "scripts" / "compare_methods.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def record_of(page):
    return json.loads(page.with_suffix(".json").read_text())


def test_the_page_rebuilt_from_the_committed_cells_is_the_committed_page(tmp_path, smollm2_path, monkeypatch):
    """`ctxext compare` with the page's settings, report-only, from docs/comparison_cells: every table row and
    searched parameter of docs/comparison.md, number for number, without loading the model."""
    import argparse

    import ctxext.loading
    from ctxext.cli import main

    def no_model(*args, **kwargs):
        raise AssertionError("report-only loaded the model")

    monkeypatch.setattr(ctxext.loading, "load_model", no_model)
    script = page_script()
    args = argparse.Namespace(
        needle_methods=",".join(script.NEEDLE_METHODS), held_out=",".join(script.HELD_OUT),
        passkey_lengths=list(script.PASSKEY_LENGTHS), dtype="bf16", device="cpu", cells=CELLS,
        search_trials=12, needle_trials=8,
    )  # fmt: skip
    page = tmp_path / "comparison.md"
    argv = script.compare_argv(str(smollm2_path), args, list(script.DEFAULT_LENGTHS), None, True, page)
    assert main([*argv, "--no-progress"]) == 0
    written, committed = page.read_text(), (REPO / "docs" / "comparison.md").read_text()
    assert page_numbers(written) == page_numbers(committed)
    assert len(page_numbers(committed)) > 100
    # the page says where the evidence separates its pick from the next row and where it does not: rerope (searched)
    # 8/12 against leaky_rerope (searched) 0/12 after the decide stage; llama3 (searched) stopped at the trial cap
    found = {(r["label"], r["length"]): (r["correct"], r["trials"]) for r in record_of(page)["passkey"]}
    assert found[("rerope (searched)", 16384)] == (8, 12) and found[("leaky_rerope (searched)", 16384)] == (0, 12)
    assert "- **Separated:** rerope (searched) is separated from leaky_rerope (searched) after 12" in committed
    assert "- **Not separated:** llama3 (searched) and yarn are not separated by 12 passkey trials" in committed
    assert "stopped at the cap, 12 a length" in committed
    assert "| 2/3 [0.21, 0.94] |" in committed  # passkey counts with their Wilson interval
    assert list(CELLS.glob("**/*.md")) == []  # nothing written among the cells
    record = record_of(page)
    assert record["table"] == json.loads((REPO / "docs" / "comparison.json").read_text())["table"]
    # what is missing is only what no cell holds yet: a row's column the page shows as '...', never a cached cell's
    lines = committed.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| method | parameters |"))
    table = lines[start : lines.index("", start)]  # the main table, up to its blank line
    columns = [name.strip() for name in table[0].strip("|").split("|")]
    rows = {line.split(" | ")[0][2:]: line.strip("|").split("|") for line in table[2:]}
    for line in record["missing"]:
        if line.startswith("passkey trials: "):  # the decide stage's further blocks: the column shows the count so far
            continue
        kind, label, length = re.match(r"(perplexity|passkey|search): (.+?) at (\d+)", line).groups()
        if kind == "search" or label not in rows:
            continue
        column = f"{int(length) // 1024}k ppl" if kind == "perplexity" else f"passkey {int(length) // 1024}k"
        assert rows[label][columns.index(column)].strip() == "...", line
