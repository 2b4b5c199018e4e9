"""Several methods x several lengths on the same tokens, optionally sharded across `accelerate` processes.

The window plan depends only on the documents, the lengths, the stride and BOS, never on the method, so every
method is scored on exactly the same tokens. Each process scores every world_size-th window and the per-window
sums are gathered; `math.fsum` makes the total independent of how the windows were split.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from torch import nn

from ..errors import CtxextError
from ..runtime import Processes
from .data import Document, tokens_fingerprint
from .perplexity import Window, evaluation_mode, perplexity, plan_windows, stride_at, text_tokens_per_window, window_nll

SHORT_DOC_POLICIES = ("skip", "truncate")


@dataclass
class EvalMethod:
    """A row of the results: a MethodConfig to patch in, or None for the model exactly as loaded."""

    label: str
    config: object | None = None  # ctxext.config.MethodConfig
    description: dict = field(default_factory=dict)

    def apply(self, model: nn.Module) -> None:
        from ..patching import unpatch

        unpatch(model) if self.config is None else self.config.apply(model)

    def remove(self, model: nn.Module) -> None:
        from ..patching import unpatch

        unpatch(model)


@dataclass
class LengthPlan:
    """The windows of one evaluated length over all documents, and which documents were skipped."""

    length: int
    stride: int
    windows: list[Window]
    skipped: list[str]
    truncated: list[str]
    documents: int

    @property
    def scored_tokens(self) -> int:
        return sum(w.scored for w in self.windows)


def plan_lengths(
    documents: list[Document],
    lengths: list[int],
    stride: int | None,
    bos_token_id: int | None,
    short_docs: str = "skip",
) -> list[LengthPlan]:
    """One LengthPlan per length, at the stride `stride_at` gives (None: one pass per document)."""
    if short_docs not in SHORT_DOC_POLICIES:
        raise CtxextError(f"short-document policy must be one of {', '.join(SHORT_DOC_POLICIES)}, got {short_docs!r}")
    plans = []
    for length in lengths:
        step = stride_at(length, stride)
        windows, skipped, truncated, used = [], [], [], 0
        for index, doc in enumerate(documents):
            if len(doc) < text_tokens_per_window(length, bos_token_id):
                if short_docs == "skip" or len(doc) < 2:
                    skipped.append(doc.name)
                    continue
                # Truncate: the whole document in one shorter window.
                short = len(doc) + (1 if bos_token_id is not None else 0)
                windows += plan_windows(len(doc), short, short, bos_token_id, doc=index)
                truncated.append(doc.name)
            else:
                windows += plan_windows(len(doc), length, step, bos_token_id, doc=index)
            used += 1
        plans.append(LengthPlan(length, step, windows, skipped, truncated, used))
    empty = [p for p in plans if not p.windows]
    if empty:
        longest = max(len(d) for d in documents)
        need = text_tokens_per_window(empty[0].length, bos_token_id)
        raise CtxextError(
            f"the data is too short for length {empty[0].length}: no document has {need} tokens (the longest has "
            f"{longest}); use shorter --lengths, longer documents, or --short-docs truncate"
        )
    return plans


def scored_tokens_fingerprint(documents: list[Document], plan: LengthPlan) -> str:
    """A hash of the targets of a plan, in order: the same for every method by construction."""
    return tokens_fingerprint(documents[w.doc].ids[w.end - w.scored : w.end] for w in plan.windows)


@dataclass
class Score:
    method: str
    length: int
    stride: int
    nll_sum: float
    tokens: int
    windows: int
    documents: int
    skipped: list[str]
    truncated: list[str]
    seconds: float
    tokens_sha256: str

    @property
    def perplexity(self) -> float:
        return perplexity(self.nll_sum, self.tokens)

    def to_dict(self) -> dict:
        return {
            "method": self.method,
            "length": self.length,
            "stride": self.stride,
            "perplexity": self.perplexity,
            "nll_sum": self.nll_sum,
            "mean_nll": self.nll_sum / self.tokens if self.tokens else float("nan"),
            "tokens_scored": self.tokens,
            "windows": self.windows,
            "documents": self.documents,
            "documents_skipped": len(self.skipped),
            "skipped": self.skipped,
            "truncated": self.truncated,
            "seconds": self.seconds,
            "tokens_sha256": self.tokens_sha256,
        }


def run_perplexity(
    model: nn.Module,
    documents: list[Document],
    plans: list[LengthPlan],
    methods: list[EvalMethod],
    bos_token_id: int | None,
    processes: Processes | None = None,
    progress=None,
) -> list[Score]:
    """Score every method at every planned length; every process returns the same gathered scores.

    `progress` (a tqdm bar, on the main process) is advanced by each window's length in tokens.
    """
    processes = processes or Processes()
    fingerprints = {plan.length: scored_tokens_fingerprint(documents, plan) for plan in plans}
    scores = []
    for method in methods:
        method.apply(model)
        try:
            with evaluation_mode(model):
                for plan in plans:
                    if progress is not None:
                        progress.set_description(f"{method.label} @ {plan.length}")
                    start = time.perf_counter()
                    mine = []
                    for index in range(processes.rank, len(plan.windows), processes.world_size):
                        window = plan.windows[index]
                        mine.append((index, window_nll(model, documents[window.doc].ids, window, bos_token_id)))
                        if progress is not None:
                            progress.update(window.length)
                    elapsed = time.perf_counter() - start
                    gathered = processes.gather([(index, nll, elapsed) for index, nll in mine] or [(-1, 0.0, elapsed)])
                    per_window = sorted((i, nll) for i, nll, _ in gathered if i >= 0)
                    if [i for i, _ in per_window] != list(range(len(plan.windows))):
                        raise RuntimeError("gathered windows do not cover the plan; processes disagree on the data")
                    scores.append(
                        Score(
                            method=method.label,
                            length=plan.length,
                            stride=plan.stride,
                            nll_sum=math.fsum(nll for _, nll in per_window),
                            tokens=plan.scored_tokens,
                            windows=len(plan.windows),
                            documents=plan.documents,
                            skipped=plan.skipped,
                            truncated=plan.truncated,
                            seconds=max(s for _, _, s in gathered),
                            tokens_sha256=fingerprints[plan.length],
                        )
                    )
        finally:
            method.remove(model)
    return scores
