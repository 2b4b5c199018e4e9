"""ctxext's rerope and leaky_rerope against the numbers of Su's own code (bojone/rerope `rerope_patch.py`,
`leaky_rerope_patch.py`, the commit in the fixture), run under its transformers 4.31.0 by
benchmarks/authors_reference_llama.py on a tiny random LLaMA: 150 tokens past L = 64, window w = 16, Leaky k = 16.

Su's patches always scale queries by max(1, ln n / ln training_length); with training_length = L = 64 that is
ctxext's logn=True, active here past position 63. His prefill attends twice (plain and rectified) and picks per
pair, his decode rotates only the cached keys, by -min(r, w) (Leaky: -(w + (r - w)/k) past w); ctxext's kernel
gives the same logits on both paths."""

import json
from pathlib import Path

import pytest
import torch

import ctxext
from tests.helpers import cached_greedy, tiny_model

FIXTURE = json.loads((Path(__file__).parent / "fixtures" / "rerope_reference.json").read_text())
TOLERANCE = 1e-5  # fp32 logits (|logit| < 1) of two orderings of the same sums; 2e-7 seen when made
SETTINGS = ["window=16,training_length=64", "window=16,training_length=64,k=16"]


def greedy(setting: dict) -> dict:
    model = ctxext.patch(tiny_model("llama", seed=3), setting["method"], **setting["ctxext_kwargs"])
    return cached_greedy(model, len(setting["tokens"]))


@pytest.mark.parametrize("key", SETTINGS)
def test_every_position_and_the_answer_are_the_references(key):
    setting = FIXTURE["settings"][key]
    ours = greedy(setting)
    assert ours["full"].argmax(-1).tolist() == setting["prefill_argmax"]
    want = torch.tensor(setting["prefill_logits"])
    torch.testing.assert_close(ours["full"][setting["logit_positions"]], want, rtol=0, atol=TOLERANCE)
    assert ours["tokens"] == setting["tokens"]
    torch.testing.assert_close(ours["logits"], torch.tensor(setting["logits"]), rtol=0, atol=TOLERANCE)
