"""Every remapping and attention-level method on the batches a trainer makes: right-padded (TRL's default
collator) and left-padded batches, with and without explicit position ids, and padding-free packed rows (TRL's
`packing=True`, transformers' DataCollatorWithFlattening): one row of several documents whose position ids start
again at 0, no attention_mask, with or without the `cu_seq_lens_q/k` and `max_length_q/k` kwargs.

The oracle is each document run alone through the same patched model (held to the per-cell formula of each
method in tests/test_remapping.py and tests/test_backends.py): a batch or a packed row must give every real
token exactly the logits it has when its document runs by itself, remapped from its own position 0 and seeing
no other document. Every document is longer than the method's first region, so positions really are remapped
(checked against the unpatched model).
"""

import pytest
import torch

import ctxext
from ctxext.patching.attention import set_attention_tuning
from tests.helpers import REMAP_L, tiny_model

L = REMAP_L
ATOL = 1e-5

# Small parameters: documents of 34-40 tokens cross every region boundary (GALI moves far keys from 33 on).
METHODS = {
    "rerope": {"window": 7},
    "leaky_rerope": {"window": 7, "k": 3.0},
    "self_extend": {"group_size": 4, "window": 8},
    "dual_chunk": {"chunk_size": 12, "local_window": 2},
    "gali": {"local_window": 3},
    "dpe": {"window": 6, "group_scales": [2, 4, 8, 16]},
    "string": {"shifted_offset": 12, "local_value": 4, "attention_factor": 1.2},
    "logn": {},  # log-n alone: the query scale at each token's own position (an attention-level method)
    "query_temperature": {},
}
IMPLEMENTATIONS = ("eager", "sdpa")
LENGTHS = (40, 34)  # the two documents of a padded batch
PACKED = (40, 12, 34)  # the documents of a packed row


def patched(method: str, implementation: str, logn: bool = False):
    model = tiny_model("llama", max_position_embeddings=L, attn_implementation=implementation)
    if method == "logn":
        ctxext.patch(model, "none", logn=True)
    elif method == "query_temperature":
        ctxext.patch(model, "none", original_max_position_embeddings=L, query_temperature=0.4)
    else:
        ctxext.patch(model, method, logn=logn, **METHODS[method])
        set_attention_tuning(model, query_block=16)  # several query blocks, some across a document boundary
    return model


def documents(lengths, seed=5) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 256, (1, n), generator=generator) for n in lengths]


def alone(model, docs) -> list[torch.Tensor]:
    with torch.no_grad():
        return [model(doc, use_cache=False).logits[0] for doc in docs]


def padded_batch(docs, side: str):
    """(input_ids, attention_mask, position_ids as generate makes them, slices of the real tokens)."""
    width = max(doc.shape[1] for doc in docs)
    rows, masks, spans = [], [], []
    for doc in docs:
        pad = width - doc.shape[1]
        zeros = torch.zeros(1, pad, dtype=torch.long)
        rows.append(torch.cat([doc, zeros] if side == "right" else [zeros, doc], dim=1))
        real = torch.ones(1, doc.shape[1], dtype=torch.long)
        masks.append(torch.cat([real, zeros] if side == "right" else [zeros, real], dim=1))
        spans.append(slice(0, doc.shape[1]) if side == "right" else slice(pad, width))
    mask = torch.cat(masks)
    position_ids = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
    return torch.cat(rows), mask, position_ids, spans


def flattened(docs, flash_kwargs: bool):
    """One packed row as transformers' DataCollatorWithFlattening makes it: position ids from 0 per document,
    no attention_mask; with `return_flash_attn_kwargs`, the cumulative lengths and the longest document."""
    input_ids = torch.cat(docs, dim=1)
    position_ids = torch.cat([torch.arange(doc.shape[1]) for doc in docs])[None]
    kwargs = {"position_ids": position_ids}
    if flash_kwargs:
        lengths = torch.tensor([doc.shape[1] for doc in docs])
        cu = torch.cat([torch.zeros(1, dtype=torch.int32), lengths.cumsum(0).to(torch.int32)])
        longest = int(lengths.max())
        kwargs.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=longest, max_length_k=longest)
    return input_ids, kwargs


def max_error(got, want) -> float:
    return (got.double() - want.double()).abs().max().item()


def assert_remaps(method, docs, expected):
    """The method really acts on these documents: the unpatched model gives other logits."""
    plain = tiny_model("llama", max_position_embeddings=L)
    with torch.no_grad():
        assert max_error(plain(docs[0], use_cache=False).logits[0], expected[0]) > 1e-4, method


