"""ctxext's dual_chunk against the numbers of Dual Chunk Attention's own code (HKUNLP/ChunkLlama
chunkllama_attn_replace.py, the commit in the fixture), run under its transformers 4.37.2 by
benchmarks/chunkllama_reference.py on a tiny random LLaMA: L = 64, chunk_size 48, local window 8 (its default
L // 8), so chunks of c = 40 and 150 tokens in four chunks; 4 greedy tokens after them.

Three runs of the reference are stored. With the merge weights kept in fp32 (the one diagnostic change to its code)
and its mscale at 1, ctxext's logits are the reference's to fp32 rounding. Its code as shipped differs in two
stated ways: `merge_attn_outputs` casts the chunk weights to bfloat16 (about 3e-4 here, from the second chunk on;
the first chunk, which no merge touches, agrees to 1e-6), and its rotary class multiplies cos and sin by
0.05 ln(T / max_position_embeddings) + 1 once T passes the config's length, which ctxext's dual_chunk does not.

The reference's flash-attn calls ran over the stub in benchmarks/chunkllama_reference.py: the stub is held here to
torch's SDPA and to a direct log-sum-exp, so the agreement does not rest on it."""

import importlib
import json
import sys
from pathlib import Path

import pytest
import torch

import ctxext
from benchmarks.chunkllama_reference import write_stub
from tests.helpers import prefill_and_generate, tiny_model

FIXTURE = json.loads((Path(__file__).parent / "fixtures" / "chunkllama_reference.json").read_text())
EXACT = 1e-5  # fp32 logits of two implementations of the same sums (observed 6e-7)
BF16_MERGE = 2e-3  # the reference's bf16 merge weights: relative error 2^-9 per weight (observed 3.5e-4)


@pytest.fixture(scope="module")
def ctxext_run():
    settings = FIXTURE["settings"]
    model = ctxext.patch(
        tiny_model("llama", seed=3),
        "dual_chunk",
        chunk_size=settings["chunk_size"],
        local_window=settings["local_window_size"],
    )
    return prefill_and_generate(model, settings["new_tokens"])


def run(name):
    r = FIXTURE["runs"][name]
    return torch.tensor(r["prefill_logits"]), r["tokens"], torch.tensor(r["logits"])


def test_fp32_merge_without_mscale_is_ctxext_to_fp32_rounding(ctxext_run):
    prefill, tokens, logits = ctxext_run
    want_prefill, want_tokens, want_logits = run("no_mscale_fp32_merge")
    assert tokens == want_tokens
    torch.testing.assert_close(prefill, want_prefill, rtol=0, atol=EXACT)
    torch.testing.assert_close(logits, want_logits, rtol=0, atol=EXACT)


def test_the_unmodified_merge_differs_by_its_bf16_weights_only(ctxext_run):
    prefill, tokens, logits = ctxext_run
    want_prefill, want_tokens, want_logits = run("no_mscale")
    c = FIXTURE["settings"]["chunk_size"] - FIXTURE["settings"]["local_window_size"]
    assert tokens == want_tokens
    torch.testing.assert_close(prefill[:c], want_prefill[:c], rtol=0, atol=EXACT)  # no merge in the first chunk
    torch.testing.assert_close(prefill, want_prefill, rtol=0, atol=BF16_MERGE)
    torch.testing.assert_close(logits, want_logits, rtol=0, atol=BF16_MERGE)
    assert (prefill[c:] - want_prefill[c:]).abs().max() > 10 * EXACT  # the cast is visible


def test_the_shipped_mscale_is_a_stated_difference(ctxext_run):
    prefill, tokens, _ = ctxext_run
    shipped, shipped_tokens, _ = run("as_shipped")
    unscaled, _, _ = run("no_mscale")
    assert tokens == shipped_tokens
    assert (shipped - unscaled).abs().max() > 10 * EXACT


@pytest.fixture(scope="module")
def stub(tmp_path_factory):
    folder = write_stub(tmp_path_factory.mktemp("stub"))
    sys.path.insert(0, str(folder))
    try:
        yield importlib.import_module("flash_attn.flash_attn_interface")
    finally:
        sys.path.remove(str(folder))
        for name in [n for n in sys.modules if n == "flash_attn" or n.startswith("flash_attn.")]:
            del sys.modules[name]


def sdpa(q, k, v, mask):
    """The (b, s, h, d) layout of flash-attn through torch's SDPA with an explicit boolean mask."""
    q, k, v = (x.transpose(1, 2) for x in (q, k, v))
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2)


@pytest.mark.parametrize(
    "sq,sk,causal,window",
    [(600, 600, True, (-1, -1)), (300, 300, False, (-1, -1)), (5, 700, True, (-1, -1)), (520, 520, True, (100, 0))],
)
def test_the_flash_attn_stub_is_sdpa_with_flash_attns_masks(stub, sq, sk, causal, window):
    g = torch.Generator().manual_seed(sq + sk)
    q = torch.randn(1, sq, 4, 16, generator=g)
    k, v = torch.randn(1, sk, 2, 16, generator=g), torch.randn(1, sk, 2, 16, generator=g)
    out, lse, _ = stub.flash_attn_func(q, k, v, causal=causal, window_size=window, return_attn_probs=True)
    i = torch.arange(sq)[:, None] + sk - sq  # flash-attn 2 aligns the causal mask bottom-right
    j = torch.arange(sk)[None, :]
    mask = torch.ones(sq, sk, dtype=torch.bool)
    if causal:
        mask &= j <= i
    if window[0] >= 0:
        mask &= j >= i - window[0]
    torch.testing.assert_close(out, sdpa(q, k, v, mask), rtol=0, atol=1e-5)
    scores = (q.transpose(1, 2) @ k.repeat_interleave(2, dim=2).transpose(1, 2).transpose(-1, -2)) / 4.0
    want_lse = torch.logsumexp(scores.masked_fill(~mask, float("-inf")), dim=-1)
    torch.testing.assert_close(lse, want_lse, rtol=0, atol=1e-5)


def test_the_kv_cache_stub_attends_the_cache_prefix(stub):
    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, 1, 4, 16, generator=g)
    k_cache, v_cache = torch.randn(1, 50, 2, 16, generator=g), torch.randn(1, 50, 2, 16, generator=g)
    out, lse = stub.fwd_kvcache(q, k_cache, v_cache, None, None, torch.tensor([30]), None, None, None, None, None,
                                None, None, False, -1, -1, True, 0)  # fmt: skip
    torch.testing.assert_close(out, sdpa(q, k_cache[:, :30], v_cache[:, :30], None), rtol=0, atol=1e-5)
    assert lse.shape == (1, 4, 1)
