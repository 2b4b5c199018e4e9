"""`--tp N`: the commands run on a model split by transformers' tensor parallelism (`tp_plan="auto"`) over the N
processes torchrun started, every process doing the same work and the first one writing.

The oracle: the same command in one process, no split. `ctxext eval --tp 2` under torchrun (2 CPU processes over
gloo) must write the one-process perplexities (results.json, fp32: mean NLL within 1e-5) for yarn (a frequency
method) and self_extend (an attention-level one), also resuming from cached cells, and `ctxext passkey --tp 2` the same answers token for token
(decoding through the KV cache, each process holding half of the heads). What cannot work is refused, in one line
with exit code 2, before anything is launched or loaded where it can be (the launch itself, the flags, the model's
heads), and nothing is written.
"""

import json
import subprocess
import sys

import pytest
import torch
from transformers import LlamaConfig

from ctxext.dispatch import check_tensor_parallel_model
from ctxext.errors import CtxextError
from tests.helpers import (
    REPO,
    child_process_env,
    free_port,
    run_cli,
    save_smollm2_llama,
    save_tiny_checkpoint,
    tiny_model,
    write_documents,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread_per_module")

EVAL_METHODS = ["--method", "yarn", "--factor", "2", "--method", "self_extend", "--group-size", "4", "--window", "8"]
PASSKEY_METHODS = ["--method", "rerope", "--window", "8", "--method", "dpe", "--factor", "2"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """The tiny LLaMA (4 query heads over 2 key/value heads, L = 64) with sharp attention, so positions matter."""
    model = tiny_model("llama")
    with torch.no_grad():
        for layer in model.model.layers:
            for projection in (layer.self_attn.q_proj, layer.self_attn.k_proj):
                projection.weight.normal_(0, 0.5, generator=torch.Generator().manual_seed(1))
    return save_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), model)


@pytest.fixture(scope="module")
def texts(tmp_path_factory):
    ids = torch.randint(0, 256, (400,), generator=torch.Generator().manual_seed(0))
    return write_documents(tmp_path_factory.mktemp("texts"), [ids])


def eval_args(checkpoint, texts, *extra, methods=EVAL_METHODS, cache=("--no-cache",)):
    return ["eval", checkpoint, *methods, "--lengths", "128", "--stride", "64", "--text-file", texts / "doc0.txt",
            "--dtype", "fp32", "--no-progress", *cache, *extra]  # fmt: skip


