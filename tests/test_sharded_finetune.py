"""`ctxext finetune` under DeepSpeed ZeRO-2 and ZeRO-3 and under FSDP2 as 2 CPU processes (`accelerate launch`,
gloo), and FSDP refused on a CPU as accelerate 1.15 stands.

The oracle: the same recipe run as one process, in this file. Two processes with the same global batch must give
its losses, perplexities, adapter and merged weights (fp32; measured: losses within 1.2e-7, every metric within
1.2e-7 relative, adapter and merged weights within 1.5e-8). The recipe clips at optim.max_grad_norm=0.05 while
the DeepSpeed configs say gradient_clipping: 1.0, so the clipping that ran must be the recipe's.

FSDP: accelerate 1.15 sets up FSDP only over GPUs (AcceleratorState keeps MULTI_CPU as it is), so on a CPU the
run would be plain DDP; ctxext refuses it with a one-line error instead (docs/guides/finetuning.md). ctxext's FSDP
path itself runs here all the same: tests/fixtures/fsdp_on_cpu/ holds a 2-process CPU FSDP2 config and, for the
launched processes only (PYTHONPATH), a sitecustomize.py that stands in for the one entry accelerate's device
list lacks (its docstring says where and why). Measured against the oracle: losses within 1.2e-7, every metric
within 2.8e-8 relative, adapter weights within 2.3e-8, merged weights within 7.5e-9; the same tolerances hold.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from ctxext.cli import main as ctxext_main
from tests.helpers import (
    assert_same_numbers,
    child_process_env,
    free_port,
    read_metrics,
    write_recipe,
)

REPO = Path(__file__).resolve().parents[1]
FSDP_ON_CPU = REPO / "tests" / "fixtures" / "fsdp_on_cpu"  # the launch config and the stand-in that lets it run
pytestmark = pytest.mark.usefixtures("one_torch_thread_per_module")
# 4 steps of 2 micro-batches of 1 sequence on each of 2 processes (one process: 4 micro-batches), evaluated at
# steps 0, 2 and 4; the final checkpoint only. No dropout, so the runs differ only in how the engine reduces.
CHANGES = {
    "train__max_steps": 4,
    "train__micro_batch_size": 1,
    "train__checkpoint_every": 0,
    "lora__dropout": 0.0,
    "eval__every": 2,
    "optim": {"lr": 1e-3, "warmup_steps": 2, "max_grad_norm": 0.05},
}
TOLERANCE = 1e-5  # relative or absolute, on every metric; measured differences are 100x smaller
WEIGHT_TOLERANCE = 1e-6  # absolute, on the adapter's and the merged model's tensors; measured 1.5e-8


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, finetune_checkpoint, finetune_texts):
    """The oracle: the recipe as one process, in this process."""
    folder = tmp_path_factory.mktemp("one-process")
    output = folder / "run"
    recipe = write_recipe(folder, finetune_checkpoint, finetune_texts, output, **CHANGES)
    assert ctxext_main(["finetune", "--recipe", str(recipe), "--no-progress"]) == 0
    return output


def launch(config: str, recipe: Path, *options: str, **env: str) -> subprocess.CompletedProcess:
    """`accelerate launch --config_file CONFIG [options] -m ctxext finetune --recipe RECIPE`; CONFIG is under
    configs/accelerate/ unless it names a path in the repository; `env` is added to the children's environment."""
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "accelerate.commands.launch",
            "--config_file",
            config if "/" in config else f"configs/accelerate/{config}",
            "--main_process_port",
            str(free_port()),
            *options,
            "-m",
            "ctxext",
            "finetune",
            "--recipe",
            str(recipe),
            "--no-progress",
        ],
        cwd=REPO,
        env=child_process_env(DS_ACCELERATOR="cpu", **env),  # DeepSpeed finds the CPU by itself; this skips its probe
        capture_output=True,
        text=True,
        timeout=600,  # the first DeepSpeed run on a machine compiles its shared-memory op (about a minute)
    )


def with_python_path(folder: Path) -> str:
    """PYTHONPATH with `folder` first (its sitecustomize.py is imported at start-up)."""
    return os.pathsep.join([str(folder), *filter(None, [os.environ.get("PYTHONPATH")])])


