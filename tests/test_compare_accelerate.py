"""`accelerate launch` with 2 CPU processes (gloo) shares a compare's cells and gives the table of 1 process."""

import collections
import json
import os
import subprocess
import sys

import pytest

from ctxext.compare import run_compare
from tests.helpers import REPO, compare_request, compare_table, free_port, write_compare_inputs


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_compare_inputs(tmp_path_factory.mktemp("compare"))


def cell_processes(cells, blocks: bool = False) -> collections.Counter:
    """How many cell files each process rank wrote (None: a cell that records no process); the stages' cells, or
    with `blocks` the decide stage's further passkey blocks (the main process computes those)."""
    records = [json.loads(path.read_text()) for path in cells.glob("*.json")]
    return collections.Counter(
        (r.get("process") or {}).get("rank") for r in records if bool(r["key"].get("block")) == blocks
    )


@pytest.mark.slow  # `make test-slow`: CI's second step
def test_two_processes_share_the_cells_and_give_the_table_of_one(tiny, tmp_path, one_torch_thread):
    methods = "yarn,rerope"
    run_compare(compare_request(tiny, "qwen3", tmp_path / "one", methods=methods.split(",")))
    args = [str(tiny["models"]["qwen3"]), "--lengths", "128", "--text-file", str(tiny["docs"]), "--method",
            methods, "--held-out-docs", "2", "--trials", "2", "--device", "cpu", "--dtype", "fp32",
            "--no-progress", "-o", str(tmp_path / "two")]  # fmt: skip
    # As tests/test_eval_accelerate.py: without GPUs, accelerate starts several processes only with --multi_gpu
    # (torchrun); ctxext then joins them with gloo on the CPU.
    launched = subprocess.run(
        [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
         "--num_machines", "1", "--main_process_port", str(free_port()), "--mixed_precision", "no", "--dynamo_backend", "no", "-m", "ctxext", "compare",
         *args],
        cwd=REPO,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=900,
    )  # fmt: skip
    assert launched.returncode == 0, launched.stderr[-3000:]
    one = json.loads((tmp_path / "one" / "results.json").read_text())
    two = json.loads((tmp_path / "two" / "results.json").read_text())
    assert (one["processes"], two["processes"]) == (1, 2)
    # perplexities, passkey, searched configs, searches
    assert compare_table(tmp_path / "two") == compare_table(tmp_path / "one")
    for same in ("failed", "missing", "effective_length", "documents"):
        assert two[same] == one[same], same
    assert launched.stdout.count("report:") == 1  # only the main process reports and writes

    # Both processes computed cells, split by their index alone (the main process measures a stage only after the
    # other has written its share; before, a main process that finished first computed the other's unwritten
    # cells too, and the split followed the load: 9 against 5): each cell once, on rank 0 or 1, in near-equal shares
    # (a stage of an odd count gives rank 0 one more); a single process's cells record no process.
    by_rank = cell_processes(tmp_path / "two" / "cells")
    assert set(by_rank) == {0, 1}, by_rank
    assert abs(by_rank[0] - by_rank[1]) <= 2, by_rank
    blocks = cell_processes(tmp_path / "two" / "cells", blocks=True)
    assert set(blocks) <= {0}  # the decide stage runs on the main process
    one_cells = cell_processes(tmp_path / "one" / "cells") + cell_processes(tmp_path / "one" / "cells", blocks=True)
    assert sum(by_rank.values()) + sum(blocks.values()) == sum(one_cells.values())
    assert set(one_cells) == {None}
    # each process logs the cells it computes: no cell was computed twice (the file keeps the last writer's rank)
    assert launched.stdout.count("[process 0 of 2]") == by_rank[0] + blocks[0], launched.stdout
    assert launched.stdout.count("[process 1 of 2]") == by_rank[1]
    assert not (tmp_path / "two" / ".processes").exists()  # the wait files are gone
