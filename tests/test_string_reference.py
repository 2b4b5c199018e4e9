"""ctxext's string against the numbers of STRING's own code (HKUNLP/STRING string_for_llama.py, the commit in the
fixture), run under its transformers 4.43.3 by benchmarks/string_reference.py on a tiny random LLaMA: L = 64,
S = 21 (int(0.33 L)), W = 4, 150 tokens, then 4 greedy tokens.

Two runs of the reference are stored. Fed one token per forward after its first S - 1 tokens, every position goes
through its decoding path, which attends the S nearest keys at r' = r and the rest at r - S + W, ctxext's rule:
the logits agree to fp32 rounding. Its one-forward prefill (as its scripts run it) calls flash-attn with
window_size = [S, 0], which holds S + 1 keys, so the key at r = S is attended twice (at r' = S in the window and at
r' = W in the shifted part): its logits from position S on differ from ctxext's (and from its own decoding path),
those before S agree. The flash-attn calls ran over benchmarks/chunkllama_reference.py's stub, which
tests/test_chunkllama_reference.py holds to torch's SDPA."""

import json
from pathlib import Path

import pytest
import torch

import ctxext
from tests.helpers import prefill_and_generate, tiny_model

FIXTURE = json.loads((Path(__file__).parent / "fixtures" / "string_reference.json").read_text())
EXACT = 1e-5  # fp32 logits of two implementations of the same sums (observed 7e-7)


@pytest.fixture(scope="module")
def ctxext_run():
    settings = FIXTURE["settings"]
    model = ctxext.patch(
        tiny_model("llama", seed=3),
        "string",
        shifted_offset=settings["shifted_offset"],
        local_value=settings["small_local_value"],
    )
    return prefill_and_generate(model, settings["new_tokens"])


def run(name):
    r = FIXTURE["runs"][name]
    return torch.tensor(r["prefill_logits"]), r["tokens"], torch.tensor(r["logits"])


def test_the_references_decoding_path_is_ctxext_to_fp32_rounding(ctxext_run):
    prefill, tokens, logits = ctxext_run
    want_prefill, want_tokens, want_logits = run("stepwise")
    assert tokens == want_tokens
    torch.testing.assert_close(prefill, want_prefill, rtol=0, atol=EXACT)
    torch.testing.assert_close(logits, want_logits, rtol=0, atol=EXACT)


def test_its_one_forward_prefill_differs_from_S_on_by_the_key_it_counts_twice(ctxext_run):
    prefill, tokens, _ = ctxext_run
    shipped, shipped_tokens, _ = run("as_shipped")
    S = FIXTURE["settings"]["shifted_offset"]
    torch.testing.assert_close(prefill[:S], shipped[:S], rtol=0, atol=EXACT)
    assert (prefill[S:] - shipped[S:]).abs().max() > 100 * EXACT
    assert tokens == shipped_tokens  # the same greedy answer on this model
