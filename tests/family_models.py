"""Tiny random models of every RoPE causal-LM family in the installed transformers, for the family matrix.

Each family is built from its own config class with small sizes (2 layers, hidden 64, 4/2 heads, head_dim 16);
a family whose layers can be of several types gets a real mix (a sliding layer, then a full one). What cannot be
built this way is kept with the reason, so that the tests list it instead of skipping it silently. The same tiny
models rebuilt with the static scaling real checkpoints of a family ship (SHIPPED, shipped_model) are here too.
"""

from __future__ import annotations

import functools
import warnings

import torch
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.models.auto.configuration_auto import CONFIG_MAPPING
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from tests.helpers import TINY_SHAPE

L = 32  # every tiny model's original length
SLIDING = 8  # a sliding layer's window: within L, so it never sees past it
MAX_PARAMETERS = 3_000_000

SMALL = dict(
    vocab_size=128,
    **TINY_SHAPE,
    max_position_embeddings=L,
    tie_word_embeddings=False,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    attention_dropout=0.0,
    # MoE families: a few small experts
    num_local_experts=4,
    num_experts=4,
    n_routed_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    first_k_dense_replace=0,
)

# Multimodal RoPE: the rope keys these families' checkpoints ship (Qwen3.5: mrope_section [11, 11, 10] over the 32
# rotary pairs of head_dim 256 x 0.25), here over 6 pairs (head_dim 48 x 0.25), so that every section has pairs.
MROPE_SMALL = {
    family: (48, {"mrope_section": [2, 2, 2], "mrope_interleaved": True})
    for family in ("qwen3_5_text", "qwen3_5_moe_text")
}

MLA_SMALL = dict(kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16)
MLA_MOE_SMALL = dict(n_shared_experts=1, n_group=1, topk_group=1)


