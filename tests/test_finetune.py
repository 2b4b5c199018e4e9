"""`ctxext finetune` end to end on a tiny random LLaMA: artifacts, resume after a kill, 2 processes, bad input.

The oracles: the evaluator (`sliding_window_nll`) on the model as loaded, PEFT's own adapter loading, a plain
transformers load of the merged checkpoint, and the uninterrupted / single-process run itself.
"""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from ctxext.cli import main as ctxext_main
from tests.helpers import (
    FINETUNE_STEPS,
    assert_same_numbers,
    child_process_env,
    free_port,
    read_metrics,
    write_recipe,
)

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.usefixtures("one_torch_thread_per_module")


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory, finetune_checkpoint, finetune_texts):
    """An uninterrupted run, in this process."""
    folder = tmp_path_factory.mktemp("runs")
    output = folder / "reference"
    recipe = write_recipe(folder, finetune_checkpoint, finetune_texts, output)
    assert ctxext_main(["finetune", "--recipe", str(recipe), "--no-progress"]) == 0
    return folder, output


def test_run_writes_metrics_adapter_and_merged_checkpoint(reference_run, finetune_checkpoint, finetune_texts):
    from peft import AutoPeftModelForCausalLM, PeftModel
    from transformers import AutoModelForCausalLM

    import ctxext
    from ctxext.eval.perplexity import perplexity, sliding_window_nll

    _, output = reference_run
    records = read_metrics(output)
    assert [r["step"] for r in records if r["kind"] == "eval"] == [0, 3, 6]
    assert [r["step"] for r in records if r["kind"] == "train"] == list(range(1, FINETUNE_STEPS + 1))
    assert (output / "metrics.png").stat().st_size > 0

    # The base reference is the model as loaded (unpatched), scored by the evaluator at L = 64.
    tokenizer_dir = output / "adapter"
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    ids = torch.tensor(tokenizer(finetune_texts[1].read_text(), add_special_tokens=False).input_ids)
    base = AutoModelForCausalLM.from_pretrained(finetune_checkpoint, dtype=torch.float32)
    # stride 64 is not below the 64-token window, so the run scores it with stride 32 (every token, not one pass)
    expected = perplexity(*sliding_window_nll(base, ids, 64, 32))
    reference = [r for r in records if r["kind"] == "base_reference"][0]
    assert reference["length"] == 64 and reference["perplexity"] == pytest.approx(expected, rel=1e-6)
    # Step 0 at L is the patched model before any update: PI x4 compresses positions, so it differs from the base.
    step0 = [r for r in records if r["kind"] == "eval"][0]["perplexity"]
    ctxext.patch(base, "linear", factor=4)
    assert step0["256"] == pytest.approx(perplexity(*sliding_window_nll(base, ids, 256, 64)), rel=1e-6)

    # The adapter is a standard PEFT adapter: on the patched base it gives the merged checkpoint's logits.
    adapter_config = json.loads((output / "adapter" / "adapter_config.json").read_text())
    assert set(adapter_config["target_modules"]) == {"q_proj", "k_proj", "v_proj", "o_proj"}
    assert {"embed_tokens", "norm"} <= set(adapter_config["modules_to_save"])
    with_adapter = PeftModel.from_pretrained(base, output / "adapter").eval()
    merged = AutoModelForCausalLM.from_pretrained(output / "merged", dtype=torch.float32).eval()
    assert merged.config.rope_parameters["rope_type"] == "linear"
    assert merged.config.rope_parameters["factor"] == 4
    assert merged.config.max_position_embeddings == 256
    written = json.loads((output / "merged" / "config.json").read_text())  # the 4.x spelling too
    assert written["rope_scaling"] == {"rope_type": "linear", "factor": 4, "original_max_position_embeddings": 64}
    assert written["rope_theta"] == merged.config.rope_parameters["rope_theta"]
    sample = ids[:256].unsqueeze(0)
    with torch.no_grad():
        torch.testing.assert_close(merged(sample).logits, with_adapter(sample).logits, rtol=1e-4, atol=1e-4)
        # adapter/ctxext.yaml records the patch: PEFT's own loader on the adapter alone patches the base itself.
        auto = AutoPeftModelForCausalLM.from_pretrained(output / "adapter", dtype=torch.float32).eval()
        torch.testing.assert_close(auto(sample).logits, with_adapter(sample).logits, rtol=0, atol=1e-5)
        # Training changed the model: the adapter is not a no-op (PEFT wrapped `base` in place; reload it).
        fresh = ctxext.patch(
            AutoModelForCausalLM.from_pretrained(finetune_checkpoint, dtype=torch.float32), "linear", factor=4
        ).eval()
        assert not torch.allclose(merged(sample).logits, fresh(sample).logits, atol=1e-3)
    # The source checkpoint is untouched.
    assert AutoModelForCausalLM.from_pretrained(finetune_checkpoint).config.rope_parameters["rope_type"] == "default"


