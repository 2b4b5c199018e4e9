"""What a search minimises: ctxext's own perplexity on calibration documents, optionally with passkey accuracy.

- `ppl`: perplexity (the METHODS.md protocol, `sliding_window_nll`) over the calibration documents at the search
  length: one window per document by default (`stride=None`), or a sliding window.
- `passkey`: the passkey error rate (1 - accuracy) at the search length, on seeded keys (`ctxext.eval.passkey`).
- `ppl+passkey`: perplexity x 2^(1 - accuracy): perfect retrieval leaves the perplexity as it is, no retrieval
  doubles it.
- `needle-ppl`: the mean NLL of the answer tokens of the seeded passkey prompts at the search length (LongRoPE2's
  needle-driven perplexity): one forward pass per prompt, no generation, continuous where accuracy is a step.
- `ppl+needle-ppl`: ln(perplexity) + that mean answer NLL, i.e. perplexity x needle perplexity: the text's and the
  answer's per-token NLL weighted equally.

The same scoring re-scores the best parameters and the defaults on held-out documents after the search.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..config import MethodConfig
from ..errors import CtxextError
from ..eval.passkey import answer_nll, run_passkey
from ..eval.perplexity import perplexity, sliding_window_nll
from ..eval.rows import EvalMethod
from ..methods import get_method
from ..methods.attention import AttentionSettings
from ..patching import unpatch
from ..patching.patch import check_shape, trained_context_of
from .loop import InvalidParams, best_trial
from .output import SearchSettings
from .space import collapse_elements

OBJECTIVES = ("ppl", "passkey", "ppl+passkey", "needle-ppl", "ppl+needle-ppl")


def check_objective(name: str) -> str:
    if name not in OBJECTIVES:
        raise CtxextError(f"--objective must be one of {', '.join(OBJECTIVES)}, got '{name}'")
    return name


def method_config(base: dict, params: dict):
    """A validated MethodConfig from the fixed settings and one trial's parameters; InvalidParams if rejected."""
    try:
        values = collapse_elements(params)
        return MethodConfig.from_mapping({**base, **values})
    except CtxextError as error:
        raise InvalidParams(str(error)) from None


def score_perplexity(model, config, documents, length: int, stride: int | None, bos_token_id: int | None) -> dict:
    """Summed NLL and scored tokens over `documents` (per document too) with `config` applied (None: as loaded)."""
    checked_method("trial", config).apply(model)
    try:
        per_document = []
        for doc in documents:
            nll, tokens = sliding_window_nll(model, doc.ids, length, length if stride is None else stride, bos_token_id)
            per_document.append(
                {"document": doc.name, "nll_sum": nll, "tokens": tokens, "perplexity": perplexity(nll, tokens)}
            )
    finally:
        unpatch(model)
    nll_sum = math.fsum(d["nll_sum"] for d in per_document)
    tokens = sum(d["tokens"] for d in per_document)
    return {"perplexity": perplexity(nll_sum, tokens), "nll_sum": nll_sum, "tokens": tokens, "documents": per_document}


def score_passkey(model, tokenizer, config, trials, bos_token_id: int | None) -> dict:
    records = run_passkey(model, tokenizer, trials, [checked_method("trial", config)], bos_token_id)
    correct = sum(r["correct"] for r in records)
    return {"passkey_accuracy": correct / len(records), "passkey_correct": correct, "passkey_trials": len(records)}


def score_needle(model, tokenizer, config, trials, bos_token_id: int | None) -> dict:
    """Mean NLL of the passkey answers' tokens (needle-driven perplexity), with `config` applied."""
    checked_method("trial", config).apply(model)
    try:
        scored = [answer_nll(model, tokenizer, trial, bos_token_id) for trial in trials]
    finally:
        unpatch(model)
    tokens = sum(n for _, n in scored)
    nll = math.fsum(s for s, _ in scored) / tokens
    return {"needle_nll": nll, "needle_perplexity": math.exp(nll), "needle_tokens": tokens}