DROP = object()  # a generic small value a family must not be given (RECIPES)
MOE_SHARED = dict(shared_expert_intermediate_size=32)
LINEAR_ATTENTION = dict(
    linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4
)
DSA_INDEXER = dict(index_topk=8, index_head_dim=16, index_n_heads=2)  # DeepSeek Sparse Attention's indexer
# What a family needs beyond the generic small values, each found by building it (docs: the families-2026 notes):
# keys a family's config requires, sizes its validators tie together, and generic values it must not get.
RECIPES = {
    # Gemma 4: the full layers' head size (popped into per_layer_config) and a small per-layer-input table
    "gemma4_text": dict(global_head_dim=32, vocab_size_per_layer_input=128, hidden_size_per_layer_input=16),
    "gemma4_unified_text": dict(global_head_dim=32),
    # MLA with a DSA indexer: as many key/value heads as heads (else sdpa's shapes disagree: 4 vs 8)
    "deepseek_v32": dict(**DSA_INDEXER, num_key_value_heads=4),
    "glm_moe_dsa": dict(**DSA_INDEXER, num_key_value_heads=4),
    "axk2": dict(**DSA_INDEXER, num_key_value_heads=4, mlp_layer_types=["dense", "sparse"]),
    "dots3_note_text": dict(
        **DSA_INDEXER,
        mlp_layer_types=["dense", "sparse"],
        shared_experts_intermediate_size=32,
        layer_types=["sliding_attention", "indexed_attention"],
        sliding_window=8,
        per_layer_config={},  # else its 46-layer per-layer defaults apply
        num_key_value_heads=4,
        head_dim=16,  # qk_nope + qk_rope (its validator)
    ),
    # its indexer's sizes: without them token_budget // compress_ratio is None // None
    "qwen4_exp_text": dict(
        **MOE_SHARED,
        **LINEAR_ATTENTION,
        layer_types=["linear_attention", "indexed_attention"],
        hc_count=2,
        hc_lowrank=8,
        indexer_n_heads=2,
        indexer_kv_heads=1,
        indexer_head_dim=16,
        indexer_budget=8,
        indexer_compress_ratio=4,
    ),
    "laguna": dict(
        **MOE_SHARED,
        sliding_window=8,
        layer_types=["sliding_attention", "full_attention"],
        mlp_layer_types=["dense", "sparse"],
        num_attention_heads_per_layer=[4, 4],
    ),
    "olmo_hybrid": dict(  # at least one layer of each kind (validate_architecture)
        head_dim=DROP,
        layer_types=["linear_attention", "full_attention"],
        **{**LINEAR_ATTENTION, "linear_num_value_heads": 2},
    ),
    "dory": dict(
        sliding_window=8,
        layer_types=["sliding_attention", "full_attention"],
        n_input_layers=1,
        n_recurrent_layers=0,
        n_output_layers=1,
    ),
    # no layer_types (its layers_block_type is a read-only property)
    "falcon_h1": dict(
        layer_types=DROP, mamba_d_ssm=32, mamba_n_heads=4, mamba_d_head=8, mamba_d_state=8, mamba_chunk_size=16
    ),
    # n_heads x d_head == mamba_expand (2) x hidden
    "bamba": dict(
        layer_types=DROP,
        head_dim=DROP,
        attn_layer_indices=[1],
        mamba_n_heads=8,
        mamba_d_head=16,
        mamba_d_state=8,
        mamba_chunk_size=16,
    ),
    "lfm2_moe": dict(head_dim=DROP, num_dense_layers=1, layer_types=["conv", "full_attention"]),
    "falcon": dict(
        head_dim=DROP, num_kv_heads=2, new_decoder_architecture=True, alibi=False, layer_types=DROP, sliding_window=DROP
    ),
    # a sliding and a full hybrid (CCA) layer; its QK norm's learned key scale is set after building (KEY_SCALES)
    "zaya": dict(
        num_experts_per_tok=1,
        router_hidden_size=16,
        layer_types=["hybrid_sliding", "hybrid"],
        sliding_window=SLIDING,
    ),
    # RoPE is an option of its config, off by default (then no module computes it)
    "granitemoehybrid": dict(position_embedding_type="rope", layer_types=["linear_attention", "full_attention"]),
    "recurrent_gemma": dict(layer_types=DROP, block_types=["recurrent", "attention"]),
    "gemma3n_text": dict(  # no layer reuses another's cache; a small per-layer-input table, no activation sparsity
        num_kv_shared_layers=0,
        vocab_size_per_layer_input=128,
        hidden_size_per_layer_input=16,
        laurel_rank=8,
        activation_sparsity_pattern=[0.0, 0.0],
    ),
    # sliding_window an int (its strict validation), past L so the methods have work; a small depth decoder
    "moshi": dict(sliding_window=4 * L, audio_vocab_size=128, num_codebooks=2, ffn_dim=128),
    "dots1": dict(n_shared_experts=1),
    # sub-configs of their own: small vision and audio towers, and BLT's patcher, local encoder/decoder and global
    "phi4_multimodal": dict(
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2),
        audio_config=dict(
            hidden_size=32,
            intermediate_size=64,
            num_blocks=1,
            num_attention_heads=2,
            ext_pw_out_channel=32,
            depthwise_separable_out_channel=32,
            nemo_conv_channels=32,
        ),
    ),
    "blt": dict(
        patcher_config=dict(**TINY_SHAPE, vocab_size=260),
        encoder_config=dict(**TINY_SHAPE, hidden_size_global=64, vocab_size=260),
        decoder_config=dict(**TINY_SHAPE, hidden_size_global=64, vocab_size=260),
        global_config=dict(**TINY_SHAPE),
        encoder_hash_byte_group_vocab=128,
        vocab_size=260,
    ),
    # DeepSeek V4's tiny config, defined below with its own tests (a sliding, then a compressed layer)
    "deepseek_v4": lambda: dict(**DEEPSEEK_V4_TINY, layer_types=["sliding_attention", DEEPSEEK_V4_COMPRESSED[0]]),
    "dbrx": dict(
        d_model=64,
        n_heads=4,
        n_layers=2,
        max_seq_len=L,
        attn_config=dict(kv_n_heads=2, rope_theta=1e4, clip_qkv=8.0),  # clip_qkv None: torch.clamp fails
        ffn_config=dict(ffn_hidden_size=128, moe_num_experts=4, moe_top_k=2),
    ),
}


def _zaya_key_scale(model) -> None:
    """Zaya's QK norm multiplies every key by a learned per-head scale that transformers initialises to 0 (every
    key 0: uniform attention, which no RoPE changes, so any patch would look exact); 1, as after training."""
    for layer in model.model.layers:
        torch.nn.init.ones_(layer.self_attn.qk_norm.temp)


AFTER_BUILD = {"zaya": _zaya_key_scale}  # what a family's random initialisation leaves that a checkpoint never has


def rope_families() -> list[str]:
    """Every causal-LM model type whose default config has rope parameters, in the installed transformers."""
    found = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for model_type in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
            try:
                config = CONFIG_MAPPING[model_type]()
            except Exception:  # noqa: BLE001 - a config that cannot be built with defaults is not a candidate
                continue
            if getattr(config, "rope_parameters", None):
                found.append(model_type)
    return found


