"""`ctxext tasks` gives lm-eval's own results: the same scores and the same answers, sample by sample, as
`lm_eval.simple_evaluate` on HFLM over the model unpatched and patched with `ctxext.patch`; its cache resumes;
bad input is one line, exit code 2, nothing written."""

import json
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("lm_eval")

from ctxext.cli import main  # noqa: E402
from tests.helpers import save_smollm2_llama  # noqa: E402

LENGTH = 4096
LIMIT = 2


@pytest.fixture(scope="module")
def ruler_checkpoint(tmp_path_factory, smollm2_path):
    """A random 2-layer LLaMA (L = 2048) with SmolLM2's tokenizer, which RULER needs to size its prompts.

    Its attention weights are large (std 0.3, not 0.02), so attention is sharp and depends on positions:
    plain RoPE and YaRN x2 then answer differently at 4096, and the comparison below can tell them apart
    (with the usual small init every method gives the same text). Its scores are 0, so the samples'
    answers carry the test.
    """
    return save_smollm2_llama(tmp_path_factory.mktemp("ruler-tiny"), smollm2_path, 2048, attention_std=0.3)


def lm_eval_reference(checkpoint, method: str | None, task_manager) -> dict:
    """What a user of lm-eval gets: HFLM over the model (patched with ctxext.patch, or not) and simple_evaluate
    with RULER's metadata, through lm-eval's own TaskManager (not ctxext's copies of one)."""
    import lm_eval
    from lm_eval.models.huggingface import HFLM
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import ctxext

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    if method is not None:
        ctxext.patch(model, method, factor=2)
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    lm = HFLM(pretrained=model, tokenizer=tokenizer, max_length=LENGTH + 256)
    return lm_eval.simple_evaluate(model=lm, tasks=["niah_single_1"], limit=LIMIT, task_manager=task_manager)


def tasks_args(checkpoint, tmp_path, *extra):
    return [
        "tasks",
        str(checkpoint),
        "--method",
        "yarn",
        "--factor",
        "2",
        "--tasks",
        "niah_single_1",
        "--lengths",
        str(LENGTH),
        "--limit",
        str(LIMIT),
        "--dtype",
        "fp32",
        "--no-progress",
        "--cache-dir",
        str(tmp_path / "cells"),
        *extra,
    ]


