"""Passkey retrieval: the scorer on crafted outputs, the prompt format, and SmolLM2 against a broken copy."""

import json

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM, AutoTokenizer

from ctxext.cli import main
from ctxext.eval.passkey import (
    FILLER,
    QUESTION,
    TASK,
    accuracy_rows,
    build_prompt,
    first_integer,
    is_correct,
    key_line,
    plan_trials,
    run_passkey,
)
from ctxext.eval.runner import EvalMethod
from ctxext.runtime import resolve_dtype


@pytest.mark.parametrize(
    "output,key,correct",
    [
        (" 12345. Remember it.", 12345, True),
        ("12345", 12345, True),
        (" 1234", 12345, False),  # a prefix of the key is not the key
        (" 123456", 12345, False),
        (" 12,345", 12345, False),  # the first integer is 12
        (" the key is 4242 and", 4242, True),
        (" 7 and then 4242", 4242, False),  # only the first integer counts
        (" no number here", 4242, False),
        ("", 1, False),
        (" 00042", 42, True),  # an integer, not a string
    ],
)
def test_scorer_on_crafted_outputs(output, key, correct):
    assert is_correct(output, key) is correct


def test_first_integer():
    assert first_integer("abc 17 x 18") == 17 and first_integer("none") is None


@pytest.fixture(scope="module")
def tokenizer(smollm2_path):
    return AutoTokenizer.from_pretrained(smollm2_path)


@pytest.mark.parametrize("length", [300, 1024, 4096])
@pytest.mark.parametrize("depth", [0.0, 0.5, 1.0])
def test_prompt_fits_the_length_and_places_the_key(tokenizer, length, depth):
    ids = build_prompt(tokenizer, length, depth, 31337)
    assert length - 40 < len(ids) <= length  # whole filler sentences, as many as fit
    text = tokenizer.decode(ids)
    assert text.startswith(TASK) and text.endswith(QUESTION) and key_line(31337) in text
    before = text.split(key_line(31337))[0].count(FILLER)
    after = text.split(key_line(31337))[1].count(FILLER)
    assert before == round(depth * (before + after))
    with_bos = build_prompt(tokenizer, length, depth, 31337, bos_token_id=tokenizer.bos_token_id)
    assert with_bos[0] == tokenizer.bos_token_id and len(with_bos) <= length


def test_trials_are_seeded_and_in_range():
    a, b = plan_trials([1024, 2048], [0, 1], 3, seed=1), plan_trials([1024, 2048], [0, 1], 3, seed=1)
    assert a == b and len(a) == 12 and all(1 <= t.key <= 50000 for t in a)
    assert plan_trials([1024], [0], 3, seed=2) != plan_trials([1024], [0], 3, seed=1)


def test_accuracy_rows():
    records = [
        {"method": "m", "length": 10, "depth": d, "correct": c}
        for d, c in [(0, True), (0, False), (1, True), (1, True)]
    ]
    by_depth, by_length = accuracy_rows(records)
    assert by_length == [{"method": "m", "length": 10, "trials": 4, "correct": 3, "accuracy": 0.75}]
    assert {(r["depth"], r["accuracy"]) for r in by_depth} == {(0, 0.5), (1, 1.0)}


class ScrambledPositions(nn.Module):
    """A rotary embedding fed shuffled positions: the model can no longer tell where tokens are."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner
        self.generator = torch.Generator().manual_seed(0)

    def forward(self, x, position_ids):
        n = position_ids.shape[-1]
        scrambled = position_ids[..., torch.randperm(n, generator=self.generator)]
        if n == 1:  # decoding: a random position instead of the next one
            scrambled = torch.randint(0, int(position_ids.max()) + 1, position_ids.shape, generator=self.generator)
        return self.inner(x, scrambled)


def test_smollm2_finds_the_key_and_a_scrambled_copy_does_not(smollm2_path, tokenizer):
    # --dtype auto's choice: bf16 where the CPU has it natively, else fp32 (about 3x faster than bf16 there)
    dtype = resolve_dtype("auto", torch.device("cpu"))
    model = AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=dtype).eval()
    trials = plan_trials([512], [0.25, 0.75], 2, seed=0)
    records = run_passkey(model, tokenizer, trials, [EvalMethod("none")], None)
    good = sum(r["correct"] for r in records)
    model.model.rotary_emb = ScrambledPositions(model.model.rotary_emb)
    broken = run_passkey(model, tokenizer, trials, [EvalMethod("none")], None)
    bad = sum(r["correct"] for r in broken)
    assert good >= 3 and bad == 0, (records, broken)


def test_passkey_cli_writes_table_json_and_heatmap(smollm2_path, tmp_path, capsys):
    out = tmp_path / "out"
    assert (
        main(
            [
                "passkey",
                str(smollm2_path),
                "--lengths",
                "512",
                "--passkey-depths",
                "0,1",
                "--passkey-trials",
                "1",
                "--method",
                "yarn",
                "--factor",
                "2",
                "--no-progress",
                "-o",
                str(out),
            ]
        )
        == 0
    )
    results = json.loads((out / "results.json").read_text())
    assert [m["label"] for m in results["methods"]] == ["none", "yarn x2"]
    assert len(results["trials"]) == 4 and all(r["prompt_tokens"] <= 512 for r in results["trials"])
    assert {r["key"] for r in results["trials"] if r["method"] == "none"} == {
        r["key"] for r in results["trials"] if r["method"] == "yarn x2"
    }
    assert (out / "passkey.png").stat().st_size > 1000 and (out / "results.csv").is_file()
    assert "passkey accuracy" in capsys.readouterr().out


@pytest.mark.parametrize(
    "args,message",
    [
        (["--lengths", "1k", "--passkey-trials", "0"], "--passkey-trials"),
        (["--lengths", "1k", "--passkey-depths", "0,2"], "--passkey-depths"),
        (["--lengths", "x"], "--lengths"),
    ],
)
def test_passkey_bad_input(smollm2_path, tmp_path, capsys, args, message):
    assert main(["passkey", str(smollm2_path), *args, "-o", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]
    assert not (tmp_path / "out").exists()
