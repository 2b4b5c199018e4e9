"""A patch that would not take effect is refused (issue 64 item 5).

ctxext's attention-level methods run as a function registered with transformers' attention interface, and its
frequency methods as the base model's `rotary_emb`; a model whose attention forward never consults the
interface (Unsloth replaces the attention classes' forward with its fast attention) or whose forward computes its
angles elsewhere would train or generate unpatched. The oracle that a forward bypasses the interface is
transformers itself: the model's attention implementation is switched to a function that raises, and the model
still runs. The bypassing forwards here compute what the family's own does (equal logits), so only the
interface is missing."""

import copy
import types

import pytest
import torch
import torch.nn.functional as F
from accelerate.hooks import ModelHook, add_hook_to_module
from transformers import AttentionInterface, LlamaForCausalLM
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
from transformers.modeling_outputs import BaseModelOutputWithPast
from transformers.models.llama.modeling_llama import LlamaAttention, apply_rotary_pos_emb, repeat_kv

import ctxext
from ctxext.errors import CtxextError
from ctxext.patching.takes_effect import interface_bypass
from tests.family_models import build
from tests.helpers import save_tiny_checkpoint, tiny_model

TOKENS = torch.randint(3, 128, (1, 24), generator=torch.Generator().manual_seed(0))  # within every tiny vocabulary

# Every attention-level patch: (method, factor, params, extra patch arguments).
ATTENTION_LEVEL = {
    "self_extend": ("self_extend", 2, {}, {}),
    "rerope": ("rerope", 2, {}, {}),
    "leaky_rerope": ("leaky_rerope", 2, {}, {}),
    "dual_chunk": ("dual_chunk", 2, {}, {}),
    "gali": ("gali", 2, {}, {}),
    "dpe": ("dpe", 2, {}, {}),
    "string": ("string", 2, {"local_value": 8}, {}),
    "logn": ("yarn", 2, {}, {"logn": True}),
    "query_temperature": ("yarn", 2, {}, {"query_temperature": 0.1}),
}


def fast_attention(self, hidden_states, position_embeddings=None, attention_mask=None, **kwargs):
    """LLaMA attention as plain causal SDPA with the layer's own projections and rotation, never asking
    transformers' attention interface (what Unsloth's fast attention does)."""
    batch, length, _ = hidden_states.shape
    shape = (batch, length, -1, self.head_dim)
    query = self.q_proj(hidden_states).view(shape).transpose(1, 2)
    key = self.k_proj(hidden_states).view(shape).transpose(1, 2)
    value = self.v_proj(hidden_states).view(shape).transpose(1, 2)
    query, key = apply_rotary_pos_emb(query, key, *position_embeddings)
    key, value = repeat_kv(key, self.num_key_value_groups), repeat_kv(value, self.num_key_value_groups)
    output = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=self.scaling)
    return self.o_proj(output.transpose(1, 2).reshape(batch, length, -1)), None


def logits(model):
    with torch.no_grad():
        return model(TOKENS, use_cache=False).logits


class InterfaceCalled(Exception):
    pass


