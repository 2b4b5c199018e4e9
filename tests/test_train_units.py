"""The fine-tuning pieces that need no model: recipe, schedule, data order, packing, PoSE positions."""

import numpy as np
import pytest
import torch

from ctxext.errors import CtxextError
from ctxext.train.batches import sample_indices
from ctxext.train.data import PackedSequences, check_held_out, tokenize_stream
from ctxext.train.loop import lr_factor
from ctxext.train.pose import pose_generator, pose_position_ids
from ctxext.train.recipe import apply_overrides, load_recipe, parse_overrides, recipe_from_mapping
from ctxext.train.trackers import tracker_config, tracker_names

MINIMAL = {"model": "m", "output_dir": "o", "data": {"text_files": ["x.txt"]}}


# ------------------------------------------------------------------------------------------------ recipe
def test_defaults_are_the_pi_recipe():
    """The PI recipe (docs/METHODS.md): AdamW (0.9, 0.95), weight decay 0, lr 2e-5, 20 warm-up steps from 10% of
    lr, 1000 steps; LoRA on q,k,v,o with embeddings and norms trainable (LongLoRA)."""
    recipe = recipe_from_mapping(MINIMAL)
    assert recipe.optim.betas == [0.9, 0.95]
    assert recipe.optim.weight_decay == 0.0
    assert recipe.optim.lr == 2e-5
    assert (recipe.optim.warmup_steps, recipe.optim.warmup_start_factor) == (20, 0.1)
    assert recipe.optim.schedule == "constant"
    assert recipe.train.max_steps == 1000
    assert recipe.lora.target_modules == ["q_proj", "k_proj", "v_proj", "o_proj"]
    assert recipe.lora.train_embeddings_and_norms is True
    assert (recipe.method.method, recipe.method.factor) == ("linear", 4.0)


def test_paper_recipe_file_matches_the_paper():
    recipe = load_recipe("configs/recipes/pi-llama-7b-8k.yaml")
    assert (recipe.seq_len, recipe.train.global_batch_size, recipe.method.factor) == (8192, 64, 4)
    assert recipe.eval.stride == 256 and recipe.eval.lengths == [8192, 2048]


@pytest.mark.parametrize(
    "path",
    [
        "configs/recipes/tiny-cpu.yaml",
        "configs/recipes/mistral-7b-yarn-16k.yaml",
        "configs/recipes/qwen2.5-0.5b-pose-64k.yaml",
        "configs/recipes/llama3-8b-yarn-64k-sp4.yaml",
    ],
)
def test_shipped_recipes_load(path):
    recipe = load_recipe(path)
    assert recipe.train_sequence_length <= recipe.seq_len


@pytest.mark.parametrize(
    "mapping, message",
    [
        ({**MINIMAL, "lora": {"aplha": 8}}, "unknown key 'aplha' in section 'lora' (did you mean 'alpha'?)"),
        ({**MINIMAL, "optimm": {}}, "unknown key 'optimm' in the recipe (did you mean 'optim'?)"),
        ({**MINIMAL, "method": {"method": "lineer"}}, "did you mean 'linear'?"),
        ({**MINIMAL, "train": {"precision": "bf61"}}, "'train.precision' must be one of"),
        ({**MINIMAL, "optim": {"betas": [0.9]}}, "'optim.betas' must be two numbers"),
        ({"model": "m", "output_dir": "o"}, "give the training data"),
        ({**MINIMAL, "seq_len": 0}, "'seq_len' must be >= 1"),
        ({**MINIMAL, "seq_len": 1024, "pose": {"enabled": True, "train_window": 2048}}, "must not exceed seq_len"),
    ],
)
def test_recipe_errors_are_one_line(mapping, message):
    with pytest.raises(CtxextError) as error:
        recipe_from_mapping(mapping)
    assert message in str(error.value)
    assert "\n" not in str(error.value)


def test_overrides_set_dotted_keys_with_typed_values():
    overrides = parse_overrides(
        [
            "lora.r=16",
            "optim.lr=1e-4",
            "seq_len=4096",
            "lora.target_modules=[q_proj]",
            "method.factor=8",
            "train.gradient_checkpointing=false",
        ]
    )
    recipe = recipe_from_mapping(apply_overrides(MINIMAL, overrides))
    assert recipe.lora.r == 16 and recipe.optim.lr == 1e-4 and recipe.seq_len == 4096
    assert recipe.lora.target_modules == ["q_proj"] and recipe.method.factor == 8
    assert recipe.train.gradient_checkpointing is False
    with pytest.raises(CtxextError, match="key=value"):
        parse_overrides(["lora.r"])


