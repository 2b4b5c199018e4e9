"""Sequence parallelism (recipe key parallel.sp_size; DeepSpeed ALST/Ulysses through accelerate) as 2 CPU processes
over gloo, against the same recipe as one process without it.

The oracle is the one-process run: the sequence's mean loss and every LoRA gradient of one micro-batch must be the
same when two processes each hold half the sequence (`GRAD_TOLERANCE`), and a short `ctxext finetune` run must
log the same losses. The sequence is 128 tokens on a model with L = 64, so the first process's slice ends exactly
at L: a rule that read the length from the slice (dynamic NTK's base, longrope's short or long factors) would
rotate it as a short sequence and the second as a long one (the global-length trap); the whole length must reach
both (ctxext.patching.rotary.whole_sequence_length). self_extend runs as Ulysses' core attention (ctxext's own
attention function on the whole sequence, for half of the heads on each process).
"""

import importlib.util
import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from ctxext.cli import main as ctxext_main
from ctxext.errors import CtxextError
from ctxext.train.recipe import load_recipe
from ctxext.train.sequence_parallel import check_model
from tests.helpers import (
    assert_same_numbers,
    child_process_env,
    free_port,
    read_metrics,
    save_bpe_llama,
    tiny_model,
    write_recipe,
)

REPO = Path(__file__).resolve().parents[1]
pytestmark = [
    pytest.mark.usefixtures("one_torch_thread_per_module"),
    pytest.mark.skipif(
        importlib.util.find_spec("deepspeed") is None,
        reason="DeepSpeed is not installed: pip install 'ctxext[deepspeed]'",
    ),
]
ROTARY_PAIRS = 8  # the tiny LLaMA's head_dim 16
METHODS = {
    "yarn": {"method": "yarn", "factor": 2},
    "dynamic_ntk": {"method": "dynamic_ntk", "factor": 2},
    "longrope": {
        "method": "longrope",
        "factor": 2,
        "short_factor": [1.0] * ROTARY_PAIRS,
        "long_factor": [1.0 + 0.25 * i for i in range(ROTARY_PAIRS)],
    },
    "self_extend": {"method": "self_extend", "group_size": 2, "window": 16, "factor": 2},
}
# One micro-batch of one 128-token sequence; no dropout, so the runs differ only in how the work is split.
CHANGES = {
    "seq_len": 128,
    "train__global_batch_size": 1,
    "train__micro_batch_size": 1,
    "train__checkpoint_every": 0,
    "lora__dropout": 0.0,
    "eval__lengths": [128, 64],
}
GRAD_TOLERANCE = 1e-5  # relative to the largest gradient of the tensor (fp32)
LOSS_TOLERANCE = 1e-5

# The gradient probe: ctxext's own setup and step function, one micro-batch, every trainable gradient saved.
PROBE = textwrap.dedent("""
    import sys, torch
    from ctxext.train.recipe import load_recipe
    from ctxext.train.setup import prepare, prepare_training
    from ctxext.train.batches import micro_batch
    from ctxext.train.loop import forward_loss

    setup = prepare(load_recipe(sys.argv[1]), resume=False, progress=False)
    model, _ = prepare_training(setup)
    accelerator = setup.runtime.accelerator
    unwrapped = accelerator.unwrap_model(model)
    model.train()
    loss, sequence_loss = forward_loss(setup, model, unwrapped, micro_batch(setup, 0, 0))
    if setup.runtime.sharded:  # DeepSpeed's own backward: accelerator.backward would also take the step
        from deepspeed.utils import safe_get_full_grad
        model.backward(loss)
        grads = {n: safe_get_full_grad(p) for n, p in unwrapped.named_parameters() if p.requires_grad}
    else:
        accelerator.backward(loss)
        grads = {n: p.grad for n, p in unwrapped.named_parameters() if p.requires_grad}
    if accelerator.is_main_process:
        torch.save({"loss": float(sequence_loss), "grads": {n: g.detach().clone() for n, g in grads.items()}},
                   sys.argv[2])
    accelerator.wait_for_everyone()
    accelerator.end_training()  # the process group closed before exit, as ctxext finetune closes it
""")


