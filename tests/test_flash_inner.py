"""Attention-level methods on a model loaded with FlashAttention, simulated on the CPU.

flash-attn cannot be installed here (it needs CUDA), so a stand-in takes the place of the `flash_attn` package
and of transformers' device checks only: `flash_attn_func` is SDPA with FlashAttention's (batch, seq, heads, d)
layout and bottom-right causal mask. Everything else is transformers' own FlashAttention path: its mask function,
`flash_attention_forward`, `lazy_import_flash_attention`. The oracle is the same method on an SDPA model.
"""

import sys
import types

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

import ctxext
from ctxext.patching import remap_kernel
from ctxext.patching.attention import wrapper_name
from tests.helpers import save_tiny_checkpoint, tiny_model

L = 32
TOKENS = torch.randint(0, 256, (1, 56), generator=torch.Generator().manual_seed(0))


@pytest.fixture
def fake_flash_attention(monkeypatch):
    """Install the stand-in; returns the list of query shapes flash_attn_func was called with."""
    import transformers.modeling_flash_attention_utils as flash_utils
    from transformers import PreTrainedModel

    calls = []

    def flash_attn_func(
        q,
        k,
        v,
        dropout_p=0.0,
        softmax_scale=None,
        causal=False,
        window_size=(-1, -1),
        softcap=0.0,
        alibi_slopes=None,
        deterministic=False,
        return_attn_probs=False,
    ):
        calls.append(tuple(q.shape))
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        q_len, k_len = q.shape[2], k.shape[2]
        mask = torch.ones(q_len, k_len, dtype=torch.bool).tril(k_len - q_len) if causal else None
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=softmax_scale, enable_gqa=True)
        return out.transpose(1, 2)

    def flash_attn_varlen_func(*args, **kwargs):
        raise AssertionError("these unpadded inputs should not take the varlen path")

    package = types.ModuleType("flash_attn")
    package.flash_attn_func, package.flash_attn_varlen_func = flash_attn_func, flash_attn_varlen_func
    package.flash_attn_with_kvcache = None
    padding = types.ModuleType("flash_attn.bert_padding")
    padding.pad_input, padding.unpad_input = flash_utils._pad_input, flash_utils._unpad_input
    monkeypatch.setitem(sys.modules, "flash_attn", package)
    monkeypatch.setitem(sys.modules, "flash_attn.bert_padding", padding)
    monkeypatch.setattr(flash_utils, "is_flash_attn_2_available", lambda *a, **k: True)
    monkeypatch.setattr(flash_utils, "_loaded_implementation", None)
    monkeypatch.setattr(PreTrainedModel, "_flash_attn_can_dispatch", lambda self, *a, **k: True)  # the GPU check
    return calls


def flash_model(**overrides):
    model = tiny_model("llama", max_position_embeddings=L, **overrides)
    model.set_attn_implementation("flash_attention_2")
    return model


def test_the_wrapper_name_is_not_taken_for_a_flash_kernel():
    from transformers.utils.generic import is_flash_attention_requested

    for inner in ("flash_attention_2", "flash_attention_3", "kernels-community/flash-attn2", "sdpa"):
        name = wrapper_name(inner)
        assert name.startswith("ctxext_") and "/" not in name
        assert not is_flash_attention_requested(requested_attention_implementation=name)
    assert wrapper_name("sdpa") == "ctxext_sdpa"


@pytest.mark.parametrize(
    "method,params", [("dual_chunk", {"chunk_size": 24, "local_window": 4}), ("leaky_rerope", {"window": 7, "k": 3.0})]
)
def test_patching_a_flash_model_runs_and_matches_sdpa(fake_flash_attention, method, params):
    model = flash_model()
    assert model.config._attn_implementation == "flash_attention_2"
    ctxext.patch(model, method, logn=True, **params)
    assert model.config._attn_implementation == "ctxext_fa2"
    expected = ctxext.patch(tiny_model("llama", max_position_embeddings=L), method, logn=True, **params)
    with torch.no_grad():
        short = model(TOKENS[:, :6]).logits  # inside the first region: FlashAttention itself runs
        assert len(fake_flash_attention) == 2  # once per layer, through transformers' flash path
        assert torch.allclose(short, expected(TOKENS[:, :6]).logits, atol=1e-5)
        long = model(TOKENS).logits  # past it: ctxext's backend, which the wrapper picks by device
        assert len(fake_flash_attention) == 2
        assert torch.allclose(long, expected(TOKENS).logits, atol=1e-5)
    assert remap_kernel.pick_backend("auto", torch.device("cpu"), False, 56) == "lse"
    ctxext.unpatch(model)  # back to transformers' own FlashAttention
    assert model.config._attn_implementation == "flash_attention_2"
    with torch.no_grad():
        model(TOKENS[:, :6])
    assert len(fake_flash_attention) == 4


def test_logn_alone_hands_every_forward_to_flash_attention(fake_flash_attention):
    model = ctxext.patch(flash_model(), "ntk", factor=2, logn=True)
    expected = ctxext.patch(tiny_model("llama", max_position_embeddings=L), "ntk", factor=2, logn=True)
    with torch.no_grad():
        assert torch.allclose(model(TOKENS).logits, expected(TOKENS).logits, atol=1e-5)
    assert len(fake_flash_attention) == 2


def test_a_saved_checkpoint_loads_under_flash_attention(fake_flash_attention, tmp_path):
    patched = ctxext.patch(
        tiny_model("qwen2", max_position_embeddings=L), "self_extend", factor=2, group_size=3, window=8
    )
    save_tiny_checkpoint(tmp_path / "ckpt", patched)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt", attn_implementation="flash_attention_2").eval()
    assert loaded.config._attn_implementation == "ctxext_fa2"
    with torch.no_grad():
        got = loaded(TOKENS).logits
        cached = loaded.generate(TOKENS[:, :20], max_new_tokens=4, do_sample=False, pad_token_id=0)
        want = patched(TOKENS).logits
        assert not fake_flash_attention  # every forward so far reached past the window: ctxext's backend
        short = loaded(TOKENS[:, :6]).logits
        assert len(fake_flash_attention) == 2  # inside the window: FlashAttention
        assert torch.allclose(short, patched(TOKENS[:, :6]).logits, atol=1e-5)
    assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()
    assert torch.equal(cached, patched.generate(TOKENS[:, :20], max_new_tokens=4, do_sample=False, pad_token_id=0))


def test_an_implementation_that_cannot_remap_is_refused_at_patch_time():
    from transformers import AttentionInterface

    AttentionInterface.register("my_custom_attention", lambda module, q, k, v, mask, **kw: (q.transpose(1, 2), None))
    model = tiny_model("llama", max_position_embeddings=L)
    model.set_attn_implementation("my_custom_attention")
    with pytest.raises(ctxext.CtxextError, match="cannot run under attn_implementation='my_custom_attention'"):
        ctxext.patch(model, "dual_chunk", chunk_size=24, local_window=4)
    assert ctxext.applied_method(model) is None
    ctxext.patch(model, "ntk", factor=2, logn=True)  # log-n alone runs under any implementation
    assert model.config._attn_implementation == "ctxext_my_custom_attention"
