"""Every remapping backend (lse, blockwise, flex, and the naive reference) under every attention implementation
(eager, SDPA, flex_attention), in inference, decoding, training, PoSE and left-padded batches.

The oracle is the independent per-cell forward of tests.test_remapping: r'(i, j) from each method's formula,
every score as (query rotated by r') . (raw key) in float64, one causal softmax; it shares nothing with ctxext's
regions, plans or kernels (only ctxext.patching.reference's float64 attention, held to transformers' own RoPE
attention in tests/test_reference.py). PoSE uses a variant of it below that takes the real (gapped) positions. Kernel-level
gradients are compared with autograd through the "naive" backend (full score matrices, one softmax).
"""

import functools
import types

import pytest
import torch
import torch.nn.attention.flex_attention as torch_flex

import ctxext
from ctxext.errors import CtxextError
from ctxext.methods.remapping import DualChunkParams
from ctxext.patching import remap_kernel
from ctxext.patching.attention import set_attention_tuning
from ctxext.patching.remap_kernel import band_and_far_ranges, pick_backend
from tests.helpers import (
    FAMILIES,
    RELATIVE,
    REMAP_L,
    REMAP_SEQ,
    assert_same_gradients,
    kernel_gradients,
    naive_forward,
    reference_model,
    tiny_model,
)

L = REMAP_L
SEQ = REMAP_SEQ
FAMILY_NAMES = list(FAMILIES)
IMPLEMENTATIONS = ("eager", "sdpa", "flex_attention")
BACKENDS = ("lse", "blockwise", "flex", "naive")

# Small parameters: 56 tokens cross every region boundary of each (dual_chunk: c = 10, so same, previous and
# older chunks all occur; STRING with an attention factor, which the oracle squares into the scores).
METHODS = {
    "rerope": {"window": 7},
    "leaky_rerope": {"window": 7, "k": 3.0},
    "self_extend": {"group_size": 4, "window": 8},
    "dual_chunk": {"chunk_size": 12, "local_window": 2},
    "string": {"shifted_offset": 12, "local_value": 4, "attention_factor": 1.2},
    "gali": {"local_window": 3},  # far keys 1/2 apart from 33 tokens on (L = 32)
}


SHARPEN = 5  # q_proj and k_proj weights times this: peaked attention, so methods move the logits by ~0.1, not ~4e-3


def sharpen(model):
    """Scale every layer's q_proj/k_proj by SHARPEN (in place), so random tiny models attend sharply; the same
    on patched, reference and unpatched models (built from one seed), so they stay comparable."""
    with torch.no_grad():
        for layer in model.model.layers:
            for name in ("q_proj", "k_proj"):
                projection = getattr(layer.self_attn, name)
                projection.weight.mul_(SHARPEN)
                if projection.bias is not None:
                    projection.bias.mul_(SHARPEN)
    return model


def reference(family, method, params, logn):
    """tests.test_remapping's per-cell oracle model, sharpened like the others."""
    return sharpen(reference_model(family, method, params, logn))


def tokens(length=SEQ, seed=3, batch=1):
    return torch.randint(1, 256, (batch, length), generator=torch.Generator().manual_seed(seed))


def patched_model(family, method, params, logn=False, **overrides):
    return sharpen(
        ctxext.patch(tiny_model(family, max_position_embeddings=L, **overrides), method, logn=logn, **params)
    )


@functools.cache
def oracle_logits(family, method, logn, seed=3):
    """The per-cell oracle's logits on `tokens(seed=seed)` with METHODS[method] (shared by tests 1 and 2)."""
    with torch.no_grad():
        return reference(family, method, METHODS[method], logn)(tokens(seed=seed), use_cache=False).logits