def _partial_rotary_factor(default) -> float:
    """The share of each head a default config rotates (top-level, or in its first rope parameters)."""
    parameters = getattr(default, "rope_parameters", None) or {}
    if parameters and all(isinstance(v, dict) for v in parameters.values()):
        parameters = next(iter(parameters.values()))
    return float(parameters.get("partial_rotary_factor") or getattr(default, "partial_rotary_factor", None) or 1.0)


def _has(config, name: str) -> bool:
    """hasattr that counts an attribute set per layer (Gemma 4's head_dim raises when read off the whole config)."""
    try:
        getattr(config, name)
    except AttributeError:
        return False
    except RuntimeError:  # transformers' AmbiguousGlobalPerLayerAttributeError: it is there, per layer
        return True
    return True


def _values(model_type: str, default) -> dict:
    values = _generic_values(model_type, default)
    recipe = RECIPES.get(model_type, {})
    for key, value in (recipe() if callable(recipe) else recipe).items():
        if value is DROP:
            values.pop(key, None)
        else:
            values[key] = value
    return values


def _generic_values(model_type: str, default) -> dict:
    values = {k: v for k, v in SMALL.items() if _has(default, k) or k in ("pad_token_id", "bos_token_id")}
    types = set(getattr(default, "layer_types", None) or [])
    if "sliding_attention" in types and "full_attention" in types:
        values["layer_types"] = ["sliding_attention", "full_attention"]
        values["sliding_window"] = SLIDING
    elif types:
        values["layer_types"] = [sorted(types)[0]] * 2
        if "sliding_attention" in types:  # every layer sliding: a window past L, so the methods have work
            values["sliding_window"] = 4 * L
    if _has(default, "sliding_window") and "sliding_window" not in values:
        values["sliding_window"] = None  # one window for every layer (Mistral): off, so the layers see everything
    if getattr(default, "qk_rope_head_dim", None):  # MLA (DeepSeek): small latent ranks, RoPE on 8 channels a head
        values.update(MLA_SMALL, head_dim=MLA_SMALL["qk_rope_head_dim"])
        values.update({k: v for k, v in MLA_MOE_SMALL.items() if _has(default, k)})
    if int(values.get("head_dim", 0) * _partial_rotary_factor(default)) % 2:  # real configs rotate whole pairs
        values["head_dim"] = 24  # MiMo V2 Flash's 0.334: 8 rotated channels (16 would rotate 5)
    if model_type in MROPE_SMALL:
        head_dim, keys = MROPE_SMALL[model_type]
        values.update(head_dim=head_dim, rope_parameters={**default.rope_parameters, **keys})
    if _has(default, "no_rope_layers"):
        values["no_rope_layers"] = [1, 0]  # SmolLM3: layer 1 is NoPE
    return values


