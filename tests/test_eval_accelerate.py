"""`accelerate launch` with 2 CPU processes (gloo) gives the same perplexities as 1 process."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ctxext.cli import main
from tests.helpers import save_smollm2_llama, write_hamlet_texts

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory, smollm2_path):
    return save_smollm2_llama(tmp_path_factory.mktemp("tiny"), smollm2_path, 256, tie_word_embeddings=True)


@pytest.fixture(scope="module")
def texts(tmp_path_factory):
    return write_hamlet_texts(tmp_path_factory.mktemp("texts"))


@pytest.mark.slow  # `make test-slow`: CI's second step
def test_two_processes_match_one(tiny_checkpoint, texts, tmp_path):
    args = [
        "eval",
        str(tiny_checkpoint),
        "--method",
        "yarn",
        "--factor",
        "2",
        "--lengths",
        "256",
        "--stride",
        "128",
        "--text-file",
        str(texts / "a.txt"),
        "--dtype",
        "fp32",
        "--no-progress",
    ]
    assert main(args + ["-o", str(tmp_path / "one")]) == 0
    # On a machine without GPUs, accelerate starts several processes only with --multi_gpu (torchrun);
    # ctxext then joins them with gloo on the CPU.
    launched = subprocess.run(
        [
            sys.executable,
            "-m",
            "accelerate.commands.launch",
            "--multi_gpu",
            "--num_processes",
            "2",
            "--num_machines",
            "1",
            "--mixed_precision",
            "no",
            "--dynamo_backend",
            "no",
            "-m",
            "ctxext",
            *args,
            "-o",
            str(tmp_path / "two"),
        ],
        cwd=REPO,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
    )
    assert launched.returncode == 0, launched.stderr[-3000:]
    one = json.loads((tmp_path / "one" / "results.json").read_text())
    two = json.loads((tmp_path / "two" / "results.json").read_text())
    assert (one["runtime"]["processes"], two["runtime"]["processes"]) == (1, 2)
    assert launched.stdout.count("results:") == 1  # only the main process reports and writes
    for a, b in zip(one["results"], two["results"], strict=True):
        assert (a["method"], a["length"], a["tokens_scored"], a["windows"]) == (
            b["method"],
            b["length"],
            b["tokens_scored"],
            b["windows"],
        )
        # Each window is computed identically on either process, and fsum makes the total order-free.
        assert abs(a["nll_sum"] - b["nll_sum"]) <= 1e-9 * abs(a["nll_sum"])
