"""sliding_window_nll against the naive reference: the HF-docs loop with full logits and `labels=`."""

import math

import pytest
import torch

from ctxext import patch
from ctxext.errors import CtxextError
from ctxext.eval.perplexity import plan_windows, sliding_window_nll
from tests.helpers import naive_nll, tiny_model


def test_matches_naive_loop_every_family(family):
    model = tiny_model(family, max_position_embeddings=32)
    ids = torch.randint(2, 256, (101,), generator=torch.Generator().manual_seed(3))
    for window, stride, bos in [(32, 8, None), (20, 7, 1)]:
        nll, count = sliding_window_nll(model, ids, window, stride, bos_token_id=bos)
        ref_nll, ref_count = naive_nll(model, ids, window, stride, bos)
        assert count == ref_count
        assert nll == pytest.approx(ref_nll, rel=1e-5)


@pytest.mark.parametrize("window,stride", [(32, 8), (32, 32), (32, 31), (20, 7), (16, 1)])
@pytest.mark.parametrize("bos", [None, 1])
def test_matches_naive_loop(window, stride, bos):
    model = tiny_model("llama", max_position_embeddings=32)
    ids = torch.randint(2, 256, (101,), generator=torch.Generator().manual_seed(3))
    nll, count = sliding_window_nll(model, ids, window, stride, bos_token_id=bos)
    ref_nll, ref_count = naive_nll(model, ids, window, stride, bos)
    assert count == ref_count
    assert nll == pytest.approx(ref_nll, rel=1e-5)


def test_matches_naive_loop_with_a_scaled_method():
    model = patch(tiny_model("llama", max_position_embeddings=16), "yarn", factor=4)
    ids = torch.randint(2, 256, (90,), generator=torch.Generator().manual_seed(4))
    nll, count = sliding_window_nll(model, ids, 64, 16)
    assert (nll, count) == pytest.approx(naive_nll(model, ids, 64, 16), rel=1e-5)


def test_every_token_is_scored_once():
    # Without BOS each token but the first is a target exactly once; with BOS every token is.
    for n, window, stride in [(100, 32, 8), (100, 32, 32), (64, 64, 1), (33, 32, 5), (1000, 100, 100)]:
        windows = plan_windows(n, window, stride)
        targets = [t for w in windows for t in range(w.end - w.scored, w.end)]
        span = window if stride == window else n
        assert sorted(targets) == list(range(1, span))
        with_bos = plan_windows(n, window, stride, bos_token_id=0)
        targets = [t for w in with_bos for t in range(w.end - w.scored, w.end)]
        assert sorted(targets) == list(range(window - 1 if stride == window else n))
        assert all(w.length <= window - 1 for w in with_bos)


def test_restores_training_state_and_leaves_no_grad():
    model = tiny_model("qwen3")
    model.train()
    model.model.layers[0].eval()  # a mixed state must come back as it was
    ids = torch.randint(0, 256, (40,))
    nll, count = sliding_window_nll(model, ids, 16, 4)
    assert model.training and not model.model.layers[0].training and model.model.layers[1].training
    assert count == 39 and math.isfinite(nll)
    assert all(p.grad is None for p in model.parameters())


def test_progress_is_called_once_per_window():
    class Counter:
        n = 0

        def update(self, k):
            self.n += k

    counter = Counter()
    sliding_window_nll(tiny_model("llama"), torch.arange(50), 16, 4, progress=counter)
    assert counter.n == len(plan_windows(50, 16, 4))


@pytest.mark.parametrize("window,stride,n", [(16, 0, 50), (16, 17, 50), (16, -3, 50), (16, 4, 10), (1, 1, 10)])
def test_bad_window_stride_or_short_document(window, stride, n):
    with pytest.raises(CtxextError):
        sliding_window_nll(tiny_model("llama"), torch.arange(n), window, stride)
