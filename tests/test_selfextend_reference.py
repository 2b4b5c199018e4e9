"""ctxext's self_extend against the numbers of SelfExtend's own code (datamllab/LongLM
`self_extend_patch/Llama.py`, the commit in the fixture), run under its transformers 4.38.2 by
benchmarks/authors_reference_llama.py on a tiny random LLaMA: 150 tokens past L = 64, neighbour window w = 16.

At G = 4 (w a multiple of G) every prefill position's logits and the greedy answer agree. At G = 3 the reference's
Llama.py shifts grouped queries by w - w/G = 10.67 (a float), ctxext (and LongLM's own Llama_4_40.py) by
w - floor(w/G) = 11: the logits agree inside the window and differ past it (the stated difference)."""

import json
from pathlib import Path

import torch

import ctxext
from tests.helpers import cached_greedy, tiny_model

FIXTURE = json.loads((Path(__file__).parent / "fixtures" / "selfextend_reference.json").read_text())
TOLERANCE = 1e-5  # fp32 logits (|logit| < 1) of two orderings of the same sums; 2e-7 seen when made


def greedy(setting: dict) -> dict:
    model = ctxext.patch(tiny_model("llama", seed=3), setting["method"], **setting["ctxext_kwargs"])
    return cached_greedy(model, len(setting["tokens"]))


def test_at_g4_every_position_and_the_answer_are_the_references():
    setting = FIXTURE["settings"]["group_size=4,window=16"]
    ours = greedy(setting)
    assert ours["full"].argmax(-1).tolist() == setting["prefill_argmax"]
    want = torch.tensor(setting["prefill_logits"])
    torch.testing.assert_close(ours["full"][setting["logit_positions"]], want, rtol=0, atol=TOLERANCE)
    assert ours["tokens"] == setting["tokens"]
    torch.testing.assert_close(ours["logits"], torch.tensor(setting["logits"]), rtol=0, atol=TOLERANCE)


def test_at_g3_the_references_fractional_shift_is_the_stated_difference():
    setting = FIXTURE["settings"]["group_size=3,window=16"]
    ours = greedy(setting)
    positions = setting["logit_positions"]
    diff = (ours["full"][positions] - torch.tensor(setting["prefill_logits"])).abs().amax(-1)
    inside = [i for i, p in enumerate(positions) if p < 16]  # every key within w: no grouped position used
    outside = [i for i, p in enumerate(positions) if p >= 16]
    assert diff[inside].max() < TOLERANCE
    assert diff[outside].max() > 10 * TOLERANCE