# A run that dies with no clean-up (SIGKILL) right after a given step; it logs to TensorBoard too.
KILLED_RUN = """
import os, signal, sys
from ctxext.train.loop import finetune
from ctxext.train.recipe import load_recipe

def kill_after(step):
    if step == int(sys.argv[2]):
        os.kill(os.getpid(), signal.SIGKILL)

finetune(load_recipe(sys.argv[1]), progress=False, after_step=kill_after, report_to="tensorboard")
"""


@pytest.fixture(scope="module")
def resumed_run(reference_run, finetune_checkpoint, finetune_texts):
    """A run killed after step 3 (its last checkpoint is step 2), then resumed; both parts with --report-to
    tensorboard."""
    folder, _ = reference_run
    output = folder / "killed"
    recipe = write_recipe(folder, finetune_checkpoint, finetune_texts, output)
    command = [sys.executable, "-c", KILLED_RUN, str(recipe), "3"]
    killed = subprocess.run(command, cwd=REPO, env=child_process_env(), capture_output=True, text=True)
    assert killed.returncode == -9, killed.stderr[-2000:]
    assert max(r["step"] for r in read_metrics(output)) == 3  # step 3 was logged, and must be dropped
    assert not (output / "adapter").exists()

    # Without --resume the directory is refused, and left as it was.
    before = (output / "metrics.jsonl").read_text()
    assert ctxext_main(["finetune", "--recipe", str(recipe), "--no-progress"]) == 2
    assert (output / "metrics.jsonl").read_text() == before

    resume = ["finetune", "--recipe", str(recipe), "--no-progress", "--resume", "--report-to", "tensorboard"]
    assert ctxext_main(resume) == 0
    return output


def test_resume_after_kill_gives_the_uninterrupted_metrics(reference_run, resumed_run):
    _, reference = reference_run
    assert_same_numbers(read_metrics(resumed_run), read_metrics(reference), tol=1e-5)


def test_tensorboard_reads_back_the_logged_metrics(resumed_run):
    """TensorBoard's own reader finds the run's losses and perplexities at their steps, each step once: what the
    killed run logged after its checkpoint (step 3) is hidden, as in metrics.jsonl."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    runs = list((resumed_run / "trackers").glob("*/events.out.tfevents.*"))
    assert runs and len({path.parent for path in runs}) == 1
    assert len(runs) == 2  # the killed process's file and the resumed one's
    events = EventAccumulator(str(runs[0].parent)).Reload()
    records = read_metrics(resumed_run)
    train = [r for r in records if r["kind"] == "train"]
    logged = [(e.step, e.value) for e in events.Scalars("train/loss")]
    assert [step for step, _ in logged] == [r["step"] for r in train] == list(range(1, FINETUNE_STEPS + 1))
    for (_, value), record in zip(logged, train):
        assert value == pytest.approx(record["loss"], rel=1e-6)  # TensorBoard keeps float32
    assert [e.value for e in events.Scalars("train/lr")] == pytest.approx([r["lr"] for r in train], rel=1e-6)
    evals = [r for r in records if r["kind"] == "eval"]
    for length in ("256", "64"):
        logged = [(e.step, e.value) for e in events.Scalars(f"eval/perplexity_{length}")]
        assert logged == [(r["step"], pytest.approx(r["perplexity"][length], rel=1e-6)) for r in evals]
    base = [r for r in records if r["kind"] == "base_reference"][0]
    assert [(e.step, e.value) for e in events.Scalars("eval/base_perplexity_64")] == [
        (0, pytest.approx(base["perplexity"], rel=1e-6))
    ]


@pytest.mark.parametrize("poisoned", ["optimizer.pt", "rng-0.pt", "trainable.pt"])
def test_resume_refuses_a_checkpoint_file_that_would_run_code(tmp_path, reference_run, capsys, poisoned):
    """A checkpoint file holding a pickled object whose unpickling runs code is refused, and the code never runs."""
    _, reference = reference_run
    recipe, output = copy_of_run(reference, tmp_path)
    marker = tmp_path / "code-ran"
    checkpoint = sorted((output / "checkpoints").glob("step-*"))[-1]
    torch.save({"state": RunsCode(marker)}, checkpoint / poisoned)

    assert ctxext_main(["finetune", "--recipe", str(recipe), "--no-progress", "--resume"]) == 2
    assert not marker.exists()
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("ctxext finetune: error: refusing to load") and poisoned in err[-1], err


def test_resuming_a_finished_run_changes_nothing(tmp_path, reference_run):
    _, reference = reference_run
    recipe, output = copy_of_run(reference, tmp_path)
    checkpoints = sorted(p.name for p in (output / "checkpoints").iterdir())
    assert ctxext_main(["finetune", "--recipe", str(recipe), "--no-progress", "--resume"]) == 0
    assert read_metrics(output) == read_metrics(reference)
    assert sorted(p.name for p in (output / "checkpoints").iterdir()) == checkpoints


def copy_of_run(run: Path, folder: Path) -> tuple[Path, Path]:
    """(recipe, output) of a copy of a finished run in `folder`, to resume without touching the original."""
    output = folder / "run"
    shutil.copytree(run, output)
    (output / "recipe.yaml").unlink()  # the copy's recipe names the original's output_dir
    recipe = yaml.safe_load((run / "recipe.yaml").read_text())
    recipe["output_dir"] = str(output)
    (folder / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    return folder / "recipe.yaml", output


class RunsCode:
    """Unpickling this creates the file `marker` (as a pickled os.system call would run a command)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