def accelerate_launch(*command: str, config: str = "deepspeed-zero2-cpu.yaml") -> subprocess.CompletedProcess:
    """`accelerate launch --config_file configs/accelerate/CONFIG COMMAND` as 2 CPU processes."""
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "accelerate.commands.launch",
            "--config_file",
            f"configs/accelerate/{config}",
            "--main_process_port",
            str(free_port()),
            *command,
        ],
        cwd=REPO,
        env=child_process_env(DS_ACCELERATOR="cpu"),
        capture_output=True,
        text=True,
        timeout=600,  # the first DeepSpeed run on a machine compiles its shared-memory op (about a minute)
    )


def probe(folder: Path, recipe: Path, launched: str | bool) -> dict:
    """The loss and gradients of the recipe's first micro-batch: one plain process (False), or 2 launched with the
    DeepSpeed config `launched`."""
    script, out = folder / "probe.py", folder / "probe.pt"
    script.write_text(PROBE)
    if launched:
        result = accelerate_launch(str(script), str(recipe), str(out), config=launched)
    else:
        result = subprocess.run(
            [sys.executable, str(script), str(recipe), str(out)],
            cwd=REPO,
            env=child_process_env(),
            capture_output=True,
            text=True,
            timeout=300,
        )
    assert result.returncode == 0, result.stderr[-3000:]
    return torch.load(out)


def assert_same_gradients(got: dict, want: dict) -> None:
    """Every trainable tensor's gradient, to GRAD_TOLERANCE of its largest entry. LoRA's A matrices have none at
    the first step (B starts at zero); every other trainable tensor must have one."""
    assert got["grads"].keys() == want["grads"].keys()
    assert any("lora_B" in name for name in want["grads"])
    for name, expected in want["grads"].items():
        scale = expected.abs().max().item()
        assert scale > 0 or "lora_A" in name, name
        difference = (got["grads"][name] - expected).abs().max().item()
        assert difference <= GRAD_TOLERANCE * scale, (name, difference, scale)


# (method, recipe changes, DeepSpeed config) of each gradient case: the four methods under ZeRO-2; an
# attention-level method with gradient checkpointing (Ulysses' exchange recomputed) under ZeRO-3, whose
# gradient reduction differs from ZeRO-2's (sequence_parallel.zero3_gradient_factor); PoSE's gapped positions
# (its longest position is the length) and a mixed-window run's long micro-batch (whose first slice lies within L,
# where the original rotary would answer), each with a length-dependent method; and a micro-batch of two sequences
# (each process's slice of several rows).
CASES = {
    **{name: (name, {}, "deepspeed-zero2-cpu.yaml") for name in METHODS},
    "self_extend-checkpointing-zero3": (
        "self_extend",
        {"train__gradient_checkpointing": True},
        "deepspeed-zero3-cpu.yaml",
    ),
    "dynamic_ntk-pose": (
        "dynamic_ntk",
        {"pose": {"enabled": True, "train_window": 64, "num_chunks": 2}},
        "deepspeed-zero2-cpu.yaml",
    ),
    "longrope-mixed_window": ("longrope", {"mixed_window": {"enabled": True}}, "deepspeed-zero2-cpu.yaml"),
    "yarn-two-sequences": (
        "yarn",
        {"train__global_batch_size": 2, "train__micro_batch_size": 2},
        "deepspeed-zero2-cpu.yaml",
    ),
}


@pytest.mark.slow  # per case: one process, then 2 under DeepSpeed (about 25 s on 2 cores)
@pytest.mark.parametrize("case", list(CASES))
def test_two_processes_each_holding_half_the_sequence_give_the_one_process_gradients(
    case, finetune_checkpoint, finetune_texts, tmp_path
):
    method, changes, config = CASES[case]
    changes = {**CHANGES, **changes, "method": METHODS[method]}
    whole = write_recipe(tmp_path, finetune_checkpoint, finetune_texts, tmp_path / "one", **changes)
    split = write_recipe(
        tmp_path, finetune_checkpoint, finetune_texts, tmp_path / "two", parallel={"sp_size": 2}, **changes
    )
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    want = probe(tmp_path / "a", whole, launched=False)
    got = probe(tmp_path / "b", split, launched=config)
    assert abs(got["loss"] - want["loss"]) <= LOSS_TOLERANCE * abs(want["loss"])
    assert_same_gradients(got, want)


