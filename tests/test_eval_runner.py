"""The multi-method runner: plans per length (skip / truncate short documents), same tokens for every method."""

import pytest
import torch

from ctxext.config import MethodConfig
from ctxext.errors import CtxextError
from ctxext.eval.data import Document, tokens_fingerprint
from ctxext.eval.options import parse_lengths, parse_stride
from ctxext.eval.runner import EvalMethod, plan_lengths, run_perplexity
from tests.helpers import naive_nll, tiny_model


def docs(*lengths):
    g = torch.Generator().manual_seed(0)
    return [Document(f"d{i}", torch.randint(2, 256, (n,), generator=g)) for i, n in enumerate(lengths)]


def test_short_documents_are_skipped_or_truncated():
    documents = docs(100, 40, 70)
    skip = plan_lengths(documents, [32, 64], 16, None, "skip")
    assert [p.skipped for p in skip] == [[], ["d1"]] and [p.documents for p in skip] == [3, 2]
    trunc = plan_lengths(documents, [32, 64], 16, None, "truncate")
    assert trunc[1].truncated == ["d1"] and trunc[1].skipped == []
    (short,) = [w for w in trunc[1].windows if w.doc == 1]
    assert (short.begin, short.end, short.scored) == (0, 40, 39)
    with pytest.raises(CtxextError, match="too short for length 128: no document has 128 tokens .the longest has 100"):
        plan_lengths(documents, [32, 128], 16, None, "skip")


def test_runner_matches_naive_loop_per_document_and_method():
    model = tiny_model("mistral", max_position_embeddings=32)
    documents = docs(90, 40)
    plans = plan_lengths(documents, [64], 16, None, "truncate")
    methods = [EvalMethod("none"), EvalMethod("yarn x2", MethodConfig("yarn", factor=2))]
    scores = run_perplexity(model, documents, plans, methods, None)
    assert [s.method for s in scores] == ["none", "yarn x2"]
    # The targets, as the HF-docs loop scores them (written out here): every token once, the first of a document
    # never; the truncated short document in one window of its own.
    targets = []
    for doc, (window, stride) in zip(documents, ((64, 16), (40, 40))):
        previous = 0
        for begin in range(0, len(doc), stride):
            end = min(begin + window, len(doc))
            targets.append(doc.ids[max(previous, 1) : end])
            previous = end
            if end == len(doc):
                break
    assert scores[0].tokens_sha256 == scores[1].tokens_sha256 == tokens_fingerprint(targets)
    none = scores[0]
    parts = [naive_nll(model, documents[0].ids, 64, 16), naive_nll(model, documents[1].ids, 40, 40)]
    assert none.tokens == sum(c for _, c in parts) and none.truncated == ["d1"]
    assert none.nll_sum == pytest.approx(sum(n for n, _ in parts), rel=1e-5)
    assert model.model.rotary_emb.__class__.__name__ != "ScaledRotaryEmbedding"  # unpatched afterwards


def test_length_and_stride_parsing():
    assert parse_lengths("4k, 2048,2k") == [2048, 4096]
    assert parse_stride("window") is None and parse_stride("256") == 256
    for bad in ("2k,x", "", "1", "-5"):
        with pytest.raises(CtxextError):
            parse_lengths(bad)
    for bad in ("0", "-1", "abc"):
        with pytest.raises(CtxextError):
            parse_stride(bad)