# ---------------------------------------------------------------------------------------- padded batches
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("method", list(METHODS))
def test_right_padded_batch_equals_each_document_alone(method, implementation):
    """TRL's default collator pads on the right: position ids None ((1, T) from transformers) or explicit."""
    model = patched(method, implementation)
    docs = documents(LENGTHS)
    expected = alone(model, docs)
    assert_remaps(method, docs, expected)
    input_ids, mask, position_ids, spans = padded_batch(docs, "right")
    with torch.no_grad():
        for ids in (None, position_ids):
            got = model(input_ids, attention_mask=mask, position_ids=ids, use_cache=False).logits
            for row, span in enumerate(spans):
                assert max_error(got[row, span], expected[row]) < ATOL, (row, ids is None)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("method", list(METHODS))
def test_left_padded_batch_equals_each_document_alone(method, implementation):
    """Left padding: each row counts its positions from its first real token, with explicit position ids (as
    generate makes them) and without (transformers' (1, T) arange, shared by the rows)."""
    model = patched(method, implementation)
    docs = documents(LENGTHS, seed=6)
    expected = alone(model, docs)
    input_ids, mask, position_ids, spans = padded_batch(docs, "left")
    with torch.no_grad():
        for ids in (position_ids, None):
            got = model(input_ids, attention_mask=mask, position_ids=ids, use_cache=False).logits
            for row, span in enumerate(spans):
                assert max_error(got[row, span], expected[row]) < ATOL, (row, ids is None)


# ------------------------------------------------------------------------------------------ packed rows
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("method", list(METHODS))
def test_packed_row_equals_each_document_alone(method, implementation):
    """Padding-free packing: one row, position ids from 0 per document, no attention_mask; with and without the
    cu_seq_lens/max_length kwargs; with use_cache=False (transformers then masks across documents itself) and
    with the default cache (it does not: ctxext keeps the documents apart all the same)."""
    model = patched(method, implementation)
    docs = documents(PACKED, seed=7)
    each = alone(model, docs)
    assert_remaps(method, docs, each)
    expected = torch.cat(each)
    for flash_kwargs in (False, True):
        input_ids, kwargs = flattened(docs, flash_kwargs)
        with torch.no_grad():
            got = model(input_ids, use_cache=False, **kwargs).logits[0]
            assert max_error(got, expected) < ATOL, flash_kwargs
            if method not in ("logn", "query_temperature"):  # there the model's own attention runs, as it does
                cached = model(input_ids, **kwargs).logits[0]
                assert max_error(cached, expected) < ATOL, ("cache", flash_kwargs)


@pytest.mark.parametrize("method", ["self_extend", "string"])
def test_packed_row_of_short_documents_equals_each_document_alone(method):
    """Documents inside the method's first region: the model's own attention runs where its mask keeps them
    apart (no cache), the kernel where it does not (the default cache: transformers masks causally only)."""
    model = patched(method, "sdpa")
    docs = documents((7, 5, 8), seed=10)
    expected = torch.cat(alone(model, docs))
    input_ids, kwargs = flattened(docs, flash_kwargs=False)
    with torch.no_grad():
        for use_cache in (False, True):
            got = model(input_ids, use_cache=use_cache, **kwargs).logits[0]
            assert max_error(got, expected) < ATOL, use_cache


def test_packed_row_under_flex_attention_equals_each_document_alone():
    """flex_attention: transformers' BlockMask carries the document boundaries; ctxext reads them from it. The
    documents alone run on SDPA (the same weights; tests/test_backends.py holds flex_attention to it), so that
    transformers compiles its mask for one length only."""
    docs = documents(PACKED[:2], seed=8)
    expected = torch.cat(alone(patched("self_extend", "sdpa"), docs))
    input_ids, kwargs = flattened(docs, flash_kwargs=True)
    with torch.no_grad():
        got = patched("self_extend", "flex_attention")(input_ids, use_cache=False, **kwargs).logits[0]
    assert max_error(got, expected) < ATOL


def test_packed_row_gradients_equal_the_documents_gradients_summed():
    """Training on a packed row: the loss summed over the documents, one backward, gives the gradients of each
    document's own loss summed (the blockwise backend's recomputing backward, across document boundaries)."""
    docs = documents(PACKED, seed=9)

    def gradients(run) -> dict:
        model = patched("self_extend", "sdpa", logn=True).train()
        run(model).backward()
        return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}

    def loss_of(logits, ids):
        return torch.nn.functional.cross_entropy(logits[:-1], ids[1:], reduction="sum")

    def packed_loss(model):
        input_ids, kwargs = flattened(docs, flash_kwargs=True)
        logits = model(input_ids, use_cache=False, **kwargs).logits[0]
        losses, start = [], 0
        for doc in docs:
            n = doc.shape[1]
            losses.append(loss_of(logits[start : start + n], input_ids[0, start : start + n]))
            start += n
        return sum(losses)

    def separate_losses(model):
        return sum(loss_of(model(doc, use_cache=False).logits[0], doc[0]) for doc in docs)

    got, want = gradients(packed_loss), gradients(separate_losses)
    assert got.keys() == want.keys() and len(got) > 0
    for name in want:
        scale = want[name].abs().max().item() + 1e-6
        assert max_error(got[name], want[name]) / scale < 1e-4, name