@pytest.mark.slow  # `make test-slow`: CI's second step
def test_two_processes_match_one_with_the_same_global_batch(reference_run, finetune_checkpoint, finetune_texts):
    folder, _ = reference_run
    changes = {
        "train__max_steps": 3,
        "train__micro_batch_size": 1,
        "lora__dropout": 0.0,
        "eval__every": 3,
        "train__checkpoint_every": 0,
    }
    one = folder / "one-process"
    ctxext_main(
        [
            "finetune",
            "--recipe",
            str(write_recipe(folder, finetune_checkpoint, finetune_texts, one, **changes)),
            "--no-progress",
        ]
    )
    two = folder / "two-processes"
    recipe = write_recipe(folder, finetune_checkpoint, finetune_texts, two, **changes)
    launched = subprocess.run(
        [
            sys.executable,
            "-m",
            "accelerate.commands.launch",
            "--config_file",
            "configs/accelerate/cpu-2proc.yaml",
            "--main_process_port",
            str(free_port()),
            "-m",
            "ctxext",
            "finetune",
            "--config",
            str(recipe),
            "--no-progress",
        ],
        cwd=REPO,
        env=child_process_env(),
        capture_output=True,
        text=True,
    )
    assert launched.returncode == 0, launched.stderr[-3000:]
    assert json.loads((two / "run.json").read_text())["processes"] == 2
    assert launched.stdout.count("fine-tuned ") == 1  # only the main process reports and writes
    a, b = read_metrics(one), read_metrics(two)
    losses_one = [(r["step"], r["loss"]) for r in a if r["kind"] == "train"]
    losses_two = [(r["step"], r["loss"]) for r in b if r["kind"] == "train"]
    assert [s for s, _ in losses_one] == [s for s, _ in losses_two] == [1, 2, 3]
    assert [x for _, x in losses_one] == pytest.approx([x for _, x in losses_two], abs=1e-4)
    assert_same_numbers(a, b, tol=1e-4)