def torchrun(*argv) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
               str(free_port()), "-m", "ctxext", *[str(a) for a in argv], "--tp", "2"]  # fmt: skip
    run = subprocess.run(command, cwd=REPO, env=child_process_env(), capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return run


@pytest.mark.slow  # torchrun launches of 2 processes: about 15 s each on 2 cores
def test_eval_tp2_writes_the_single_process_perplexities(checkpoint, texts, tmp_path, capsys):
    assert run_cli(capsys, *eval_args(checkpoint, texts, "-o", tmp_path / "one"))[0] == 0
    cache = ("--cache-dir", tmp_path / "cells")  # a first run keeps none and yarn; the second computes self_extend
    torchrun(*eval_args(checkpoint, texts, "-o", tmp_path / "first", methods=EVAL_METHODS[:4], cache=cache))
    launched = torchrun(*eval_args(checkpoint, texts, "-o", tmp_path / "two", cache=cache))
    assert launched.stdout.count("results:") == 1  # the first process alone prints and writes
    assert "2 of 3 cells from the cache" in launched.stdout  # every process skipped the same cells
    one, two = (json.loads((tmp_path / name / "results.json").read_text()) for name in ("one", "two"))
    assert (two["runtime"]["processes"], two["runtime"]["tensor_parallel"]) == (2, 2)
    assert two["model"]["tensor_parallel"] == 2
    assert [r["method"] for r in two["results"]] == ["none", "yarn x2", "self_extend G4 w8"]
    for a, b in zip(one["results"], two["results"], strict=True):  # every process scored every window
        assert (a["method"], a["tokens_scored"], a["windows"], a["tokens_sha256"]) == (
            b["method"], b["tokens_scored"], b["windows"], b["tokens_sha256"])  # fmt: skip
        assert b["mean_nll"] == pytest.approx(a["mean_nll"], abs=1e-5)
        assert b["perplexity"] == pytest.approx(a["perplexity"], rel=1e-5)
    none = one["results"][0]["mean_nll"]
    assert all(abs(row["mean_nll"] - none) > 1e-3 for row in one["results"][1:])  # both methods act at 128 > L


@pytest.mark.slow
def test_passkey_tp2_gives_the_single_process_answers(checkpoint, tmp_path, capsys):
    args = ["passkey", checkpoint, *PASSKEY_METHODS, "--lengths", "128", "--passkey-depths", "0.5",
            "--passkey-trials", "2", "--dtype", "fp32", "--no-progress"]  # fmt: skip
    assert run_cli(capsys, *args, "-o", tmp_path / "one")[0] == 0
    torchrun(*args, "-o", tmp_path / "two")
    one, two = (json.loads((tmp_path / name / "results.json").read_text())["trials"] for name in ("one", "two"))
    assert len(one) == 6
    assert [(t["method"], t["output"]) for t in two] == [(t["method"], t["output"]) for t in one]


@pytest.mark.slow
def test_search_tp2_runs_the_single_process_trials(checkpoint, texts, tmp_path, capsys):
    documents = write_documents(tmp_path / "docs", [torch.randint(0, 256, (200,), generator=torch.Generator().manual_seed(i)) for i in range(3)])  # fmt: skip
    args = ["search", checkpoint, "--method", "self_extend", "--factor", "2", "--lengths", "128", "--text-file",
            documents, "--trials", "4", "--dtype", "fp32", "--no-progress", "--no-checkpoint"]  # fmt: skip
    assert run_cli(capsys, *args, "-o", tmp_path / "one")[0] == 0
    launched = torchrun(*args, "-o", tmp_path / "two")
    assert launched.stdout.count("results:") == 1
    one, two = ([json.loads(line) for line in (tmp_path / name / "trials.jsonl").read_text().splitlines()] for name in ("one", "two"))  # fmt: skip
    assert [t["params"] for t in two] == [t["params"] for t in one]  # the same proposals from the same scores
    for a, b in zip(one, two, strict=True):
        assert b["value"] == pytest.approx(a["value"], rel=1e-5)
    held = [json.loads((tmp_path / name / "results.json").read_text())["held_out"]["perplexity"] for name in ("one", "two")]  # fmt: skip
    assert held[1] == pytest.approx(held[0], rel=1e-5)


@pytest.mark.slow  # RULER's needle at 4096 with SmolLM2's tokenizer, one process and 2 (about 70 s)
def test_tasks_tp2_gives_the_single_process_answers(smollm2_path, tmp_path, capsys):
    """Every process is lm-eval's rank 0 and answers every request on its half of the heads; the first writes."""
    checkpoint = save_smollm2_llama(tmp_path / "ruler-tiny", smollm2_path, 2048, attention_std=0.3)
    args = ["tasks", checkpoint, "--method", "yarn", "--factor", "2", "--tasks", "niah_single_1", "--lengths",
            "4096", "--limit", "2", "--dtype", "fp32", "--no-progress"]  # fmt: skip
    assert run_cli(capsys, *args, "--cache-dir", tmp_path / "c1", "-o", tmp_path / "one")[0] == 0
    launched = torchrun(*args, "--cache-dir", tmp_path / "c2", "-o", tmp_path / "two")
    assert launched.stdout.count("results:") == 1
    one, two = (json.loads((tmp_path / name / "results.json").read_text()) for name in ("one", "two"))
    assert (two["runtime"]["processes"], two["runtime"]["tensor_parallel"]) == (2, 2)
    cells = [sorted((tmp_path / name).glob("*.json")) for name in ("c1", "c2")]
    assert [c.name for c in cells[1]] == [c.name for c in cells[0]] and len(cells[0]) == 2  # none and yarn
    for a, b in zip(*cells):
        want, got = (json.loads(c.read_text())["result"] for c in (a, b))
        assert got["samples"] == want["samples"]  # the same prompts, answers and scores, sample by sample
        assert got["results"] == want["results"]


@pytest.mark.parametrize(
    "extra,env,message",
    [
        (["--tp", "2"], {}, "--tp 2 splits the model over 2 processes, but this one was not launched: use torchrun"),
        (["--tp", "2"], {"WORLD_SIZE": "3"}, "--tp 2, but 3 processes were launched (WORLD_SIZE)"),
        (["--tp", "2", "--device-map", "auto"], {}, "--tp 2 and --device-map both say where the model goes"),
        (["--tp", "4"], {}, "--tp 4: the model has 2 key/value heads, which do not split evenly over 4 processes"),
        (["--tp", "0"], {}, "--tp must be a whole number >= 1, got 0"),
        (["--tp", "2", "--device", "mps"], {}, "--device mps cannot be honoured: drop --device"),
    ],
)
def test_what_tensor_parallelism_cannot_take_is_one_line_exit_2(
    checkpoint, texts, tmp_path, capsys, monkeypatch, extra, env, message
):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    code, out, err = run_cli(capsys, *eval_args(checkpoint, texts, "-o", tmp_path / "out", *extra))
    assert code == 2
    assert message in err
    assert len(err.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()


def test_a_family_without_a_tensor_parallel_plan_is_refused():
    config = LlamaConfig(num_attention_heads=4, num_key_value_heads=2, hidden_size=64)
    check_tensor_parallel_model(2, config)  # LLaMA has one
    config.base_model_tp_plan = None
    with pytest.raises(CtxextError, match="transformers has no tensor-parallel plan for model type 'llama'"):
        check_tensor_parallel_model(2, config)


@pytest.mark.parametrize(
    "argv,message",
    [
        (["search", "--method", "yarn", "--factor", "2", "--lengths", "128", "--trials", "2", "--workers", "2"],
         "--tp 2 and --workers 2: each worker loads a model of its own"),
        (["search", "--method", "dpe", "--factor", "2", "--lengths", "128", "--trials", "2", "--select-pairs", "TEXT",
          "--top-pairs", "2"], "--tp 2 and --select-pairs: DPE's selection averages"),
        (["compare", "--lengths", "128"], "--tp 2: compare shares its cells among the launched processes"),
    ],
)  # fmt: skip
def test_commands_that_cannot_run_tensor_parallel_yet_say_why(checkpoint, texts, tmp_path, capsys, argv, message):
    argv = [argv[0], checkpoint, *[texts / "doc0.txt" if a == "TEXT" else a for a in argv[1:]]]
    data = [] if argv[0] == "tasks" else ["--text-file", texts]
    code, _, err = run_cli(capsys, *argv, *data, "--tp", "2", "-o", tmp_path / "out")
    assert (code, len(err.strip().splitlines())) == (2, 1), err
    assert message in err
    assert not (tmp_path / "out").exists()


def test_check_model_says_whether_a_model_splits(checkpoint, capsys):
    check = ["check", "--model", checkpoint, "--method", "rerope", "--implementations", "eager", "--lengths", ""]
    code, out, _ = run_cli(capsys, *check, "--tp", "2")
    assert code == 0
    assert "splits over 2 processes" in out
    code, _, err = run_cli(capsys, "check", "--model", checkpoint, "--tp", "4")
    assert code == 2
    assert "--tp 4: the model has 2 key/value heads" in err
