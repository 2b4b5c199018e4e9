"""A fine-tuning run's periodic evaluation: perplexity on held-out documents at each length, by ctxext.eval's
protocol (docs/METHODS.md), shared out over the processes and written to the metrics log.
"""

from __future__ import annotations

import contextlib
import time
from typing import TYPE_CHECKING

import torch
from accelerate.utils import DistributedType

from ..eval.data import load_documents, tokenizer_adds_bos
from ..eval.perplexity import evaluation_mode, perplexity, window_nll
from ..eval.runner import plan_lengths
from ..patching import unpatch
from .data import check_held_out
from .mixed_window import rotary_switch, rotary_used
from .recipe import Recipe
from .records import MetricsLog

if TYPE_CHECKING:
    from .state import Setup


def load_eval_documents(recipe: Recipe, tokenizer, method_length: int, train_names: list[str]):
    """(documents, lengths, bos_token_id) of the held-out evaluation; checked against the training documents."""
    ev = recipe.eval
    if not ev.every:
        return [], [], None
    doc_set = load_documents(
        tokenizer,
        text_files=ev.text_files or None,
        dataset=ev.dataset or None,
        split=ev.split,
        dataset_config=ev.config,
        text_field=ev.text_field,
        max_docs=ev.max_docs,
    )
    documents = doc_set.documents
    if ev.max_tokens_per_doc:
        for doc in documents:
            doc.ids = doc.ids[: ev.max_tokens_per_doc]
    check_held_out(train_names, [d.name for d in documents])
    lengths = sorted(set(ev.lengths or [recipe.seq_len, method_length]), reverse=True)
    bos = tokenizer.bos_token_id if tokenizer_adds_bos(tokenizer) else None
    for length in lengths:  # fails now if no document is long enough
        plan_length(documents, length, ev.stride, bos)
    return documents, lengths, bos


def plan_length(documents, length: int, stride: int, bos: int | None):
    """The evaluator's window plan at one length (the stride rule is `ctxext.eval.perplexity.stride_at`)."""
    return plan_lengths(documents, [length], stride, bos)[0]


def evaluate_before_training(setup: Setup, model, log: MetricsLog) -> None:
    """Step 0: the unpatched base model's reference (if asked) and the patched model before any update."""
    if setup.recipe.eval.base_reference:
        started = time.perf_counter()
        base = base_reference(setup, setup.runtime.accelerator.unwrap_model(model))
        log.write(
            {
                "kind": "base_reference",
                "step": 0,
                "length": setup.method_length,
                "perplexity": base,
                "seconds": round(time.perf_counter() - started, 2),
            }
        )
    log_evaluation(setup, model, log, 0)


def log_evaluation(setup: Setup, model, log: MetricsLog, step: int, bar=None) -> dict:
    """Evaluate at every length, log the record, and show it under the progress bar (if given)."""
    started = time.perf_counter()
    unwrapped = setup.runtime.accelerator.unwrap_model(model)
    scores = evaluate(setup, unwrapped, setup.eval_lengths)
    record = {"kind": "eval", "step": step, "perplexity": {str(k): v for k, v in scores.items()}}
    if setup.mixed_window:
        record.update(mixed_window_scores(setup, unwrapped))
    record["seconds"] = round(time.perf_counter() - started, 2)
    log.write(record)
    if bar is not None and setup.runtime.is_main:
        bar.write(f"step {step}: perplexity " + ", ".join(f"{k}: {v:.2f}" for k, v in record["perplexity"].items()))
    return record


def evaluate(setup: Setup, model, lengths: list[int], switch: bool = True) -> dict[int, float]:
    """Perplexity at each length on the held-out documents (docs/METHODS.md protocol, via ctxext.eval).

    The windows are shared out over the processes and the sums gathered; under FSDP/DeepSpeed every process
    scores every window, since each forward needs all of them. A mixed-window run scores windows of at most L
    tokens with the original rotary, unless `switch` is False (then every window uses the patched rotary).
    """
    runtime = setup.runtime
    accelerator = runtime.accelerator
    share = not runtime.sharded and accelerator.num_processes > 1
    rank, world = (accelerator.process_index, accelerator.num_processes) if share else (0, 1)
    fsdp = accelerator.distributed_type == DistributedType.FSDP
    scorer = WholeForward(model) if fsdp else model
    # FSDP2 keeps the buffers it gathers parameters into and reuses them in training: gathered under inference
    # mode they would be inference tensors, which training may not write. Under FSDP, no_grad instead.
    no_inference_mode = torch.inference_mode(False) if fsdp else contextlib.nullcontext()
    results = {}
    switched = rotary_switch(setup.mixed_window and switch, model, setup.method_length)
    with accelerator.autocast(), evaluation_mode(model), no_inference_mode, torch.no_grad(), switched:
        for plan in [
            plan_length(setup.eval_documents, n, setup.recipe.eval.stride, setup.bos_token_id) for n in lengths
        ]:
            nll = 0.0
            for index in range(rank, len(plan.windows), world):
                window = plan.windows[index]
                nll += window_nll(scorer, setup.eval_documents[window.doc].ids, window, setup.bos_token_id)
            if share:
                nll = float(
                    accelerator.reduce(
                        torch.tensor([nll], dtype=torch.float64, device=accelerator.device), reduction="sum"
                    )[0]
                )
            results[plan.length] = perplexity(nll, plan.scored_tokens)
    return results


class WholeForward(torch.nn.Module):
    """The model, scored through its own forward only. Under FSDP2 the root module's forward hooks gather the
    parameters no layer's FSDP unit holds (the embeddings, the final norm, the LM head); window_nll's faster path
    (the decoder, then the head in chunks) would call those modules directly, on their shards. Through the model's
    forward it keeps the scored positions' logits only (logits_to_keep), so the score is the same."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, **inputs):
        return self.model(**inputs)


def base_reference(setup: Setup, model) -> float:
    """The unpatched model's perplexity at the original length (LoRA's B starts at zero, so this is the base)."""
    unpatch(model)
    try:
        return evaluate(setup, model, [setup.method_length])[setup.method_length]
    finally:
        setup.recipe.method.apply(model)


def mixed_window_scores(setup: Setup, model) -> dict:
    """For a mixed-window run: which rotary scored each length, and the windows of at most L scored with the
    patched rotary too (what the model does when the switch is not used)."""
    label, original = setup.recipe.method.label, setup.method_length
    short = [n for n in setup.eval_lengths if n <= original]
    patched = evaluate(setup, model, short, switch=False) if short else {}
    return {
        "rotary": {str(n): rotary_used(n, original, label) for n in setup.eval_lengths},
        "perplexity_patched_rotary": {str(k): v for k, v in patched.items()},
    }