def check_params(model, config) -> None:
    """InvalidParams where `config`'s parameters are rejected for this model: the checks `patch` makes on the
    parameters themselves (validation, the length-dependent values resolved against L, DPE's groups against the
    rotary pairs). What `patch` refuses about the model (its attention implementation, a sliding window, ...) is
    not a parameter's fault: it stops the search."""
    L = config.original_max_position_embeddings or trained_context_of(model)
    try:
        params = get_method(config.method).make_params(factor=config.factor, **config.params)
        AttentionSettings.for_method(config.method, params, config.logn, L)
        check_shape(model.config, params, L)
    except CtxextError as error:
        raise InvalidParams(str(error)) from None


def checked_method(label: str, config):
    """The EvalMethod (`ctxext.eval.rows`) a trial runs: its parameters are checked first, so a parameter the model
    rejects raises InvalidParams (an invalid trial); any other error at patch time propagates. None: as loaded."""
    return EvalMethod(label, config, check=check_params)


@dataclass
class Objective:
    """Scores one trial's parameters on the calibration data: {"value": ..., perplexity and/or passkey metrics}."""

    kind: str
    base: dict  # method, factor, original_max_position_embeddings, logn and the fixed parameters
    model: object
    tokenizer: object
    documents: list
    length: int
    stride: int | None = None
    bos_token_id: int | None = None
    passkey_trials: list = field(default_factory=list)

    def __call__(self, params: dict) -> dict:
        config = method_config(self.base, params)
        metrics = {}
        if self.kind in ("ppl", "ppl+passkey", "ppl+needle-ppl"):
            scored = score_perplexity(self.model, config, self.documents, self.length, self.stride, self.bos_token_id)
            metrics.update(perplexity=scored["perplexity"], nll_sum=scored["nll_sum"], tokens=scored["tokens"])
        if self.kind in ("passkey", "ppl+passkey"):
            metrics.update(score_passkey(self.model, self.tokenizer, config, self.passkey_trials, self.bos_token_id))
        if self.kind in ("needle-ppl", "ppl+needle-ppl"):
            metrics.update(score_needle(self.model, self.tokenizer, config, self.passkey_trials, self.bos_token_id))
        metrics["value"] = combine(self.kind, metrics)
        return metrics


def combine(kind: str, metrics: dict) -> float:
    if kind == "ppl":
        return metrics["perplexity"]
    if kind == "passkey":
        return 1.0 - metrics["passkey_accuracy"]
    if kind == "needle-ppl":
        return metrics["needle_nll"]
    if kind == "ppl+needle-ppl":
        return math.log(metrics["perplexity"]) + metrics["needle_nll"]
    return metrics["perplexity"] * 2.0 ** (1.0 - metrics["passkey_accuracy"])


def held_out_scores(
    settings: SearchSettings, history: list[dict], model, documents, bos_token_id, baseline: bool = True, progress=None
) -> dict:
    """Perplexity of the defaults (trial 0), LongRoPE's starting curve (trial 1), the best trial and (optionally)
    the model as loaded on `documents`."""
    best = best_trial(history)
    rows, done = {}, {}
    candidates = (
        [("defaults", history[0])]
        + [("start", t) for t in history[1:2] if t["role"] == "start"]
        + ([("best", best)] if best is not None else [])
    )
    for name, trial in candidates:
        if trial["state"] != "complete":
            rows[name] = None
            continue
        if trial["number"] in done:
            rows[name] = rows[done[trial["number"]]]
            continue
        done[trial["number"]] = name
        rows[name] = score_perplexity(
            model,
            method_config(settings.base, trial["params"]),
            documents,
            settings.length,
            settings.stride,
            bos_token_id,
        )
        if progress is not None:
            progress.update(1)
    if baseline:
        rows["none"] = score_perplexity(model, None, documents, settings.length, settings.stride, bos_token_id)
    return rows