@pytest.mark.slow  # 4 steps as one process, then as 2 under DeepSpeed (about 40 s)
def test_a_short_finetune_with_sp_2_logs_the_one_process_losses(finetune_checkpoint, finetune_texts, tmp_path):
    changes = {**CHANGES, "train__max_steps": 4, "eval__every": 2, "optim": {"lr": 1e-3, "warmup_steps": 2}}
    one = tmp_path / "one"
    recipe = write_recipe(tmp_path, finetune_checkpoint, finetune_texts, one, method=METHODS["yarn"], **changes)
    assert ctxext_main(["finetune", "--recipe", str(recipe), "--no-progress"]) == 0
    two = tmp_path / "two"
    recipe = write_recipe(
        tmp_path, finetune_checkpoint, finetune_texts, two, method=METHODS["yarn"], parallel={"sp_size": 2}, **changes
    )
    launched = accelerate_launch("-m", "ctxext", "finetune", "--recipe", str(recipe), "--no-progress")
    assert launched.returncode == 0, launched.stderr[-3000:]
    run = json.loads((two / "run.json").read_text())
    assert (run["processes"], run["sequence_parallel"], run["distributed_type"]) == (2, 2, "DistributedType.DEEPSPEED")
    got, want = read_metrics(two), read_metrics(one)
    assert [r["step"] for r in got if r["kind"] == "train"] == [1, 2, 3, 4]
    assert_same_numbers(got, want, tol=LOSS_TOLERANCE)


@pytest.mark.slow  # 3 launches of 2 processes (about 50 s on 2 cores)
def test_an_sp_2_run_resumed_from_its_checkpoint_gives_the_uninterrupted_metrics(
    finetune_checkpoint, finetune_texts, tmp_path
):
    """2 steps, then --resume to 4, against 4 at once, all with sp_size 2 under ZeRO-2: DeepSpeed's own sharded
    checkpoint carries the run. data.max_tokens is fixed, so the packed data does not depend on max_steps."""
    changes = {**CHANGES, "train__checkpoint_every": 2, "eval__every": 2, "data__max_tokens": 20000}
    parts, whole = tmp_path / "parts", tmp_path / "whole"
    runs = [(parts, 2, ()), (parts, 4, ("--resume",)), (whole, 4, ())]
    for output, steps, extra in runs:
        changes["train__max_steps"] = steps
        recipe = write_recipe(
            tmp_path,
            finetune_checkpoint,
            finetune_texts,
            output,
            method=METHODS["yarn"],
            parallel={"sp_size": 2},
            **changes,
        )
        launched = accelerate_launch("-m", "ctxext", "finetune", "--recipe", str(recipe), "--no-progress", *extra)
        assert launched.returncode == 0, launched.stderr[-3000:]
    got, want = read_metrics(parts), read_metrics(whole)
    assert [r["step"] for r in got if r["kind"] == "train"] == [1, 2, 3, 4]
    assert_same_numbers(got, want, tol=LOSS_TOLERANCE)


def test_sp_size_must_divide_the_training_length(finetune_checkpoint, finetune_texts, tmp_path):
    recipe = write_recipe(
        tmp_path, finetune_checkpoint, finetune_texts, tmp_path / "run", parallel={"sp_size": 3}, **CHANGES
    )
    with pytest.raises(Exception, match=r"parallel.sp_size=3 must divide the training sequence length \(128"):
        load_recipe(recipe)


