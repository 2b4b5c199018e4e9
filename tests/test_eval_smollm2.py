"""sliding_window_nll on the real SmolLM2 at 1k equals the naive HF-docs loop (full logits + labels)."""

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from ctxext import assets
from ctxext.eval.perplexity import sliding_window_nll
from tests.helpers import naive_nll


@pytest.fixture(scope="module")
def smollm2(smollm2_path):
    return AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32, attn_implementation="sdpa").eval()


@pytest.fixture(scope="module")
def hamlet_ids(smollm2_path):
    tokenizer = AutoTokenizer.from_pretrained(smollm2_path)
    text = assets.shakespeare_text(assets.HAMLET_RICHARD3)
    return torch.tensor(tokenizer(text, add_special_tokens=False).input_ids[: 1024 + 256])


@pytest.mark.slow  # `make test-slow`: CI's second step
def test_smollm2_1k_matches_naive_loop_for_stride_256_and_stride_window(smollm2, hamlet_ids):
    windows = []
    ref_nll, ref_count = naive_nll(smollm2, hamlet_ids, 1024, 256, per_window=windows)
    nll, count = sliding_window_nll(smollm2, hamlet_ids, 1024, 256)
    assert count == ref_count == 1023 + 256 and len(windows) == 2
    assert nll == pytest.approx(ref_nll, rel=1e-5)
    # stride = window is one pass over the first window: the naive loop's first window.
    nll, count = sliding_window_nll(smollm2, hamlet_ids, 1024, 1024)
    assert count == windows[0][1] == 1023
    assert nll == pytest.approx(windows[0][0], rel=1e-5)