@functools.cache
def unpatched_logits(family, seed=3):
    """The plain model, eager: transformers compiles flex_attention, and on an AVX2-only CPU (torch 2.13) the
    compiled CPU kernel returns NaN rows now and then (ctxext's own flex path runs it uncompiled on CPU)."""
    with torch.no_grad():
        model = sharpen(tiny_model(family, max_position_embeddings=L, attn_implementation="eager"))
        return model(tokens(seed=seed)).logits


def max_error(got, want):
    return (got.double() - want.double()).abs().max().item()


def counting(monkeypatch, name):
    """Replace REMAP_BACKENDS[name] by a wrapper that counts its calls (the layers look the backend up per call)."""
    calls = []
    backend = remap_kernel.REMAP_BACKENDS[name]

    def wrapper(*args, **kwargs):
        calls.append(name)
        return backend(*args, **kwargs)

    monkeypatch.setitem(remap_kernel.REMAP_BACKENDS, name, wrapper)
    return calls


# ------------------------------------------------------------------ 1. full forward, every implementation
# The family cycles with (method, log-n), so each oracle serves all three implementations.
FORWARD_RUNS = [
    (FAMILY_NAMES[(2 * n + logn) % 4], method, implementation, logn)
    for n, method in enumerate(METHODS)
    for logn in (False, True)
    for implementation in IMPLEMENTATIONS
]


@pytest.mark.parametrize("family,method,implementation,logn", FORWARD_RUNS)
def test_full_forward_matches_the_oracle_under_every_implementation(family, method, implementation, logn):
    params = METHODS[method]
    inputs = tokens()
    model = patched_model(family, method, params, logn, attn_implementation=implementation)
    assert model.config._attn_implementation == f"ctxext_{implementation}"
    with torch.no_grad():
        got = model(inputs).logits
    expected, plain = oracle_logits(family, method, logn), unpatched_logits(family)
    assert torch.allclose(got, expected, atol=1e-4), max_error(got, expected)
    assert max_error(got, plain) > 1e-4  # the method (or log-n) really acts on this input


# ------------------------------------------------------------------------ 2. every backend, forced
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("method", list(METHODS))
def test_every_backend_matches_the_oracle(monkeypatch, method, backend):
    logn = method in ("self_extend", "string")
    family = FAMILY_NAMES[(2 * list(METHODS).index(method) + logn) % 4]
    model = patched_model(family, method, METHODS[method], logn)
    set_attention_tuning(model, query_block=5, kernel=backend)
    calls = counting(monkeypatch, backend)
    with torch.no_grad():
        got = model(tokens()).logits
    expected = oracle_logits(family, method, logn)
    assert len(calls) == model.config.num_hidden_layers  # the forced backend ran in every layer
    assert torch.allclose(got, expected, atol=1e-4), max_error(got, expected)


# ------------------------------------------------------------------------ 3. cached decode = full forward
# Prompts of 12 tokens; the first region of rerope (16), string (14) and dual_chunk (c = 13) covers the prompt
# and decoding crosses it; leaky_rerope and self_extend are past their windows already in the prompt.
DECODE = {
    "rerope": ({"window": 16}, True),
    "leaky_rerope": ({"window": 5, "k": 4.0}, False),
    "self_extend": ({"group_size": 3, "window": 6}, True),
    "dual_chunk": ({"chunk_size": 16, "local_window": 3}, False),
    "string": ({"shifted_offset": 14, "local_value": 3, "attention_factor": 1.1}, True),
    # R = 14 < L: decoding leaves plain RoPE early (transformers' own flex_attention decodes wrongly from 24 tokens
    # on this CPU, patched or not; ctxext's kernels take over past R)
    "gali": ({"local_window": 2, "position_range": 14}, False),
}
DECODE_RUNS = [
    (FAMILY_NAMES[n % 4], method, implementation)
    for n, (method, implementation) in enumerate((m, i) for m in DECODE for i in IMPLEMENTATIONS)
]