@functools.cache
def build(model_type: str):
    """(model, None) for a family that builds, else (None, reason). fp32, eval mode, seed 0."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            default = CONFIG_MAPPING[model_type]()
            config = CONFIG_MAPPING[model_type](**_values(model_type, default))
            with torch.device("meta"):  # count first: a family whose sub-configs ignore the small sizes is listed
                size = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
            if size > MAX_PARAMETERS:
                return None, f"not tiny with these sizes ({size / 1e6:.0f}M parameters): its sub-configs need their own"
            torch.manual_seed(0)
            try:
                model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
            except ValueError:  # a family without SDPA
                model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
            AFTER_BUILD.get(model_type, lambda _: None)(model)
        except Exception as error:  # noqa: BLE001 - the reason is the finding
            return None, f"{type(error).__name__}: {str(error).splitlines()[0][:120]}"
    return model.float().eval(), None


# The static scalings real checkpoints of these families ship, on the tiny models (shipped_model builds them).
SHIPPED = {
    # family: (shipped rope_parameters, original L recorded, base)
    "qwen3": ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": L}, L),
    "llama": (
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": L,
        },
        L,
    ),
    # DeepSeek's yarn with mscale = mscale_all_dim: its MLA attention computes a softmax scale from them
    "deepseek_v3": (
        {
            "rope_type": "yarn",
            "factor": 40.0,
            "original_max_position_embeddings": L,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
        L,
    ),
    # DeepSeek V2's published yarn x40 (mscale = mscale_all_dim = 0.707), its rotary returning complex freqs_cis
    "deepseek_v2": (
        {
            "rope_type": "yarn",
            "factor": 40.0,
            "original_max_position_embeddings": L,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "mscale": 0.707,
            "mscale_all_dim": 0.707,
        },
        L,
    ),
    "gpt_oss": (
        {
            "rope_type": "yarn",
            "factor": 32.0,
            "original_max_position_embeddings": L,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
        },
        L,
    ),
    "phi3": (
        {
            "rope_type": "longrope",
            "short_factor": [1.0 + 0.1 * i for i in range(8)],
            "long_factor": [2.0 + 0.5 * i for i in range(8)],
            "original_max_position_embeddings": L,
            "factor": 4.0,
        },
        L,
    ),
}


def rebuilt_with(family: str, change, **from_config):
    """The tiny model of `family` rebuilt from its config values after `change(values)` edits them in place, its
    weights kept."""
    model, _ = build(family)
    values = model.config.to_dict()
    change(values)
    config = AutoConfig.for_model(values.pop("model_type"), **values)
    rebuilt = AutoModelForCausalLM.from_config(config, **from_config).eval()
    rebuilt.load_state_dict(model.state_dict())
    return rebuilt


def shipped_model(family):
    """The tiny model of `family` with SHIPPED's rope parameters and the tiny model's weights."""
    shipped, _ = SHIPPED[family]

    def change(values):
        values["rope_parameters"] = {**shipped, "rope_theta": float(values["rope_parameters"]["rope_theta"])}
        values["max_position_embeddings"] = 4 * L

    return rebuilt_with(family, change)


# DeepSeek V3 / Kimi K2 as they ship (Kimi K2's text model is deepseek_v3 in transformers 5.24: kimi_k25's
# text_config maps kimi_k2 to it): yarn x40 over 4096 with mscale = mscale_all_dim = 1, served at 163840
DEEPSEEK_V3_YARN = {
    "rope_type": "yarn",
    "factor": 40.0,
    "original_max_position_embeddings": 4096,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}
DEEPSEEK_V3_CONTEXT = 163840


def deepseek_v3_as_shipped(rope_parameters: dict | None = None, max_position_embeddings: int = DEEPSEEK_V3_CONTEXT):
    """The tiny DeepSeek V3 with DeepSeek V3's published rope numbers (or `rope_parameters`), its weights kept."""

    def change(values):
        rope = rope_parameters or DEEPSEEK_V3_YARN
        values["rope_parameters"] = {**rope, "rope_theta": float(values["rope_parameters"]["rope_theta"])}
        values["max_position_embeddings"] = max_position_embeddings

    return rebuilt_with("deepseek_v3", change)


# DeepSeek V4 (shared/notes/families-2026.md): rope parameters keyed main (sliding layers) and compress (compressed
# layers, and the rotary module each compressor and indexer owns); head_dim 32 x 0.25 rotates 4 pairs, interleaved.
# transformers 5.24 has no SDPA for it (eager only). Compress rates small enough that 48 tokens fill windows.
DEEPSEEK_V4_COMPRESSED = ("compressed_sparse_attention", "heavily_compressed_attention")
DEEPSEEK_V4_TINY = dict(
    vocab_size=128,
    hidden_size=64,
    moe_intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=1,
    head_dim=32,
    partial_rotary_factor=0.25,
    q_lora_rank=32,
    n_routed_experts=4,
    num_experts_per_tok=2,
    n_shared_experts=1,
    max_position_embeddings=L,
    sliding_window=SLIDING,  # an int: None fails its strict validation
    compress_rates={DEEPSEEK_V4_COMPRESSED[0]: 4, DEEPSEEK_V4_COMPRESSED[1]: 8},
    mlp_layer_types=["moe", "moe"],
    o_groups=2,
    o_lora_rank=16,
    index_n_heads=2,
    index_head_dim=16,
    index_topk=4,
    hc_mult=2,
    hc_sinkhorn_iters=2,
    tie_word_embeddings=False,
    pad_token_id=0,
)


def deepseek_v4_config(compressed: str = DEEPSEEK_V4_COMPRESSED[0], rope_parameters: dict | None = None):
    """A tiny DeepSeek V4 config: a sliding layer, then a `compressed` one; its own rope parameters by default."""
    extra = {} if rope_parameters is None else {"rope_parameters": rope_parameters}
    return CONFIG_MAPPING["deepseek_v4"](**DEEPSEEK_V4_TINY, layer_types=["sliding_attention", compressed], **extra)


def deepseek_v4_model(compressed: str = DEEPSEEK_V4_COMPRESSED[0], rope_parameters: dict | None = None, like=None):
    """The tiny DeepSeek V4 (fp32, eval, eager attention), random with seed 0 or with the weights of `like`."""
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = deepseek_v4_config(compressed, rope_parameters)
        model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").float().eval()
    if like is not None:
        model.load_state_dict(like.state_dict())
    return model