def test_sp_size_without_deepspeed_launch_is_a_one_line_error(finetune_checkpoint, finetune_texts, tmp_path, capsys):
    output = tmp_path / "run"
    recipe = write_recipe(tmp_path, finetune_checkpoint, finetune_texts, output, parallel={"sp_size": 2}, **CHANGES)
    assert ctxext_main(["finetune", "--recipe", str(recipe), "--no-progress"]) == 2
    error = capsys.readouterr().err.strip()
    assert error.count("\n") == 0
    assert "parallel.sp_size=2 runs under DeepSpeed: launch with `accelerate launch" in error
    assert not output.exists()


@pytest.mark.slow  # 2 steps as one process, then as 4 under ZeRO-3 (about a minute on 2 cores)
def test_the_llama3_8b_64k_recipe_runs_on_a_tiny_llama3_as_4_processes(finetune_texts, tmp_path):
    """configs/recipes/llama3-8b-yarn-64k-sp4.yaml with its parallel settings (sp_size 4, ZeRO-3, gradient
    checkpointing, yarn x8, a global batch of 8) on a tiny LLaMA with Llama 3's rope base; only the model, the
    lengths (L = 64 -> 512), the data, fp32 and SDPA (no GPU) and the step count change. 4 processes form one SP
    group; the tiny model's 2 key/value heads are each replicated to 2 processes."""
    checkpoint = save_bpe_llama(tmp_path / "tiny-llama3", rope_theta=500000.0)
    train, held_out = finetune_texts
    changes = [
        f"model={checkpoint}",
        "seq_len=512",
        "train.max_steps=2",
        "train.precision=fp32",
        "train.attn_implementation=sdpa",
        "train.checkpoint_every=0",
        "lora.dropout=0",
        "data.dataset=null",
        f"data.text_files=[{train}]",
        "eval.dataset=null",
        f"eval.text_files=[{held_out}]",
        "eval.lengths=[512,64]",
        "eval.stride=64",
        "eval.every=2",
    ]
    recipe = ["--recipe", "configs/recipes/llama3-8b-yarn-64k-sp4.yaml", "--no-progress"]
    one, four = tmp_path / "one", tmp_path / "four"
    alone = subprocess.run(
        [sys.executable, "-m", "ctxext", "finetune", *recipe, f"output_dir={one}", "parallel.sp_size=1", *changes],
        cwd=REPO,
        env=child_process_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert alone.returncode == 0, alone.stderr[-3000:]
    launched = accelerate_launch(
        "--num_processes",
        "4",
        "-m",
        "ctxext",
        "finetune",
        *recipe,
        f"output_dir={four}",
        *changes,
        config="deepspeed-zero3-cpu.yaml",
    )
    assert launched.returncode == 0, launched.stderr[-3000:]
    run = json.loads((four / "run.json").read_text())
    assert (run["processes"], run["sequence_parallel"], run["distributed_type"]) == (4, 4, "DistributedType.DEEPSPEED")
    assert_same_numbers(read_metrics(four), read_metrics(one), tol=LOSS_TOLERANCE)


@pytest.mark.parametrize(
    "config, sp_size, attention, message",
    [
        (
            {},
            3,
            "sdpa",
            "parallel.sp_size=3 must divide the model's 4 attention heads and divide (or be a multiple of)",
        ),
        ({}, 2, "eager", "parallel.sp_size needs train.attn_implementation sdpa or flash_attention_2"),
        (
            {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}},
            2,
            "sdpa",
            "the model's own 'dynamic' rotary reads the length from each process's slice of the sequence; patch it "
            "with ctxext's method (method: dynamic_ntk)",
        ),
    ],
    ids=["heads", "eager", "own dynamic rotary"],
)
def test_what_sequence_parallelism_cannot_honour_is_refused_before_training(config, sp_size, attention, message):
    model = tiny_model("llama", **config)  # 4 heads over 2 key/value heads
    with pytest.raises(CtxextError, match=re.escape(message)):
        check_model(model, sp_size, attention)
    check_model(tiny_model("llama"), 2, "sdpa")  # 2 of 4 heads, 1 of 2 key/value heads a process: accepted
    check_model(tiny_model("llama"), 4, "sdpa")  # key/value heads replicated: accepted