# ---------------------------------------------------------------------------------------------- schedule
def test_warmup_is_linear_from_ten_percent_then_constant():
    """PI: 'linear learning rate warm-up of 20 steps beginning from 10% of the maximum learning rate'."""
    expected = np.linspace(0.1, 1.0, 21)  # steps 0..20: 10% ... 100% in equal increments
    got = [lr_factor(s, 20, 0.1, "constant", 1000) for s in range(21)]
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-12)
    assert all(lr_factor(s, 20, 0.1, "constant", 1000) == 1.0 for s in (20, 500, 999))
    assert lr_factor(999, 20, 0.1, "cosine", 1000) == pytest.approx(0.1)


@pytest.mark.parametrize("world, micro, global_batch", [(1, 1, 4), (1, 2, 4), (2, 1, 4), (2, 2, 8), (4, 1, 8)])
def test_every_step_uses_its_global_batch_exactly_once(world, micro, global_batch):
    accumulation = global_batch // (micro * world)
    for step in range(3):
        used = [
            i
            for rank in range(world)
            for m in range(accumulation)
            for i in sample_indices(step, m, rank, world, micro, global_batch)
        ]
        assert sorted(used) == list(range(step * global_batch, (step + 1) * global_batch))


# ------------------------------------------------------------------------------------------------- data
def test_packed_sequences_are_stream_slices_in_a_seeded_order():
    stream = np.arange(10_000, dtype=np.int64)  # token value = its position: a slice is easy to recognise
    packed = PackedSequences(stream, 100, seed=3)
    again = PackedSequences(stream, 100, seed=3)
    n = packed.per_epoch
    first_epoch = [packed[i] for i in range(n)]
    for sample in first_epoch:  # contiguous stream slices
        assert torch.equal(sample, torch.arange(int(sample[0]), int(sample[0]) + 100))
    starts = sorted(int(s[0]) for s in first_epoch)
    assert starts == list(range(0, n * 100, 100))  # epoch 0: every chunk once, none overlapping
    assert [int(s[0]) for s in first_epoch] != starts  # ... in a shuffled order
    second_epoch_starts = {int(packed[n + i][0]) % 100 for i in range(n)}
    assert len(second_epoch_starts) == 1  # one offset per epoch
    assert all(torch.equal(packed[i], again[i]) for i in (0, 5, n + 7, 3 * n + 1))  # deterministic
    assert not all(torch.equal(packed[i], PackedSequences(stream, 100, seed=4)[i]) for i in range(5))
    with pytest.raises(CtxextError, match="too few"):
        PackedSequences(stream[:150], 100)


