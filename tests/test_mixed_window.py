"""Mixed-window fine-tuning (LongRoPE2): short micro-batches train with the original rotary, long ones with the
patched rotary, both on the model at once.

The oracles: the unpatched and the patched model's own forwards (bit for bit), the schedule written out, the
first step's loss recomputed from the base model, and the uninterrupted run for a resumed one.
"""

import math
import subprocess
import sys

import pytest
import torch

import ctxext
from ctxext.cli import main as ctxext_main
from ctxext.patching.rotary import ScaledRotaryEmbedding, original_rotary_within
from ctxext.train.batches import sample_indices
from ctxext.train.mixed_window import (
    cut_into_short_sequences,
    is_short_micro_batch,
    micro_batch_index,
)
from tests.helpers import (
    REPO,
    assert_same_numbers,
    child_process_env,
    read_metrics,
    tiny_model,
    write_recipe,
)

L = 64
pytestmark = pytest.mark.usefixtures("one_torch_thread_per_module")


# ------------------------------------------------------------------------------------------- the switch
def lora_model():
    """A tiny random LLaMA (L = 64) with LoRA adapters whose B is not zero, so that the adapters act."""
    from ctxext.train.lora import add_lora

    model = add_lora(tiny_model("llama"), 4, 8, 0.0, ["q_proj", "k_proj", "v_proj", "o_proj"], True)
    torch.manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.05)
    return model


def forward(model, ids):
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=ids).logits
    logits.float().pow(2).mean().backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if "lora_" in name}
    return logits.detach(), grads


@pytest.mark.parametrize("length", [L, 3 * L])
def test_the_switch_runs_the_unpatched_model_within_l_and_the_patched_one_past_it(length):
    torch.manual_seed(2)
    ids = torch.randint(0, 256, (2, length))
    model = lora_model()
    unpatched = forward(model, ids)
    ctxext.patch(model, "linear", factor=4)
    patched = forward(model, ids)
    with original_rotary_within(model, L):
        mixed = forward(model, ids)
    assert isinstance(model.base_model.model.model.rotary_emb, ScaledRotaryEmbedding)
    assert model.base_model.model.model.rotary_emb.original_within == 0  # the block leaves no setting behind
    expected = unpatched if length <= L else patched
    assert torch.equal(mixed[0], expected[0])
    assert mixed[1].keys() == expected[1].keys() and len(mixed[1]) == 16  # A and B of q, k, v, o in 2 layers
    for name, grad in mixed[1].items():
        assert torch.equal(grad, expected[1][name]), name
        assert grad.abs().sum() > 0, name  # gradients reach every LoRA weight
    # The two rotaries differ on these positions (positions 1.. rotate differently under PI x4).
    assert not torch.equal(unpatched[0], patched[0])


def test_the_switch_is_a_no_op_on_an_unpatched_model():
    model = tiny_model("llama")
    ids = torch.randint(0, 256, (1, 16))
    with torch.no_grad():
        before = model(input_ids=ids).logits
        with original_rotary_within(model, L):
            assert torch.equal(model(input_ids=ids).logits, before)


# ------------------------------------------------------------------------------------------- the schedule
@pytest.mark.parametrize("fraction", [0.0, 0.25, 0.5, 1 / 3, 0.8, 1.0])
def test_the_short_micro_batches_are_the_fraction_spread_evenly(fraction):
    flags = [is_short_micro_batch(i, fraction) for i in range(600)]
    for n in (1, 7, 60, 600):
        assert sum(flags[:n]) == math.floor(n * fraction + 1e-9)
    if fraction == 0.5:
        assert flags[:6] == [False, True, False, True, False, True]