def assert_same_tensors(a: Path, b: Path) -> None:
    want, got = load_file(a), load_file(b)
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert (got[name].double() - tensor.double()).abs().max().item() <= WEIGHT_TOLERANCE, name


def assert_same_run(output: Path, one_process: Path, distributed_type: str) -> None:
    """A 2-process run under `distributed_type` against the one-process run: the parameters counted whole (each
    process holds only its shard), the engine's own sharded checkpoint, every metric, the adapter and merged weights."""
    run, oracle = (json.loads((path / "run.json").read_text()) for path in (output, one_process))
    assert (run["processes"], run["distributed_type"]) == (2, distributed_type)
    assert run["parameters"] == oracle["parameters"]
    assert (output / "checkpoints" / "step-000004" / "accelerate").is_dir()
    got, want = read_metrics(output), read_metrics(one_process)
    assert [r["step"] for r in got if r["kind"] == "train"] == [1, 2, 3, 4]
    assert_same_numbers(got, want, tol=TOLERANCE)
    assert_same_tensors(
        one_process / "adapter" / "adapter_model.safetensors", output / "adapter" / "adapter_model.safetensors"
    )
    assert_same_tensors(one_process / "merged" / "model.safetensors", output / "merged" / "model.safetensors")


@pytest.mark.slow  # 2 processes, 10-30 s each on 2 cores (plus DeepSpeed's one-time op build)
@pytest.mark.parametrize("config", ["deepspeed-zero2-cpu.yaml", "deepspeed-zero3-cpu.yaml"])
def test_deepspeed_on_two_cpu_processes_matches_one_process(config, request, tmp_path):
    pytest.importorskip("deepspeed", reason="DeepSpeed is not installed: pip install 'ctxext[deepspeed]'")
    one_process = request.getfixturevalue("one_process")  # built only where DeepSpeed is installed
    finetune_checkpoint, finetune_texts = (
        request.getfixturevalue("finetune_checkpoint"),
        request.getfixturevalue("finetune_texts"),
    )
    output = tmp_path / "run"
    launched = launch(config, write_recipe(tmp_path, finetune_checkpoint, finetune_texts, output, **CHANGES))
    assert launched.returncode == 0, launched.stderr[-3000:]
    assert launched.stdout.count("fine-tuned ") == 1  # only the main process reports and writes

    assert_same_run(output, one_process, "DistributedType.DEEPSPEED")  # under ZeRO-3 a process holds a shard


@pytest.mark.slow  # 2 processes that stop at once, about 10 s
def test_fsdp_on_cpu_processes_is_refused_not_run_as_ddp(finetune_checkpoint, finetune_texts, tmp_path):
    output = tmp_path / "run"
    recipe = write_recipe(tmp_path, finetune_checkpoint, finetune_texts, output, **CHANGES)
    launched = launch("fsdp.yaml", recipe, "--num_processes", "2", "--mixed_precision", "no")
    assert launched.returncode != 0
    assert "ctxext finetune: error: accelerate launch asked for FSDP, but accelerate " in launched.stderr.replace(
        "\n", " "
    )
    assert "set up MULTI_CPU (no sharding) instead; it runs FSDP only on GPUs" in launched.stderr
    assert not output.exists()


@pytest.mark.slow  # 2 processes, about 30 s on 2 cores
def test_fsdp2_on_two_cpu_processes_matches_one_process(one_process, finetune_checkpoint, finetune_texts, tmp_path):
    """ctxext's own FSDP path (FSDP2: fully_shard, DTensor parameters, accelerate's sharded checkpoint and
    get_state_dict) as 2 CPU processes, with accelerate's device gate opened in the children only (FSDP_ON_CPU)."""
    output = tmp_path / "run"
    recipe = write_recipe(tmp_path, finetune_checkpoint, finetune_texts, output, **CHANGES)
    launched = launch(str(FSDP_ON_CPU / "fsdp-cpu.yaml"), recipe, PYTHONPATH=with_python_path(FSDP_ON_CPU))
    assert launched.returncode == 0, launched.stderr[-3000:]
    assert launched.stdout.count("fine-tuned ") == 1  # only the main process reports and writes

    assert_same_run(output, one_process, "DistributedType.FSDP")  # FSDP2: DTensor shards