@pytest.mark.parametrize("family,method,implementation", DECODE_RUNS)
def test_cached_decoding_equals_full_forward_and_oracle(family, method, implementation):
    params, logn = DECODE[method]
    model = patched_model(family, method, params, logn, attn_implementation=implementation)
    prompt = tokens(12, seed=5)
    with torch.no_grad():
        generated = model.generate(
            prompt, max_new_tokens=32, do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0
        )
        decoded = torch.stack(generated.logits, dim=1)
        full = model(generated.sequences).logits[:, prompt.shape[1] - 1 : -1]
        expected = reference(family, method, params, logn)(generated.sequences, use_cache=False).logits
    assert decoded.shape[1] == 32
    assert torch.allclose(decoded, full, atol=1e-4), max_error(decoded, full)
    expected = expected[:, prompt.shape[1] - 1 : -1]
    assert torch.allclose(decoded, expected, atol=1e-4), max_error(decoded, expected)


# ------------------------------------------------------------------------ 4. kernel-level gradients
def dual_chunk_layout(q_len, k_len):
    """key_lo/key_hi of Dual Chunk Attention's three regions (chunks of 7), from its own Region rules."""
    regions = DualChunkParams(chunk_size=9, local_window=2).regions()
    positions = torch.arange(k_len - q_len, k_len)
    lo, hi = zip(*(region.key_range(positions) for region in regions))
    return torch.stack(lo), torch.stack(hi)


def rerope_layout(q_len, k_len):
    return band_and_far_ranges(q_len, k_len, window=5)


@pytest.mark.parametrize("backend", ["blockwise", "flex"])
@pytest.mark.parametrize("layout,q_len,k_len", [(dual_chunk_layout, 23, 23), (rerope_layout, 17, 23)])
def test_kernel_gradients_match_autograd_through_naive(monkeypatch, backend, layout, q_len, k_len):
    if backend == "flex":
        # torch's public flex_attention refuses backward on CPU (_validate_device raises "FlexAttention does not
        # support backward on CPU"); its eager math path has one, so the check is lifted for this test only.
        monkeypatch.setattr(torch_flex, "_validate_device", lambda *args, **kwargs: None)
    lo, hi = layout(q_len, k_len)
    assert lo.shape[0] >= 2 and bool(((hi - lo) > 0).sum(1).gt(0).all())  # every region is seen by some query
    got = kernel_gradients(backend, lo, hi, query_block=4, padding=4)
    want = kernel_gradients("naive", lo, hi, query_block=4, padding=4)
    assert_same_gradients(got, want, atol=1e-4)


# ------------------------------------------------------------------------ 5. model-level gradients
GRADIENT_RUNS = [(FAMILY_NAMES[n % 4], method, n % 2 == 1) for n, method in enumerate(METHODS)]


@pytest.mark.parametrize("family,method,logn", GRADIENT_RUNS)
def test_training_gradients_match_the_oracle(monkeypatch, family, method, logn):
    params = METHODS[method]
    inputs = tokens(seed=13)
    model = patched_model(family, method, params, logn).train()
    oracle = reference(family, method, params, logn).train()
    calls = counting(monkeypatch, "blockwise")
    model(inputs, labels=inputs).loss.backward()
    assert len(calls) == model.config.num_hidden_layers  # "auto" took blockwise for CPU training
    oracle(inputs, labels=inputs, use_cache=False).loss.backward()
    for index, (layer, ref_layer) in enumerate(zip(model.model.layers, oracle.model.layers)):
        for name in ("q_proj", "k_proj", "v_proj"):
            got = getattr(layer.self_attn, name).weight.grad
            want = getattr(ref_layer.self_attn, name).weight.grad
            scale = want.abs().max().item()
            assert scale > 0, (index, name)
            assert max_error(got, want) <= 1e-4 * scale, (index, name, max_error(got, want), scale)