def consults_the_interface(model) -> bool:
    """Whether `model`'s forward calls transformers' attention interface: switched to a function that raises."""
    name = "ctxext_test_raises"

    def raises(*args, **kwargs):
        raise InterfaceCalled

    AttentionInterface.register(name, raises)
    ALL_MASK_ATTENTION_FUNCTIONS.register(name, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    inner = model.config._attn_implementation
    model.set_attn_implementation(name)
    try:
        logits(model)
    except InterfaceCalled:
        return True
    finally:
        model.set_attn_implementation(inner)
    return False


def with_fast_attention_on_each_module(model):
    for layer in model.model.layers:
        layer.self_attn.forward = types.MethodType(fast_attention, layer.self_attn)
    return model


def test_the_fast_attention_computes_the_familys_attention_without_the_interface():
    model = tiny_model("llama")
    want = logits(model)
    assert consults_the_interface(model)
    with_fast_attention_on_each_module(model)
    torch.testing.assert_close(logits(model), want, atol=1e-5, rtol=1e-5)
    assert not consults_the_interface(model)  # ctxext's attention function, registered there, would never run


def assert_refused_unchanged(model, case: str, *names: str):
    method, factor, params, extra = ATTENTION_LEVEL[case]
    before = copy.deepcopy(model.config.to_dict())
    rotary = model.model.rotary_emb
    with pytest.raises(CtxextError) as raised:
        ctxext.patch(model, method, factor=factor, **params, **extra)
    text = str(raised.value)
    assert "\n" not in text and "would not take effect" in text and "ALL_ATTENTION_FUNCTIONS" in text, text
    assert all(name in text for name in names), text
    assert model.model.rotary_emb is rotary and model.config.to_dict() == before  # nothing changed
    return text


@pytest.mark.parametrize("case", list(ATTENTION_LEVEL))
def test_an_attention_method_on_a_replaced_attention_forward_is_refused_in_one_line(case):
    model = with_fast_attention_on_each_module(tiny_model("llama"))
    text = assert_refused_unchanged(model, case, "LlamaAttention (layer 0)", "fast_attention", "Unsloth")
    assert "use a frequency method" in text


def test_a_replaced_attention_class_forward_is_refused_too(monkeypatch):
    model = tiny_model("llama")
    monkeypatch.setattr(LlamaAttention, "forward", fast_attention)  # Unsloth patches the class
    assert not consults_the_interface(model)
    assert_refused_unchanged(model, "self_extend", "LlamaAttention (layer 0)", f"module '{__name__}'")


@pytest.mark.parametrize("case", list(ATTENTION_LEVEL))
def test_a_model_that_calls_the_interface_is_patched(case):
    method, factor, params, extra = ATTENTION_LEVEL[case]
    model = tiny_model("llama")
    ctxext.patch(model, method, factor=factor, **params, **extra)
    assert model.config._attn_implementation == "ctxext_sdpa"


def test_accelerate_hooks_on_the_attention_modules_are_looked_through():
    model = tiny_model("llama")
    for layer in model.model.layers:
        add_hook_to_module(layer.self_attn, ModelHook())  # what dispatching over devices puts there
        assert "forward" in layer.self_attn.__dict__
    want = logits(tiny_model("llama"))
    ctxext.patch(model, "self_extend", factor=2)
    assert model.config._attn_implementation == "ctxext_sdpa"
    ctxext.unpatch(model)
    torch.testing.assert_close(logits(model), want)


def test_a_checkpoint_with_an_attention_method_refuses_to_load_under_a_replaced_forward(tmp_path, monkeypatch):
    model = tiny_model("llama")
    ctxext.patch(model, "self_extend", factor=2)
    save_tiny_checkpoint(tmp_path / "patched", model)
    monkeypatch.setattr(LlamaAttention, "forward", fast_attention)
    with pytest.raises(CtxextError, match="would not take effect"):  # never loads and trains unpatched
        LlamaForCausalLM.from_pretrained(tmp_path / "patched")


def test_a_family_that_attends_in_its_own_code_refuses_attention_methods():
    """gpt_neox_japanese's attention computes softmax(q.k) v in its own `_attn`: the interface is never asked."""
    model = build("gpt_neox_japanese")[0]
    assert not consults_the_interface(model)
    with pytest.raises(CtxextError, match="this family attends in its own code; use a frequency method"):
        ctxext.patch(model, "self_extend", factor=2)
    ctxext.patch(model, "yarn", factor=2)  # its rotary is the base model's: frequency methods take effect
    ctxext.unpatch(model)


def forward_with_its_own_rotary(model):
    """A base model forward that computes the angles from a rotary module of its own, never `self.rotary_emb`."""
    own_rotary = copy.deepcopy(model.model.rotary_emb)

    def forward(self, input_ids=None, **kwargs):
        hidden = self.embed_tokens(input_ids)
        positions = torch.arange(hidden.shape[1])[None]
        angles = own_rotary(hidden, positions)
        for layer in self.layers:
            hidden = layer(hidden, position_embeddings=angles, position_ids=positions, attention_mask=None)
        return BaseModelOutputWithPast(last_hidden_state=self.norm(hidden))

    model.model.forward = types.MethodType(forward, model.model)
    return model


@pytest.mark.parametrize("method", ["yarn", "self_extend"])
def test_a_model_forward_that_bypasses_the_rotary_module_is_refused(method):
    model = tiny_model("llama")
    want = logits(model)
    forward_with_its_own_rotary(model)
    torch.testing.assert_close(logits(model), want, atol=1e-5, rtol=1e-5)  # the same model, its own angles
    rotary, before = model.model.rotary_emb, copy.deepcopy(model.config.to_dict())
    with pytest.raises(CtxextError) as raised:
        ctxext.patch(model, method, factor=2)
    text = str(raised.value)
    assert "\n" not in text and "LlamaModel's forward" in text and "never calls its rotary module" in text, text
    assert model.model.rotary_emb is rotary and model.config.to_dict() == before


def test_interface_bypass_names_only_the_replaced_modules():
    model = tiny_model("llama")
    first, second = (layer.self_attn for layer in model.model.layers)
    first.forward = types.MethodType(fast_attention, first)
    assert interface_bypass(first) == f"fast_attention from module '{__name__}'"
    assert interface_bypass(second) is None and interface_bypass(None) is None
    assert ctxext.patching.rope_layout(model).interface_bypasses == (interface_bypass(first), None)
