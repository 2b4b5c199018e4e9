"""`ctxext eval` never discards finished work: each (method, length) cell is kept as soon as it is done; after a
failure the finished cells are written with the error, and the same command computes only the missing ones."""

import json

import pytest

import ctxext.eval.runner as runner
from ctxext.cli import main
from ctxext.config import MethodConfig
from tests.helpers import EVAL_SWEEP_LENGTHS, eval_sweep_argv, save_tiny_checkpoint, tiny_model, write_random_words


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), tiny_model("llama"))


@pytest.fixture(scope="module")
def texts(tmp_path_factory):
    return write_random_words(tmp_path_factory.mktemp("texts"))


@pytest.fixture
def forwards(monkeypatch):
    """Counts the windows scored (one forward each), by method."""
    counted = []
    real = runner.window_nll

    def counting(model, ids, window, bos_token_id=None):
        counted.append(type(model.model.rotary_emb).__name__)
        return real(model, ids, window, bos_token_id)

    monkeypatch.setattr(runner, "window_nll", counting)
    return counted


def test_a_failed_method_keeps_the_finished_cells_and_the_rerun_computes_only_the_rest(
    checkpoint, texts, tmp_path, monkeypatch, forwards
):
    out = tmp_path / "out"
    real_apply = MethodConfig.apply

    def failing(self, model):
        if self.method == "ntk":  # the third row: none, linear x2, ntk x2, yarn x2
            raise RuntimeError("out of memory (simulated)")
        return real_apply(self, model)

    monkeypatch.setattr(MethodConfig, "apply", failing)
    with pytest.raises(RuntimeError, match="simulated"):
        main(eval_sweep_argv(checkpoint, texts, out))
    partial = json.loads((out / "results.json").read_text())
    assert partial["complete"] is False and "simulated" in partial["error"]
    kept = {(r["method"], r["length"]) for r in partial["results"]}
    assert kept == {(m, n) for m in ("none", "linear x2") for n in EVAL_SWEEP_LENGTHS}
    assert partial["missing_cells"] == [f"{m} @ {n}" for m in ("ntk x2", "yarn x2") for n in EVAL_SWEEP_LENGTHS]
    windows = {r["length"]: r["windows"] for r in partial["results"] if r["method"] == "none"}
    assert len(forwards) == 2 * sum(windows.values())

    monkeypatch.setattr(MethodConfig, "apply", real_apply)
    forwards.clear()
    assert main(eval_sweep_argv(checkpoint, texts, out)) == 0  # the same command, no --overwrite
    resumed = json.loads((out / "results.json").read_text())
    assert resumed["complete"] is True and resumed["error"] is None and resumed["missing_cells"] == []
    assert len(forwards) == 2 * sum(windows.values())  # ntk and yarn only
    assert (resumed["runtime"]["cells_computed"], resumed["runtime"]["cells_cached"]) == (4, 4)
    assert not (tmp_path / ".out.cells").exists()  # the output is complete: its cells go

    # The resumed table is the table of one uninterrupted run.
    assert main(eval_sweep_argv(checkpoint, texts, tmp_path / "fresh", "--no-cache")) == 0
    fresh = json.loads((tmp_path / "fresh" / "results.json").read_text())
    assert [(r["method"], r["length"], r["nll_sum"]) for r in resumed["results"]] == [
        (r["method"], r["length"], r["nll_sum"]) for r in fresh["results"]
    ]
    assert (out / "table.txt").read_text() == (tmp_path / "fresh" / "table.txt").read_text()


def test_a_complete_output_is_not_replaced_without_overwrite(checkpoint, texts, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(eval_sweep_argv(checkpoint, texts, out, "--no-cache")) == 0
    assert main(eval_sweep_argv(checkpoint, texts, out, "--no-cache")) == 2
    assert "already exists" in capsys.readouterr().err


def test_a_shared_cache_dir_grows_a_table_without_recomputing(checkpoint, texts, tmp_path, forwards):
    cells = tmp_path / "cells"
    assert main(eval_sweep_argv(checkpoint, texts, tmp_path / "one", "--cache-dir", str(cells))) == 0
    first = len(forwards)
    forwards.clear()
    assert main(eval_sweep_argv(checkpoint, texts, tmp_path / "two", "--cache-dir", str(cells))) == 0
    assert first > 0 and forwards == []
    two = json.loads((tmp_path / "two" / "results.json").read_text())
    assert all(r["cached"] for r in two["results"]) and len(list(cells.glob("*.json"))) == 8