@pytest.mark.slow  # `make test-slow`: CI's second step
def test_same_results_and_answers_as_lm_eval_then_resumes_from_the_cache(ruler_checkpoint, tmp_path, monkeypatch):
    assert main(tasks_args(ruler_checkpoint, tmp_path, "-o", str(tmp_path / "out"))) == 0
    ours = json.loads((tmp_path / "out" / "results.json").read_text())
    assert [(c["method"], c["task"], c["length"]) for c in ours["cells"]] == [
        ("none", "niah_single_1", LENGTH),
        ("yarn x2", "niah_single_1", LENGTH),
    ]

    import lm_eval.tasks
    from lm_eval.tasks import TaskManager

    # What simple_evaluate(metadata=...) builds itself, built once for both calls and indexing RULER's own folder
    # only (the whole index takes 20 s here; the task's YAML is the same file).
    task_manager = TaskManager(
        include_defaults=False,
        include_path=str(Path(lm_eval.tasks.__file__).parent / "ruler"),
        metadata={"max_seq_lengths": [LENGTH], "tokenizer": str(ruler_checkpoint), "pretrained": str(ruler_checkpoint)},
    )
    answers = {}
    for cell, method in zip(ours["cells"], [None, "yarn"]):
        reference = lm_eval_reference(ruler_checkpoint, method, task_manager)
        assert cell["lm_eval"]["results"] == reference["results"]  # lm-eval's results dict, verbatim
        samples = cell["lm_eval"]["samples"]["niah_single_1"]
        expected = reference["samples"]["niah_single_1"]
        assert len(samples) == len(expected) == LIMIT
        for got, want in zip(samples, expected):
            assert (got["doc_id"], got["doc_hash"], got["prompt_hash"]) == (
                want["doc_id"],
                want["doc_hash"],
                want["prompt_hash"],
            )  # the same prompts
            assert got["response"] == want["filtered_resps"][0]
            assert got["metrics"] == {str(LENGTH): want[str(LENGTH)]}
        # The table's number is the mean of lm-eval's per-sample scores.
        score = next(r["value"] for r in ours["scores"] if r["method"] == cell["method"])
        assert score == pytest.approx(sum(s[str(LENGTH)] for s in expected) / LIMIT)
        answers[cell["method"]] = [s["response"] for s in samples]
    assert answers["none"] != answers["yarn x2"]  # the patch reached the model lm-eval ran
    # The random model scores 0 at the shortest length: no effective length, and the reason is given.
    (panel,) = ours["effective_length"]["panels"]
    assert panel["threshold"] is None and "no positive score of 'none' at 4096" in panel["note"]
    assert (tmp_path / "out" / "tasks.png").stat().st_size > 0
    csv_lines = (tmp_path / "out" / "results.csv").read_text().splitlines()
    assert csv_lines[0].startswith("method,task,length,metric,value") and len(csv_lines) == 3

    # Cached cells are read back, not run again: lm-eval is not called; a method not yet run is '-'.
    import lm_eval

    def not_called(*args, **kwargs):
        raise AssertionError("a cached cell ran again")

    monkeypatch.setattr(lm_eval, "simple_evaluate", not_called)
    args = tasks_args(ruler_checkpoint, tmp_path, "--method", "ntk", "--cached-only", "-o", str(tmp_path / "again"))
    assert main(args) == 0
    again = json.loads((tmp_path / "again" / "results.json").read_text())
    assert [c["lm_eval"] for c in again["cells"][:2]] == [c["lm_eval"] for c in ours["cells"]]
    assert [c["cached"] for c in again["cells"]] == [True, True, False]
    assert again["missing_cells"] == ["ntk x2 | niah_single_1 | 4096"]
    table = (tmp_path / "again" / "table.txt").read_text().splitlines()
    assert table[-2].split() == ["ntk", "x2", "-"]
    assert table[-1].startswith("effective length: - (no positive score of 'none' at 4096")


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--tasks", "niah_singel_1"], "unknown lm-eval task 'niah_singel_1' (did you mean 'niah_single_1'?)"),
        (["--tasks", "niah_single_1", "--lengths", "0"], "--lengths values must be at least 2 tokens"),
        (
            ["--tasks", "niah_single_1", "--lengths", "512"],
            "RULER tasks (niah_single_1) need --lengths of at least 1024",
        ),
        (["--tasks", "niah_single_1", "--limit", "0"], "--limit must be at least 1"),
        (
            ["--tasks", "niah_single_2"],
            "needs data that could not be fetched: Couldn't reach 'baber/paul_graham_essays'",
        ),
        (["--tasks", "ruler_qa_squad"], "needs data that could not be fetched: https://rajpurkar.github.io/"),
        (["--tasks", "niah_single_1", "--method", "yarn", "--fator", "2"], "did you mean 'factor'"),
        (["--tasks", "niah_single_1"], "install it with: pip install 'ctxext[tasks]'"),
    ],
    ids=[
        "unknown task",
        "length below 1",
        "RULER length too short",
        "limit 0",
        "essay haystack offline",
        "SQuAD offline",
        "method flag typo",
        "lm-eval missing",
    ],
)
def test_bad_input_is_one_line_exit_2_and_writes_nothing(
    extra, message, ruler_checkpoint, tmp_path, monkeypatch, capsys, request
):
    if request.node.callspec.id == "lm-eval missing":
        monkeypatch.setitem(sys.modules, "lm_eval", None)  # `import lm_eval` now fails as if it were absent
    monkeypatch.setenv("CTXEXT_CACHE_DIR", str(tmp_path / "cache"))
    code = main(["tasks", str(ruler_checkpoint), *extra, "-o", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert err.startswith("ctxext tasks: error: ") and "\n" not in err, err
    assert message in err
    assert list(tmp_path.iterdir()) == []


def test_each_length_reaches_the_task_while_the_task_index_is_shared(ruler_checkpoint):
    from ctxext.tasks.harness import TaskManagers, TaskSpec, task_metadata

    managers = TaskManagers()
    spec = TaskSpec("niah_single_1", "ruler")
    for length in (1024, 2048):
        manager = managers.get(task_metadata(spec, length, str(ruler_checkpoint)))
        docs = manager.load(["niah_single_1"])["tasks"]["niah_single_1"].eval_docs
        assert {doc["max_length"] for doc in docs} == {length}  # lm-eval's record of the length it built
        assert max(doc["length"] for doc in docs) <= length


def test_the_task_index_of_the_named_tasks_builds_what_lm_evals_whole_index_builds(ruler_checkpoint):
    """Named tasks get an index of the folders that define them (RULER's), which builds the same prompts as lm-eval's
    whole index; a group or a misspelt name gets the whole index (the did-you-mean needs it)."""
    from ctxext.tasks.harness import (
        TaskManagers,
        TaskSpec,
        _seed_like_simple_evaluate,
        needle_samples_up_to,
        task_metadata,
    )

    spec = TaskSpec("niah_single_1", "ruler")
    narrow, whole = TaskManagers(["niah_single_1", "ruler_vt"]), TaskManagers()
    assert [Path(folder).name for folder in narrow.folders] == ["ruler"] and whole.folders is None
    assert TaskManagers(["ruler"]).folders is None and TaskManagers(["niah_singel_1"]).folders is None
    assert len(narrow.any().all_tasks) < 100 < len(whole.any().all_tasks)

    def build(managers):
        manager = managers.get(task_metadata(spec, 1024, str(ruler_checkpoint)))
        _seed_like_simple_evaluate()
        with needle_samples_up_to(spec, 3):
            return list(manager.load(["niah_single_1"])["tasks"]["niah_single_1"].eval_docs)

    assert build(narrow) == build(whole)


def test_a_limit_builds_only_the_first_needle_samples_of_lm_evals_500(ruler_checkpoint):
    """Under a limit, RULER's needle task builds only the samples the limit takes, and they are the first ones of
    lm-eval's own build of 500 (seeded as simple_evaluate seeds), prompt for prompt."""
    from ctxext.tasks.harness import (
        TaskManagers,
        TaskSpec,
        _seed_like_simple_evaluate,
        needle_samples_up_to,
        task_metadata,
    )

    spec = TaskSpec("niah_single_1", "ruler")
    manager = TaskManagers().get(task_metadata(spec, 1024, str(ruler_checkpoint)))

    def build():
        _seed_like_simple_evaluate()
        return list(manager.load(["niah_single_1"])["tasks"]["niah_single_1"].eval_docs)

    with needle_samples_up_to(spec, 3):
        capped = build()
    whole = build()  # outside the context: lm-eval's generator as it is
    assert len(capped) == 3 and len(whole) == 500
    assert capped == whole[:3]
    assert [doc["max_length"] for doc in capped] == [1024] * 3


def test_scores_keep_the_cells_length_and_every_metric_of_other_tasks():
    from ctxext.eval.runner import EvalMethod
    from ctxext.tasks.harness import Cell, TaskSpec, cell_scores
    from ctxext.tasks.report import score_tables

    # The shape lm-eval 0.4.13 gives: a RULER task run at 8192 still reports its other lengths as -1.
    ruler = Cell(
        EvalMethod("yarn x2"),
        TaskSpec("niah_single_1", "ruler"),
        8192,
        result={
            "results": {
                "niah_single_1": {
                    "alias": "niah_single_1",
                    "sample_len": 3,
                    "4096,none": -1,
                    "4096_stderr,none": "N/A",
                    "8192,none": 2 / 3,
                    "8192_stderr,none": "N/A",
                }
            }
        },
    )
    other = Cell(
        EvalMethod("none"),
        TaskSpec("hellaswag", None),
        None,
        result={
            "results": {
                "hellaswag": {"alias": "hellaswag", "acc,none": 0.25, "acc_stderr,none": 0.1, "acc_norm,none": 0.5}
            }
        },
        cached=True,
    )
    rows = cell_scores(ruler) + cell_scores(other)
    assert [
        (r["method"], r["task"], r["length"], r["metric"], r["value"], r["samples"], r["cached"]) for r in rows
    ] == [
        ("yarn x2", "niah_single_1", 8192, "score", 2 / 3, 3, False),
        ("none", "hellaswag", None, "acc", 0.25, None, True),
        ("none", "hellaswag", None, "acc_norm", 0.5, None, True),
    ]
    tables = score_tables(rows, ["none", "yarn x2"], [4096, 8192]).split("\n\n")
    assert len(tables) == 3  # one per (task, metric)
    # Every asked-for length is a column of a task that takes lengths, run or not; '-' where nothing ran.
    assert tables[0].splitlines()[0].split()[-2:] == ["4k", "8k"]
    assert tables[0].splitlines()[2].split() == ["none", "-", "-"]
    assert tables[0].splitlines()[3].split() == ["yarn", "x2", "-", "0.667"]
    assert tables[1].splitlines()[2].split() == ["none", "0.250"]


def test_an_interrupted_cell_resumes_at_its_next_sample(ruler_checkpoint, tmp_path, monkeypatch):
    """lm-eval's request cache stores each answer as it comes: after an interruption in the middle of a cell,
    the next run generates only the samples not yet answered, and gives the uninterrupted run's results. The
    cache is keyed by content: it resumes from a copy of itself beside a copy of the checkpoint at another path,
    with other file times (a committed cache in a fresh clone, on another machine)."""
    import shutil

    from lm_eval.api.model import CacheHook
    from lm_eval.models.huggingface import HFLM

    def args(checkpoint, cells):
        return [
            "tasks",
            str(checkpoint),
            "--tasks",
            "niah_single_1",
            "--lengths",
            str(LENGTH),
            "--limit",
            "3",
            "--dtype",
            "fp32",
            "--no-progress",
            "--cache-dir",
            str(cells),
        ]

    assert main([*args(ruler_checkpoint, tmp_path / "cells"), "--no-cache", "-o", str(tmp_path / "whole")]) == 0
    original_add = CacheHook.add_partial

    def interrupt_after_the_first_answer(self, attr, req, res):
        original_add(self, attr, req, res)
        if attr == "generate_until":
            raise KeyboardInterrupt

    monkeypatch.setattr(CacheHook, "add_partial", interrupt_after_the_first_answer)
    assert main([*args(ruler_checkpoint, tmp_path / "cells"), "-o", str(tmp_path / "first")]) == 130
    assert not (tmp_path / "first").exists()
    assert list((tmp_path / "cells" / "requests").glob("*_rank0.db"))
    monkeypatch.setattr(CacheHook, "add_partial", original_add)
    moved_checkpoint = shutil.copytree(ruler_checkpoint, tmp_path / "elsewhere" / "model", copy_function=shutil.copy)
    moved_cells = shutil.copytree(tmp_path / "cells", tmp_path / "elsewhere" / "cells")
    shutil.rmtree(tmp_path / "cells")

    generated = []
    original_generate = HFLM._model_generate

    def counting(self, *a, **k):
        generated.append(1)
        return original_generate(self, *a, **k)

    monkeypatch.setattr(HFLM, "_model_generate", counting)
    assert main([*args(moved_checkpoint, moved_cells), "-o", str(tmp_path / "resumed")]) == 0
    assert len(generated) == 2  # 3 samples, 1 answered before the interruption
    resumed = json.loads((tmp_path / "resumed" / "results.json").read_text())["cells"][0]["lm_eval"]
    whole = json.loads((tmp_path / "whole" / "results.json").read_text())["cells"][0]["lm_eval"]
    assert resumed["results"] == whole["results"]
    assert [s["response"] for s in resumed["samples"]["niah_single_1"]] == [
        s["response"] for s in whole["samples"]["niah_single_1"]
    ]
    assert not list((moved_cells / "requests").glob("*.db"))  # the finished cell's requests are dropped


def test_effective_length_is_the_longest_length_within_85_percent_of_the_unpatched_short_score(tmp_path):
    from ctxext.tasks.report import effective_lengths, plot_task_heatmap, score_tables

    def row(method, length, value, task="niah_single_1"):
        return {
            "method": method,
            "task": task,
            "length": length,
            "metric": "score",
            "value": value,
            "samples": 10,
            "seconds": 1.0,
            "cached": False,
        }

    rows = [
        row("none", 4096, 0.9),
        row("none", 8192, 0.6),
        row("none", 16384, 0.2),
        row("yarn x2", 4096, 0.95),
        row("yarn x2", 8192, 0.8),
        row("yarn x2", 16384, 0.77),
        row("dpe", 4096, 0.5),
        row("dpe", 8192, 0.9),  # not monotonic; 16k not run
        row("none", 4096, 0.0, "cwe"),
        row("yarn x2", 4096, 0.3, "cwe"),
    ]
    methods = ["none", "yarn x2", "dpe"]
    niah, cwe = effective_lengths(rows, methods)
    assert niah["threshold"] == pytest.approx(0.85 * 0.9) and niah["baseline_length"] == 4096
    assert niah["effective_length"] == {"none": 4096, "yarn x2": 16384, "dpe": 8192}  # 0.77 >= 0.765
    assert cwe["threshold"] is None and cwe["effective_length"] == {"none": None, "yarn x2": None, "dpe": None}
    table = score_tables(rows, methods, [4096, 8192, 16384]).split("\n\n")[0].splitlines()
    assert table[-1] == "effective length (score >= 85% of none at 4k = 0.765): none 4k, yarn x2 16k, dpe 8k"
    plot_task_heatmap(rows, methods, tmp_path / "tasks.png", "t")
    assert (tmp_path / "tasks.png").stat().st_size > 0