def test_auto_backend_choice():
    cpu, cuda, mps = torch.device("cpu"), torch.device("cuda"), torch.device("mps")
    assert pick_backend("auto", cpu, True, SEQ) == "blockwise"
    assert pick_backend("auto", cpu, False, SEQ) == "lse"
    assert pick_backend("auto", cuda, False, 128) == "flex"
    assert pick_backend("auto", cuda, True, 4096) == "flex"
    assert pick_backend("auto", cuda, False, 1) == "blockwise"
    assert pick_backend("auto", mps, False, 4096) == "blockwise"
    assert pick_backend("auto", mps, True, 1) == "blockwise"
    for name in BACKENDS:
        assert pick_backend(name, cuda, True, 1) == name
    with pytest.raises(CtxextError, match="unknown remapping backend"):
        pick_backend("flash", cpu, False, 1)


# ------------------------------------------------------------------------------------------ 6. PoSE
POSE = [
    ("llama", "self_extend", {"group_size": 4, "window": 8}, False),
    ("qwen2", "dual_chunk", {"chunk_size": 24, "local_window": 4}, True),  # chunks of 20: the gap skips one
    ("qwen3", "leaky_rerope", {"window": 7, "k": 3.0}, False),
]
POSE_POSITIONS = torch.cat((torch.arange(0, 20), torch.arange(40, 60)))


@pytest.mark.parametrize("family,method,params,logn", POSE)
def test_pose_gapped_positions_match_the_oracle_at_the_real_positions(family, method, params, logn):
    inputs = tokens(len(POSE_POSITIONS), seed=17)
    position_ids = POSE_POSITIONS[None]
    mask = torch.ones_like(inputs)  # as the training loop does: no mask would read the gap as packed sequences
    model = patched_model(family, method, params, logn)
    oracle = sharpen(tiny_model(family, max_position_embeddings=L))
    forward = naive_forward(
        lambda i, j: RELATIVE[method](i, j, **params),
        oracle.model.rotary_emb.inv_freq,
        1.0,
        L if logn else None,
        positions=POSE_POSITIONS,
    )
    for layer in oracle.model.layers:
        layer.self_attn.forward = types.MethodType(forward, layer.self_attn)
    with torch.no_grad():
        got = model(inputs, position_ids=position_ids, attention_mask=mask, use_cache=False).logits
        expected = oracle(inputs, position_ids=position_ids, attention_mask=mask, use_cache=False).logits
        consecutive = model(inputs, use_cache=False).logits
    assert torch.allclose(got, expected, atol=1e-4), max_error(got, expected)
    assert max_error(got, consecutive) > 1e-4  # the gap really changes the positions used


@pytest.mark.parametrize(
    "positions",
    [
        torch.cat((torch.arange(0, 20), torch.arange(10, 30))),  # goes back
        torch.cat((torch.arange(0, 20), torch.arange(19, 39))),  # repeats one
    ],
)
def test_position_ids_that_do_not_increase_start_a_new_document(positions):
    """One sequence's positions never go back, so there a packed row's next document starts (even under a mask
    of ones): each part equals itself run alone at its own position ids, seeing nothing of the other."""
    model = patched_model("llama", "self_extend", METHODS["self_extend"])
    inputs = tokens(len(positions), seed=19)
    with torch.no_grad():
        got = model(inputs, position_ids=positions[None], attention_mask=torch.ones_like(inputs), use_cache=False)
        parts = [
            model(inputs[:, part], position_ids=positions[None, part], use_cache=False).logits
            for part in (slice(0, 20), slice(20, 40))
        ]
    assert max_error(got.logits, torch.cat(parts, dim=1)) < 1e-5


