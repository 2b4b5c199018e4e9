"""ctxext's gali against the numbers of GALI's own code (AcademyCityL/GALI, the commit in the fixture), run under
its transformers 4.46.2 by benchmarks/gali_reference.py on a tiny random LLaMA: 150 tokens past L = 64, w = 1.

With `chunk_coe = 1` the reference's prefill takes one position list per token (the query at the list's last
position), the rule ctxext applies to every query: the greedy tokens and their logits agree. With its shipped
`chunk_coe = 3000` the tokens past L share one list, built for the chunk's end: the logits differ (the documented
difference, docs/METHODS.md)."""

import json
from pathlib import Path

import pytest
import torch

import ctxext
from tests.helpers import tiny_model

FIXTURE = json.loads((Path(__file__).parent / "fixtures" / "gali_reference.json").read_text())
TOLERANCE = 1e-5  # fp32 logits of two implementations of the same sums


@pytest.fixture(scope="module")
def ctxext_answer():
    model = ctxext.patch(tiny_model("llama", seed=3), "gali", factor=4, local_window=1)
    ids = torch.randint(0, 256, (1, 150), generator=torch.Generator().manual_seed(7))
    new = FIXTURE["settings"]["new_tokens"]
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new,
            do_sample=False,
            output_scores=True,
            return_dict_in_generate=True,
            pad_token_id=0,
        )
    return out.sequences[0, ids.shape[1] :].tolist(), torch.stack(out.scores)[:, 0]


def reference(chunk_coe: int):
    row = FIXTURE["by_chunk_coe"][str(chunk_coe)]
    return row["tokens"], torch.tensor(row["logits"])


def test_one_list_per_token_is_the_references_answer_and_logits(ctxext_answer):
    tokens, logits = ctxext_answer
    want_tokens, want_logits = reference(1)
    assert tokens == want_tokens
    torch.testing.assert_close(logits, want_logits, rtol=0, atol=TOLERANCE)


def test_the_references_shipped_chunked_prefill_is_the_stated_difference(ctxext_answer):
    _, logits = ctxext_answer
    _, chunked = reference(3000)
    assert (logits - chunked).abs().max() > 10 * TOLERANCE
