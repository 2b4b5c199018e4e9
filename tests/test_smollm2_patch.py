"""Real weights: SmolLM2-135M (offline checkpoint) patched with yarn x2 equals transformers' native yarn,
with its weights loaded as Llama, as Mistral and as Qwen2."""

import pytest
import torch
from safetensors.torch import load_file
from transformers import (
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

import ctxext
from ctxext import assets

CLASSES = {
    "llama": (LlamaConfig, LlamaForCausalLM),
    "mistral": (MistralConfig, MistralForCausalLM),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
}


@pytest.fixture(scope="module")
def weights_and_tokens(smollm2_path):
    tokenizer = AutoTokenizer.from_pretrained(smollm2_path)
    text = assets.shakespeare_text(assets.HAMLET_RICHARD3)[:4000]
    tokens = tokenizer(text, return_tensors="pt").input_ids[:, :160]
    state = load_file(smollm2_path / "model.safetensors")
    config = LlamaConfig.from_pretrained(smollm2_path).to_dict()
    return config, state, tokens


def build(family, config_dict, state, rope_parameters=None, max_position_embeddings=None):
    config_cls, model_cls = CLASSES[family]
    values = {k: v for k, v in config_dict.items() if k not in ("architectures", "model_type")}
    if family == "mistral":
        values["sliding_window"] = None
    if rope_parameters is not None:
        values["rope_parameters"] = rope_parameters
        values["max_position_embeddings"] = max_position_embeddings
    with torch.device("meta"):
        model = model_cls(config_cls(**values))
    state = dict(state)
    if family == "qwen2":  # Qwen2 has q/k/v biases; the LLaMA weights have none, i.e. zero biases
        for name, module in model.named_modules():
            if name.endswith(("q_proj", "k_proj", "v_proj")):
                state[f"{name}.bias"] = torch.zeros(module.out_features)
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    model.tie_weights()
    # Buffers made on the meta device (rotary inv_freq) must be recomputed on the CPU.
    model.model.rotary_emb = type(model.model.rotary_emb)(model.config)
    return model.eval()


@pytest.mark.parametrize("family", list(CLASSES))
def test_smollm2_yarn_x2_equals_native_yarn(weights_and_tokens, family):
    config, state, tokens = weights_and_tokens
    native = build(
        family,
        config,
        state,
        {"rope_type": "yarn", "factor": 2.0, "rope_theta": 100000.0, "original_max_position_embeddings": 8192},
        16384,
    )
    with torch.no_grad():
        expected = native(tokens).logits
    del native
    model = build(family, config, state)
    with torch.no_grad():
        unpatched = model(tokens).logits
    ctxext.patch(model, "yarn", factor=2.0)
    with torch.no_grad():
        patched = model(tokens).logits
    torch.testing.assert_close(patched, expected, rtol=1e-5, atol=1e-5)
    assert (patched - unpatched).abs().max() > 1e-2  # yarn really changed something (a = 1.069)
    assert model.config.max_position_embeddings == 16384