# ------------------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    "changes, message",
    [
        (
            {"lora": {"r": 4, "alpha": 8, "dropuot": 0.1}},
            "unknown key 'dropuot' in section 'lora' (did you mean 'dropout'?)",
        ),
        ({"data": {"text_files": ["/nonexistent/train.txt"]}}, "text file '/nonexistent/train.txt' does not exist"),
        ({"seq_len": 1024}, "seq_len 1024 is beyond what the model patched with linear x4 supports (256 = 64 x 4)"),
        ({"lora": {"target_modules": ["q_proj", "v_prj"]}}, "no linear layer named 'v_prj' (did you mean 'v_proj'?)"),
    ],
)
def test_bad_input_is_one_line_exit_2_and_writes_nothing(
    tmp_path, finetune_checkpoint, finetune_texts, capsys, changes, message
):
    output = tmp_path / "out"
    recipe = write_recipe(tmp_path, finetune_checkpoint, finetune_texts, output, **changes)
    assert ctxext_main(["finetune", "--recipe", str(recipe), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("ctxext finetune: error: ") and message in err[-1], err
    assert not output.exists()


def test_bad_input_from_the_command_line(tmp_path, finetune_checkpoint, finetune_texts, capsys):
    """The real command: exit code 2, one line, and an existing output directory left alone."""
    output = tmp_path / "existing"
    output.mkdir()
    (output / "keep.txt").write_text("mine")
    recipe = write_recipe(tmp_path, finetune_checkpoint, finetune_texts, output)
    run = subprocess.run(
        [sys.executable, "-m", "ctxext", "finetune", "--recipe", str(recipe), "lora.rr=3"],
        cwd=REPO,
        env=child_process_env(),
        capture_output=True,
        text=True,
    )
    assert run.returncode == 2
    assert run.stderr.strip().splitlines()[-1].startswith("ctxext finetune: error:") and "lora.rr" not in run.stdout
    assert "unknown key 'rr' in section 'lora' (did you mean 'r'?)" in run.stderr
    capsys.readouterr()
    assert ctxext_main(["finetune", "--recipe", str(recipe)]) == 2
    assert "already exists; use --resume" in capsys.readouterr().err
    assert [p.name for p in output.iterdir()] == ["keep.txt"]


def test_pose_trains_on_skipped_positions(tmp_path, finetune_checkpoint, finetune_texts):
    """Step 1's loss (taken before any update; LoRA starts as a no-op) equals the patched base model's loss on
    the same sample with the PoSE position ids and full causal attention: the positions reach the model, and the
    chunks attend to each other (not cut apart as packed sequences)."""
    from transformers import AutoModelForCausalLM

    import ctxext
    from ctxext.train.data import PackedSequences
    from ctxext.train.pose import pose_generator, pose_position_ids

    # Sharper attention than a random init gives, so that positions change the loss visibly.
    sharp = tmp_path / "sharp-model"
    model = AutoModelForCausalLM.from_pretrained(finetune_checkpoint, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "q_proj" in name or "k_proj" in name:
                param.mul_(8.0)
    model.save_pretrained(sharp)
    (sharp / "tokenizer.json").write_bytes((finetune_checkpoint / "tokenizer.json").read_bytes())
    (sharp / "tokenizer_config.json").write_bytes((finetune_checkpoint / "tokenizer_config.json").read_bytes())
    finetune_checkpoint = sharp

    output = tmp_path / "pose"
    recipe = write_recipe(
        tmp_path,
        finetune_checkpoint,
        finetune_texts,
        output,
        train__max_steps=1,
        train__global_batch_size=1,
        train__micro_batch_size=1,
        lora__dropout=0.0,
        eval__every=0,
        pose={"enabled": True, "train_window": 64, "num_chunks": 2},
    )
    assert ctxext_main(["finetune", "--recipe", str(recipe), "--no-progress"]) == 0
    loss = [r for r in read_metrics(output) if r["kind"] == "train"][0]["loss"]

    import numpy as np

    stream = np.load(json.loads((output / "run.json").read_text())["data"]["cache_file"])
    sample = PackedSequences(stream, 64, seed=0)[0].unsqueeze(0)
    positions = pose_position_ids(64, 256, 2, pose_generator(0, 0)).unsqueeze(0)
    assert int(positions.max()) >= 64  # beyond the window, so positions matter
    model = ctxext.patch(
        AutoModelForCausalLM.from_pretrained(finetune_checkpoint, dtype=torch.float32), "linear", factor=4
    ).eval()
    with torch.no_grad():
        # With a cache transformers never reads the position jumps as packed-sequence boundaries: plain causal
        # attention over the whole window, which is what PoSE means.
        expected = model(input_ids=sample, labels=sample, position_ids=positions, use_cache=True).loss.item()
        plain = model(input_ids=sample, labels=sample).loss.item()
    assert loss == pytest.approx(expected, rel=1e-5), (loss, expected, plain)
    assert abs(loss - plain) > 5e-4, (loss, plain)  # about 1e-3 here: 60x the tolerance above