def test_token_stream_is_each_text_then_eos():
    from ctxext.train.pretrain_tiny import train_bpe_tokenizer

    texts = [("a", "To be, or not to be"), ("b", "that is the question"), ("c", "Whether 'tis nobler")]
    tokenizer = train_bpe_tokenizer([t for _, t in texts] * 20, 300)
    stream, names = tokenize_stream(iter(texts), tokenizer, max_tokens=None)
    expected = []
    for _, text in texts:
        expected += tokenizer(text, add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
    assert stream.tolist() == expected and names == ["a", "b", "c"]
    capped, _ = tokenize_stream(iter(texts), tokenizer, max_tokens=7)
    assert capped.tolist() == expected[:7]


def test_held_out_documents_must_not_be_trained_on():
    check_held_out(["hamlet_gut", "lear_gut"], ["othello_gut", "macbeth_gut"])
    check_held_out(["emozilla/pg19[3]"], ["pg19[3]"])  # dataset rows are positions, not identities
    with pytest.raises(CtxextError, match="othello_gut"):
        check_held_out(["othello_gut", "lear_gut"], ["othello_gut+macbeth_gut"])


# ------------------------------------------------------------------------------------------------- PoSE
@pytest.mark.parametrize("chunks", [1, 2, 3])
def test_pose_positions_are_chunks_with_growing_skips(chunks):
    window, target = 64, 512
    skips_seen = []
    for sample in range(200):
        positions = pose_position_ids(window, target, chunks, pose_generator(0, sample))
        assert positions.shape == (window,)
        assert positions[0] == 0 and int(positions[-1]) < target
        steps = positions[1:] - positions[:-1]
        assert bool((steps >= 1).all())
        # Inside a chunk positions advance by one; there are at most chunks-1 jumps.
        assert int((steps > 1).sum()) <= chunks - 1
        skips_seen.append(int(positions[-1]) - (window - 1))
    if chunks == 1:
        assert set(skips_seen) == {0}
    elif chunks == 2:
        # u_1 is uniform over [0, target - window]: its mean is half the range, and it reaches both ends.
        span = target - window
        assert abs(np.mean(skips_seen) - span / 2) < 0.1 * span
        assert min(skips_seen) < 0.1 * span and max(skips_seen) > 0.9 * span
    else:
        assert max(skips_seen) > 0.9 * (target - window)  # nested draws: the last skip leans high
    assert torch.equal(
        pose_position_ids(window, target, chunks, pose_generator(1, 5)),
        pose_position_ids(window, target, chunks, pose_generator(1, 5)),
    )


def test_the_training_loop_plans_the_windows_of_the_protocol():
    """Against the protocol written out by hand (docs/METHODS.md): windows of `length` tokens starting every
    `stride` tokens, each scoring the tokens the previous one did not reach, the first token never a target
    (no BOS); where the window is not longer than the stride, the stride is half the window."""
    from ctxext.eval.data import Document
    from ctxext.train.evaluation import plan_length

    def expected(n_tokens, length, stride):
        windows, reached = [], 1  # tokens [0, reached) are scored or cannot be (the first)
        for begin in range(0, n_tokens, stride):
            end = min(begin + length, n_tokens)
            windows.append((begin, end, end - reached))
            reached = end
            if end == n_tokens:
                return windows

    docs = [Document("d", torch.arange(300))]
    for length, stride, effective in [(64, 64, 32), (64, 100, 32), (128, 32, 32), (100, 64, 64)]:
        plan = plan_length(docs, length, stride, None)
        assert plan.stride == effective
        assert [(w.begin, w.end, w.scored) for w in plan.windows] == expected(300, length, effective)
        assert plan.scored_tokens == 299  # every token but the first, once
    assert [(w.begin, w.end, w.scored) for w in plan_length(docs, 128, 32, None).windows][-2:] == [
        (160, 288, 32),
        (192, 300, 12),
    ]


# --------------------------------------------------------------------------------------------- trackers
def test_report_to_names_trackers_and_refuses_unknown_ones():
    assert tracker_names(None) == tracker_names("") == tracker_names("none") == ()
    assert tracker_names("tensorboard, TensorBoard") == ("tensorboard",)
    assert tracker_names(["tensorboard"]) == ("tensorboard",)
    with pytest.raises(CtxextError, match="unknown tracker 'tensorbord' \\(did you mean 'tensorboard'\\?\\)"):
        tracker_names("tensorbord")


@pytest.mark.parametrize("tracker", ["wandb", "mlflow"])
def test_report_to_a_tracker_that_is_not_installed_is_one_line_naming_the_pip_install(tmp_path, capsys, tracker):
    import importlib.util

    from ctxext.cli import main

    if importlib.util.find_spec(tracker) is not None:
        pytest.skip(f"{tracker} is installed here")
    output = tmp_path / "run"
    args = ["finetune", "model=m", f"output_dir={output}", "data.text_files=[x.txt]", "--report-to", tracker]
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"pip install {tracker} " in err[0], err
    assert not output.exists()


def test_tracker_config_is_the_recipe_flattened_to_scalars():
    recipe = recipe_from_mapping({**MINIMAL, "lora": {"r": 4}})
    flat = tracker_config(recipe.to_dict())
    assert flat["lora.r"] == 4 and flat["optim.lr"] == 2e-5 and flat["method.method"] == "linear"
    assert flat["lora.target_modules"] == '["q_proj", "k_proj", "v_proj", "o_proj"]'
    assert flat["eval.lengths"] == "null" and flat["train.gradient_checkpointing"] is True
    assert all(isinstance(v, (bool, int, float, str)) for v in flat.values())  # what TensorBoard's hparams take
    # Every leaf of the recipe once, under its dotted name.
    leaves = sum(len(v) if isinstance(v, dict) else 1 for v in recipe.to_dict().values())
    assert len(flat) == leaves


# ------------------------------------------------------------------------------------------- run files
def test_truncating_the_metrics_log_replaces_the_file_instead_of_rewriting_it(tmp_path):
    """A reader of metrics.jsonl (or a crash) never sees it half written: the kept lines go to a new file that is
    renamed onto the old one."""
    import json
    import os

    from ctxext.train.records import MetricsLog

    log = MetricsLog(tmp_path / "metrics.jsonl", enabled=True)
    for step in range(1, 6):
        log.write({"kind": "train", "step": step, "loss": 1.0 / step})
    with open(log.path) as reader:  # opened before the truncation: still reads the whole old file
        log.truncate_after(3)
        assert len(reader.read().splitlines()) == 5
    assert [json.loads(line)["step"] for line in log.path.read_text().splitlines()] == [1, 2, 3]
    assert [r["step"] for r in log.read()] == [1, 2, 3]
    assert os.listdir(tmp_path) == ["metrics.jsonl"]  # no temporary file left behind