# ------------------------------------------------------------------ 7. flex_attention, left-padded batch
@pytest.mark.parametrize(
    "family,method,params",
    [
        ("mistral", "self_extend", {"group_size": 2, "window": 4}),  # not shift-invariant: one plan per row
        ("llama", "leaky_rerope", {"window": 5, "k": 3.0}),
    ],
)
def test_flex_attention_left_padded_batch_equals_each_row_alone(family, method, params):
    """Key padding read from flex_attention's BlockMask: each row of a left-padded batch equals the row alone,
    in a full forward and in cached decoding."""
    model = patched_model(family, method, params, attn_implementation="flex_attention")
    long_row, short_row = tokens(20, seed=23), tokens(14, seed=29)
    pad = long_row.shape[1] - short_row.shape[1]
    batch = torch.cat([long_row, torch.cat([torch.zeros(1, pad, dtype=torch.long), short_row], dim=1)])
    mask = (torch.arange(long_row.shape[1])[None] >= torch.tensor([[0], [pad]])).long()
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)  # as generate makes them
    with torch.no_grad():
        together = model(batch, attention_mask=mask, position_ids=position_ids, use_cache=False).logits
        alone = [model(row, use_cache=False).logits[0] for row in (long_row, short_row)]
        expected = reference(family, method, params, False)(short_row, use_cache=False).logits[0]
    assert torch.allclose(alone[1], expected, atol=1e-4), max_error(alone[1], expected)
    assert torch.allclose(together[0], alone[0], atol=1e-4), max_error(together[0], alone[0])
    assert torch.allclose(together[1, pad:], alone[1], atol=1e-4), max_error(together[1, pad:], alone[1])
    # The same batch decoded with a cache: each step's BlockMask (with its offsets) carries row 1's padding.
    settings = dict(max_new_tokens=6, do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    with torch.no_grad():
        together = torch.stack(model.generate(batch, attention_mask=mask, **settings).logits, dim=1)
        alone = [torch.stack(model.generate(row, **settings).logits, dim=1)[0] for row in (long_row, short_row)]
    for row in (0, 1):
        assert torch.allclose(together[row], alone[row], atol=1e-4), (row, max_error(together[row], alone[row]))


# ------------------------------------------------------------------------- one plan per forward, not stale
def test_a_reused_position_ids_tensor_does_not_bring_back_an_earlier_forwards_padding():
    """The plan is shared by the layers of one forward; a later forward with the same position_ids object but
    another mask (here none) must not reuse it."""
    x = tokens(length=12, batch=2)
    position_ids = torch.arange(12).repeat(2, 1)
    padded = torch.ones(2, 12, dtype=torch.long)
    padded[1, :3] = 0
    model = patched_model("llama", "rerope", {"window": 4})
    with torch.no_grad():
        model(x, attention_mask=padded, position_ids=position_ids, use_cache=False)
        got = model(x, position_ids=position_ids, use_cache=False).logits
        want = patched_model("llama", "rerope", {"window": 4})(x, position_ids=position_ids, use_cache=False).logits
    assert torch.equal(got, want)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_position_ids_that_jump_are_packed_documents_without_a_mask_and_a_pose_gap_with_one(implementation):
    """transformers reads position ids that jump, given no attention_mask (and no cache), as packed sequences and
    masks across them; ctxext reads the same documents from its mask: each part equals itself run alone at its
    own position ids. With a mask of ones the gap is a PoSE gap: the first 20 tokens see only themselves, as
    when run alone, and the last 20 see them too."""
    x = tokens(length=40)
    gapped = torch.cat((torch.arange(20), torch.arange(40, 60)))[None]
    model = patched_model("llama", "self_extend", {"group_size": 4, "window": 8}, attn_implementation=implementation)
    with torch.no_grad():
        packed = model(x, position_ids=gapped, use_cache=False).logits
        pose = model(x, position_ids=gapped, attention_mask=torch.ones_like(x), use_cache=False).logits
        alone = model(x[:, :20], use_cache=False).logits
        second = model(x[:, 20:], position_ids=gapped[:, 20:], use_cache=False).logits
    assert max_error(packed, torch.cat((alone, second), dim=1)) < 1e-5
    assert max_error(pose[:, :20], alone) < 1e-5
    assert max_error(pose[:, 20:], second) > 1e-4  # the PoSE row's second part sees the first