def test_the_schedule_is_the_same_on_any_number_of_processes():
    """Which samples train short depends on the sample index alone: 1 process and 2 agree."""

    def short_samples(world: int) -> set[int]:
        short = set()
        for step in range(5):
            for micro in range(8 // (2 * world)):
                for rank in range(world):
                    indices = sample_indices(step, micro, rank, world, 2, 8)
                    if is_short_micro_batch(micro_batch_index(indices[0], 2), 0.5):
                        short.update(indices)
        return short

    assert short_samples(1) == short_samples(2) and len(short_samples(1)) == 20


def test_a_short_micro_batch_holds_the_same_tokens_cut_at_the_short_length():
    batch = torch.arange(2 * 256).reshape(2, 256)
    short = cut_into_short_sequences(batch, 64)
    assert short.shape == (8, 64) and torch.equal(short.flatten(), batch.flatten())
    assert cut_into_short_sequences(batch, 100).shape == (4, 100)  # the 56-token tails dropped


# ------------------------------------------------------------------------------------------- fine-tuning
MIXED = {"enabled": True, "short_fraction": 0.5}


def mixed_recipe(folder, finetune_checkpoint, finetune_texts, name, **changes):
    changes = {
        "train__max_steps": 4,
        "eval": {
            "every": 2,
            "dataset": None,
            "text_files": [str(finetune_texts[1])],
            "lengths": [256, 64],
            "stride": 64,
        },
        "mixed_window": MIXED,
        **changes,
    }
    return write_recipe(folder, finetune_checkpoint, finetune_texts, folder / name, **changes)


@pytest.fixture(scope="module")
def mixed_run(tmp_path_factory, finetune_checkpoint, finetune_texts):
    folder = tmp_path_factory.mktemp("mixed")
    recipe = mixed_recipe(folder, finetune_checkpoint, finetune_texts, "reference")
    assert ctxext_main(["finetune", "--recipe", str(recipe), "--no-progress"]) == 0
    return folder, folder / "reference"


def test_the_first_step_trains_one_long_and_one_short_micro_batch(mixed_run, finetune_checkpoint):
    """Step 1's loss (LoRA still a no-op) is the mean of the patched model's loss on micro-batch 0 (256 tokens)
    and the unpatched model's on micro-batch 1, cut into 64-token sequences."""
    import json

    import numpy as np
    from transformers import AutoModelForCausalLM

    from ctxext.train.data import PackedSequences

    _, output = mixed_run
    records = read_metrics(output)
    loss = [r for r in records if r["kind"] == "train"][0]["loss"]
    stream = np.load(json.loads((output / "run.json").read_text())["data"]["cache_file"])
    data = PackedSequences(stream, 256, seed=0)
    long, short = data.batch([0, 1]), cut_into_short_sequences(data.batch([2, 3]), L)
    base = AutoModelForCausalLM.from_pretrained(finetune_checkpoint, dtype=torch.float32).eval()
    with torch.no_grad():
        short_loss = base(input_ids=short, labels=short).loss.item()
        ctxext.patch(base, "linear", factor=4)
        long_loss = base(input_ids=long, labels=long).loss.item()
    assert loss == pytest.approx((long_loss + short_loss) / 2, rel=1e-5)

    # Windows of at most L are scored with the original rotary: at step 0 that is the base model itself.
    evals = [r for r in records if r["kind"] == "eval"]
    reference = [r for r in records if r["kind"] == "base_reference"][0]
    assert evals[0]["perplexity"]["64"] == reference["perplexity"]
    assert evals[0]["rotary"] == {"256": "linear x4", "64": "original"}
    assert evals[0]["perplexity_patched_rotary"]["64"] != reference["perplexity"]
    assert [r["step"] for r in evals] == [0, 2, 4]
    adapter_record = (output / "adapter" / "ctxext.yaml").read_text()
    assert "mixed_window:" in adapter_record and "original_rotary_within(model, 64)" in adapter_record


class Stop(Exception):
    pass


@pytest.mark.slow  # `make test-slow`: CI's second step
def test_a_resumed_mixed_run_gives_the_uninterrupted_metrics(mixed_run, finetune_checkpoint, finetune_texts):
    from ctxext.train.loop import finetune
    from ctxext.train.recipe import load_recipe

    folder, reference = mixed_run
    recipe = mixed_recipe(folder, finetune_checkpoint, finetune_texts, "stopped")

    def stop_after_3(step):
        if step == 3:
            raise Stop

    with pytest.raises(Stop):
        finetune(load_recipe(recipe), progress=False, after_step=stop_after_3)
    assert ctxext_main(["finetune", "--recipe", str(recipe), "--no-progress", "--resume"]) == 0
    assert_same_numbers(read_metrics(folder / "stopped"), read_metrics(reference), tol=1e-5)
    # A resume with another schedule is refused: it would not be the same run.
    assert ctxext_main(["finetune", "--recipe", str(recipe), "--resume", "--short-fraction", "0.25"]) == 2


# ------------------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    "changes, flags, message",
    [
        ({}, ["--mixed-window", "--short-fraction", "1.5"], "'mixed_window.short_fraction' must be between 0 and 1"),
        ({}, ["--mixed-window", "--short-fraction", "-0.1"], "'mixed_window.short_fraction' must be between 0 and 1"),
        ({}, ["--mixed-window", "--short-fraction", "half"], "'mixed_window.short_fraction' must be a number"),
        ({"method": {"method": "none"}}, ["--mixed-window"], "with method none the rotary is not patched"),
        ({}, ["--mixed-window", "--short-length", "128"], "must not exceed the model's original length (64)"),
        (
            {"method": {"method": "linear", "factor": 4, "logn": True}},
            ["--mixed-window"],
            "also changes the attention layers",
        ),
        ({"pose": {"enabled": True, "train_window": 64}}, ["--mixed-window"], "mixed_window and pose cannot"),
    ],
)
def test_bad_input_is_one_line_exit_2_and_writes_nothing(
    tmp_path,
    finetune_checkpoint,
    finetune_texts,
    capsys,
    changes,
    flags,
    message,
):
    output = tmp_path / "out"
    recipe = write_recipe(tmp_path, finetune_checkpoint, finetune_texts, output, **changes)
    assert ctxext_main(["finetune", "--recipe", str(recipe), "--no-progress", *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("ctxext finetune: error: ") and message in err[-1], err
    assert not output.exists()


def test_bad_input_from_the_command_line(tmp_path, finetune_checkpoint, finetune_texts):
    recipe = write_recipe(tmp_path, finetune_checkpoint, finetune_texts, tmp_path / "out", method={"method": "none"})
    command = [sys.executable, "-m", "ctxext", "finetune", "--recipe", str(recipe), "--mixed-window"]
    run = subprocess.run(command, cwd=REPO, env=child_process_env(), capture_output=True, text=True)
    assert run.returncode == 2
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ctxext finetune: error:"), run.stderr


def test_a_run_recorded_before_mixed_window_existed_still_resumes(tmp_path):
    """recipe.yaml files written before the mixed_window section existed read as having its defaults."""
    import yaml

    from ctxext.train.recipe import recipe_from_mapping
    from ctxext.train.records import write_or_check_recipe

    recipe = recipe_from_mapping({"model": "m", "output_dir": str(tmp_path), "data": {"dataset": "shakespeare"}})
    older = recipe.to_dict()
    del older["mixed_window"]
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(older))
    write_or_check_recipe(tmp_path / "recipe.yaml", recipe, resume=True)  # no error: the same recipe
    recipe.mixed_window.enabled = True
    with pytest.raises(ctxext.errors.CtxextError, match="in: mixed_window"):
        write_or_check_recipe(tmp_path / "recipe.yaml", recipe, resume=True)
