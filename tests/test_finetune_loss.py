"""`ctxext finetune` learns: the training loss falls, and the merged checkpoint has a lower loss than the patched
base model on held-out text from the training distribution (measured here with a plain forward with labels).

The data is a Markov chain over the 256 words of the tiny tokenizer: after word t comes word NEXT[t] with
probability 0.9, any word otherwise. A random model starts near ln 256 = 5.5 nats per token; the chain's
entropy is about 0.9 nats, so there is much to learn in a few steps.
"""

import json

import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM, AutoTokenizer

import ctxext
from ctxext.cli import main
from tests.helpers import save_tiny_checkpoint, tiny_model

L, FACTOR, SEQ_LEN = 64, 2, 128
STEPS = 30
EOS = "w255"
NEXT = torch.randperm(256, generator=torch.Generator().manual_seed(1))


def markov_words(n: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    follow = torch.rand(n, generator=generator) < 0.9
    random_words = torch.randint(0, 256, (n,), generator=generator)
    words = [int(random_words[0])]
    for i in range(1, n):
        words.append(int(NEXT[words[-1]]) if follow[i] else int(random_words[i]))
    return words


def as_text(words) -> str:
    return " ".join(f"w{w}" for w in words)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("finetune-loss")
    checkpoint = save_tiny_checkpoint(folder / "tiny", tiny_model("llama", max_position_embeddings=L))
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    tokenizer.eos_token = EOS  # packing puts EOS between documents
    tokenizer.save_pretrained(checkpoint)
    train = folder / "train.txt"
    train.write_text(as_text(markov_words(12_000, seed=0)))
    held_out = folder / "held_out.txt"
    held_out.write_text(as_text(markov_words(4 * SEQ_LEN, seed=1)))
    output = folder / "run"
    recipe = {
        "model": str(checkpoint),
        "method": {"method": "linear", "factor": FACTOR},
        "seq_len": SEQ_LEN,
        "output_dir": str(output),
        "seed": 0,
        "lora": {"r": 4, "alpha": 8, "dropout": 0.0},
        "optim": {"lr": 1e-2, "warmup_steps": 2},
        "train": {
            "max_steps": STEPS,
            "global_batch_size": 4,
            "micro_batch_size": 4,
            "precision": "fp32",
            "gradient_checkpointing": False,
            "checkpoint_every": 0,
            "log_every": 1,
        },
        "data": {"text_files": [str(train)]},
        "eval": {"every": 0, "dataset": None, "text_files": [str(held_out)]},
    }
    path = folder / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    assert main(["finetune", "--recipe", str(path), "--no-progress"]) == 0
    return checkpoint, held_out, output


def test_training_loss_falls(run):
    _, _, output = run
    records = [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if r["kind"] == "train"]
    assert len(losses) == STEPS
    first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
    assert first > 5.0  # a random model: about ln 256
    assert last < first - 0.8, losses


def held_out_loss(model, ids) -> float:
    """Mean next-token NLL over SEQ_LEN-token sequences of the held-out text (a plain forward with labels)."""
    batch = ids[: len(ids) // SEQ_LEN * SEQ_LEN].view(-1, SEQ_LEN)
    with torch.no_grad():
        return float(model(input_ids=batch, labels=batch).loss)


def test_merged_checkpoint_has_a_lower_held_out_loss_than_the_patched_base(run):
    checkpoint, held_out, output = run
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    ids = torch.tensor(tokenizer(held_out.read_text(), add_special_tokens=False).input_ids)
    assert len(ids) == 4 * SEQ_LEN
    base = ctxext.patch(
        AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32), "linear", factor=FACTOR
    ).eval()
    merged = AutoModelForCausalLM.from_pretrained(output / "merged", dtype=torch.float32).eval()
    assert merged.config.rope_parameters["rope_type"] == "linear"  # the merged model carries the method
    before, after = held_out_loss(base, ids), held_out_loss(merged, ids)
    assert before > 5.0
    assert after < before - 0.8, (before, after)
