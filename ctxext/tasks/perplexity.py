"""`ctxext eval`'s perplexity for texts given in Python: what the `evaluate` module (evaluate_perplexity/) computes.

The same functions as `ctxext eval` run here (tokenize_documents, plan_lengths, run_perplexity), with the same
defaults: stride 256, BOS in front of each window when the tokenizer adds one, documents shorter than the window
skipped, the model as loaded unless a method is given.
"""

from __future__ import annotations

from pathlib import Path

from ..errors import CtxextError


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
    from ..cli.common import parse_stride
    from ..config import MethodConfig
    from ..eval.data import tokenize_documents, tokenizer_adds_bos
    from ..eval.runner import EvalMethod, plan_lengths, run_perplexity

    if isinstance(texts, str) or not all(isinstance(t, str) for t in texts):
        raise CtxextError("texts must be a list of strings, one per document")
    if isinstance(model, (str, Path)):
        model, tokenizer = _load(str(model), device, dtype, attn_implementation)
    elif tokenizer is None:
        raise CtxextError("a loaded model needs its tokenizer (tokenizer=...)")
    if bos not in ("auto", "yes", "no"):
        raise CtxextError(f"bos must be auto, yes or no, got {bos!r}")
    adds = tokenizer_adds_bos(tokenizer)
    bos_id = tokenizer.bos_token_id if (adds if bos == "auto" else bos == "yes") else None
    documents, _ = tokenize_documents(((f"text {i}", t) for i, t in enumerate(texts)), tokenizer)
    plan = plan_lengths(documents, [int(window)], parse_stride(stride), bos_id, short_docs)
    if isinstance(method, str):
        method = {"method": method}
    if method is None:
        row = EvalMethod("as loaded", None, {"as_loaded": True})
    else:
        config = MethodConfig.from_mapping(dict(method))
        row = EvalMethod(config.label, config, config.to_dict())
    score = run_perplexity(model, documents, plan, [row], bos_id)[0].to_dict()
    keys = ("perplexity", "mean_nll", "nll_sum", "tokens_scored", "windows", "documents", "documents_skipped")
    return {key: score[key] for key in keys}


def _load(name: str, device: str, dtype: str, attn_implementation: str):
    from ..loading import check_model_source, load_model, load_tokenizer
    from ..runtime import Processes, inference_runtime

    check_model_source(name)
    runtime = inference_runtime(device, dtype, attn_implementation, Processes())
    model = load_model(
        name, dtype=runtime["dtype"], device=runtime["device"], attn_implementation=runtime["attn_implementation"]
    )
    return model, load_tokenizer(name)
