"""`ctxext eval`'s perplexity for texts given in Python: what the `evaluate` module (evaluate_perplexity/) computes.

The same functions as `ctxext eval` run here (tokenize_documents, plan_lengths, run_perplexity, and the method rows
of ctxext.eval.rows), with the same defaults: stride 256, BOS in front of each window when the tokenizer adds one,
documents shorter than the window skipped, the model as loaded unless a method is given (a dynamic checkpoint
computed statelessly, each window at its own length, as `ctxext eval` computes it).
"""

from __future__ import annotations

from pathlib import Path

from ..errors import CtxextError
from ..eval.data import tokenize_documents
from ..eval.options import parse_stride
from ..eval.rows import as_loaded_row, mapping_row, shipped_record
from ..eval.runner import plan_lengths, run_perplexity
from ..eval.session import bos_choice, load_model_and_tokenizer
from ..run_options import RuntimeOptions
from ..runtime import Processes


def evaluate_module_path() -> str:
    """The folder to give `evaluate.load`: `evaluate.load(ctxext.tasks.evaluate_module_path())`."""
    return str(Path(__file__).resolve().parent / "evaluate_perplexity")


def texts_perplexity(
    texts: list[str],
    model,
    tokenizer=None,
    *,
    window: int,
    stride: int | str = 256,
    method: dict | str | None = None,
    bos: str = "auto",
    short_docs: str = "skip",
    device: str = "auto",
    dtype: str = "auto",
    attn_implementation: str = "auto",
) -> dict:
    """Sliding-window perplexity of `texts` (each one document) at `window` tokens, per docs/METHODS.md.

    `model` is a checkpoint path or hub id (loaded on the device and dtype `ctxext eval` would pick), or a loaded
    model with its `tokenizer`. `method` is a method name or mapping ({"method": "yarn", "factor": 2}), patched in
    for the computation and removed after; None scores the model as loaded. `stride` 'window' is one pass per
    document. Returns perplexity, mean NLL, NLL sum, tokens scored, windows, documents and documents skipped.
    """
    if isinstance(texts, str) or not all(isinstance(t, str) for t in texts):
        raise CtxextError("texts must be a list of strings, one per document")
    if isinstance(model, (str, Path)):
        model, tokenizer = _load(str(model), device, dtype, attn_implementation)
    elif tokenizer is None:
        raise CtxextError("a loaded model needs its tokenizer (tokenizer=...)")
    bos_id, _ = bos_choice(bos, tokenizer)
    documents, _ = tokenize_documents(((f"text {i}", t) for i, t in enumerate(texts)), tokenizer)
    plan = plan_lengths(documents, [int(window)], parse_stride(stride), bos_id, short_docs)
    score = run_perplexity(model, documents, plan, [method_row(method, model.config)], bos_id)[0].to_dict()
    keys = ("perplexity", "mean_nll", "nll_sum", "tokens_scored", "windows", "documents", "documents_skipped")
    return {key: score[key] for key in keys}


def method_row(method: dict | str | None, model_config):
    """The row `ctxext eval` would make: the model as loaded for None, else the method (a name or a mapping)."""
    record = shipped_record(model_config)
    if method is None:
        return as_loaded_row(record)
    return mapping_row({"method": method} if isinstance(method, str) else dict(method), record)


def _load(name: str, device: str, dtype: str, attn_implementation: str):
    model, tokenizer, _ = load_model_and_tokenizer(
        name, RuntimeOptions(device, dtype, attn_implementation), Processes()
    )
    return model, tokenizer
