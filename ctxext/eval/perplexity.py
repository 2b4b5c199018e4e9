"""Sliding-window perplexity, exactly as the protocol in docs/METHODS.md ("Perplexity protocol") states it.

The window plan is the loop of the HF docs page "Perplexity of fixed-length models" (Press et al.):

    prev_end = 0
    for begin in range(0, n, stride):
        end = min(begin + window, n); scored = end - prev_end   # labels before that are -100
        ...; prev_end = end; stop once end == n

so the first window scores all its tokens (but the first, which has nothing to condition on) and every
later window scores only the tokens no earlier window scored. Perplexity is exp(token-weighted mean NLL).
`stride == window` is truncate mode: one pass over the first `window` tokens (as in YaRN's tables).

With `bos_token_id`, each window is BOS + (window - 1) text tokens (as YaRN's script does); BOS is context
only, never a target, and the first text token is then scored too.

Memory: for the families whose logits are lm_head(last hidden state) (`PLAIN_HEAD_FAMILIES`: Llama, Mistral,
Qwen 2/3 and their MoE, Mixtral, SmolLM3, OLMo 2), the full logits of a window (window x vocab floats: 3.2 GB for
a 16k window of a 49k vocabulary, 67 GB at 128k with Llama 3's 128k vocabulary) are never made. The decoder
returns hidden states (window x hidden); only the positions that predict scored tokens go through the LM head,
LM_HEAD_CHUNK at a time, each chunk reduced to a summed cross-entropy straight away, so at most
LM_HEAD_CHUNK x vocab logits exist at once, whatever the window. Other families (soft-capped or scaled logits:
Gemma 2/3, Cohere, Granite, ...) go through the model's own forward with logits_to_keep = scored + 1: stride + 1
rows for most windows, but the whole window for the first window of each document and in one-pass mode.
Under accelerate's dispatch (ctxext.dispatch) the same holds: each chunk of hidden states goes to the LM head's
execution device (its hook moves it), and the chunk's targets follow the logits there.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..dispatch import input_device
from ..errors import CtxextError
from ..validate import whole_number

# Positions per LM-head chunk: 256 x 49152 vocab x 4 bytes = 50 MB of fp32 logits (and as much for the softmax).
LM_HEAD_CHUNK = 256


@dataclass(frozen=True)
class Window:
    """One forward pass: text tokens [begin, end) of a document; the last `scored` of them are targets."""

    begin: int
    end: int
    scored: int
    doc: int = 0

    @property
    def length(self) -> int:
        return self.end - self.begin


def text_tokens_per_window(window: int, bos_token_id: int | None) -> int:
    """Text tokens that fit in a window: BOS takes one place when the model wants it."""
    return window - 1 if bos_token_id is not None else window


def check_window_and_stride(window: int, stride: int) -> tuple[int, int]:
    window = whole_number("window", window, minimum=2)
    stride = whole_number("stride", stride)
    if stride > window:
        raise CtxextError(f"stride must be between 1 and the window ({window}), got {stride}")
    return window, stride


def stride_at(window: int, stride: int | None) -> int:
    """The stride a requested stride means at one window length, for `ctxext eval` and the training loop alike.

    None (`--stride window`) is truncate mode: one pass per document (stride = window). An integer stride
    always slides: where the window is not longer than it, the stride becomes half the window, so that every
    token is still scored with some context (stride = window would mean one pass, a longer one would skip
    tokens).
    """
    if stride is None:
        return window
    return stride if stride < window else max(1, window // 2)


def plan_windows(
    n_tokens: int, window: int, stride: int, bos_token_id: int | None = None, doc: int = 0
) -> list[Window]:
    """The windows the protocol evaluates for a document of `n_tokens` text tokens (see the module docstring).

    A document shorter than a window is an error here: the caller skips or truncates it, and says so.
    """
    window, stride = check_window_and_stride(window, stride)
    span = text_tokens_per_window(window, bos_token_id)
    if n_tokens < span:
        raise CtxextError(f"a document of {n_tokens} tokens is shorter than the window ({span} text tokens)")
    if stride == window:  # truncate mode: a single pass
        n_tokens = span
    windows, prev_end = [], 0
    # Without BOS the first token of a document can never be a target.
    first_target = 0 if bos_token_id is not None else 1
    for begin in range(0, n_tokens, stride):
        end = min(begin + span, n_tokens)
        scored = end - max(prev_end, first_target)
        windows.append(Window(begin, end, scored, doc))
        prev_end = end
        if end == n_tokens:
            break
    return windows


# Families whose logits are exactly lm_head(last hidden state): no soft-capping (Gemma 2/3), logit scale
# (Cohere, Granite) or other step between. Others are scored through the model's own forward.
PLAIN_HEAD_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "mixtral", "smollm3", "olmo2")


def _decoder_and_head(model: nn.Module) -> tuple[nn.Module, nn.Module] | None:
    """(decoder returning last_hidden_state, LM head) for the families whose logits are lm_head(hidden), else
    None (the caller then uses the model's own forward)."""
    inner = model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model  # PEFT
    if getattr(getattr(inner, "config", None), "model_type", None) not in PLAIN_HEAD_FAMILIES:
        return None
    decoder, head = inner.get_decoder(), inner.get_output_embeddings()
    if decoder is inner or head is None:
        return None
    return decoder, head


def _window_input(ids: torch.Tensor, window: Window, bos_token_id: int | None, device) -> torch.Tensor:
    text = ids[window.begin : window.end]
    if bos_token_id is not None:
        text = torch.cat([text.new_tensor([bos_token_id]), text])
    return text.to(device).unsqueeze(0)


def window_nll(model: nn.Module, ids: torch.Tensor, window: Window, bos_token_id: int | None = None) -> float:
    """Summed NLL (nats, float64) of the `window.scored` targets at the end of one window. No grad, no cache."""
    inputs = _window_input(ids, window, bos_token_id, input_device(model))
    targets = inputs[0, -window.scored :]
    # Position p predicts token p+1, so the targets' predictors are the `scored` positions before the last.
    first_predictor = inputs.shape[1] - window.scored - 1
    parts = _decoder_and_head(model)
    if parts is None:  # any other causal LM: the model's own logits_to_keep keeps only what is scored
        logits = model(input_ids=inputs, use_cache=False, logits_to_keep=window.scored + 1).logits[0, :-1]
        return float(F.cross_entropy(logits.float(), targets, reduction="sum").double())
    decoder, head = parts
    hidden = decoder(input_ids=inputs, use_cache=False).last_hidden_state[0]
    total = 0.0
    for start in range(first_predictor, inputs.shape[1] - 1, LM_HEAD_CHUNK):
        stop = min(start + LM_HEAD_CHUNK, inputs.shape[1] - 1)
        logits = head(hidden[start:stop]).float()  # on the head's device (dispatched: its execution device)
        chunk_targets = inputs[0, start + 1 : stop + 1].to(logits.device)
        total += float(F.cross_entropy(logits, chunk_targets, reduction="sum").double())
        del logits
    return total


def sliding_window_nll(
    model: nn.Module,
    input_ids: torch.LongTensor,
    window: int,
    stride: int,
    bos_token_id: int | None = None,
    progress=None,
) -> tuple[float, int]:
    """(sum of NLL over scored tokens, number of scored tokens) for one document, per the protocol.

    `input_ids` is the document's 1-D token ids, without BOS; pass `bos_token_id` to start every window with
    it. `stride == window` scores the first window only (truncate mode). `progress`, if given, gets
    `.update(1)` after each window (a tqdm bar, say). Runs under torch.inference_mode with the model in eval
    mode, and puts the model back in the training state it was in.
    """
    ids = _as_token_ids(input_ids)
    windows = plan_windows(len(ids), window, stride, bos_token_id)
    total, count = 0.0, 0
    with evaluation_mode(model):
        for w in windows:
            total += window_nll(model, ids, w, bos_token_id)
            count += w.scored
            if progress is not None:
                progress.update(1)
    return total, count


def _as_token_ids(input_ids) -> torch.Tensor:
    ids = torch.as_tensor(input_ids)
    if ids.dim() == 2 and ids.shape[0] == 1:
        ids = ids[0]
    if ids.dim() != 1:
        raise CtxextError(f"input_ids must be one document's 1-D token ids, got shape {tuple(ids.shape)}")
    return ids.long()


class evaluation_mode:
    """eval() + torch.inference_mode(); the model's train/eval flags (every submodule's) come back afterwards."""

    def __init__(self, model: nn.Module):
        self.model = model

    def __enter__(self):
        self.training = {name: m.training for name, m in self.model.named_modules()}
        self.model.eval()
        self.inference = torch.inference_mode()
        self.inference.__enter__()
        return self.model

    def __exit__(self, *exc):
        self.inference.__exit__(*exc)
        for name, m in self.model.named_modules():
            m.training = self.training.get(name, m.training)
        return False


def perplexity(nll_sum: float, n_tokens: int) -> float:
    """exp(token-weighted mean NLL); nan when nothing was scored."""
    return math.exp(nll_sum / n_tokens) if n_tokens else float("nan")
