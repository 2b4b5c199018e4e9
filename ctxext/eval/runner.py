"""Several methods x several lengths on the same tokens, optionally sharded across `accelerate` processes.

The window plan depends only on the documents, the lengths, the stride and BOS, never on the method, so every
method is scored on exactly the same tokens. Each process scores every world_size-th window and the per-window
sums are gathered; `math.fsum` makes the total independent of how the windows were split.
"""

from __future__ import annotations

import hashlib
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass, fields

import torch
from torch import nn

from ..errors import CtxextError
from ..runtime import Processes
from .data import Document, tokens_fingerprint
from .perplexity import Window, evaluation_mode, perplexity, plan_windows, stride_at, text_tokens_per_window, window_nll
from .rows import EvalMethod

SHORT_DOC_POLICIES = ("skip", "truncate")
__all__ = ["EvalMethod", "LengthPlan", "Score", "iter_scores", "plan_lengths", "run_perplexity"]


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


def plan_fingerprint(documents: list[Document], plan: LengthPlan, bos_token_id: int | None) -> str:
    """A hash of everything a method is scored on at one length: every window's tokens, bounds and targets, and
    the BOS in front of each; a cell's cache key."""
    digest = hashlib.sha256(f"bos={bos_token_id};".encode())
    for window in plan.windows:
        digest.update(f"{window.doc}:{window.begin}:{window.end}:{window.scored};".encode())
    for index in sorted({w.doc for w in plan.windows}):
        digest.update(documents[index].ids.to(torch.int64).numpy().tobytes())
        digest.update(b"|")
    return digest.hexdigest()


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
    cached: bool = False  # read from the cell cache, not computed in this run

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
            "cached": self.cached,
        }

    def cell(self) -> dict:
        """What a cell cache keeps of a score (the label is the row's, not the cell's)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("method", "cached")}


def cell_key(method: EvalMethod, plan: LengthPlan, tokens: str) -> dict:
    """What one (method, length) cell depends on besides the model and runtime (the cache's context)."""
    return {"method": method.description, "length": plan.length, "stride": plan.stride, "tokens": tokens}


def run_perplexity(
    model: nn.Module,
    documents: list[Document],
    plans: list[LengthPlan],
    methods: list[EvalMethod],
    bos_token_id: int | None,
    processes: Processes | None = None,
    progress=None,
    cells=None,
) -> list[Score]:
    """Score every method at every planned length; every process returns the same gathered scores."""
    return list(iter_scores(model, documents, plans, methods, bos_token_id, processes, progress, cells))


def iter_scores(
    model: nn.Module,
    documents: list[Document],
    plans: list[LengthPlan],
    methods: list[EvalMethod],
    bos_token_id: int | None,
    processes: Processes | None = None,
    progress=None,
    cells=None,
) -> Iterator[Score]:
    """Each (method, length) cell's Score as soon as it is done, method by method, length by length.

    `cells` (a ctxext.outputs.CellCache, or None) keeps every computed cell and gives back the ones computed
    before: a method is patched in only when one of its lengths is missing. `progress` (a tqdm bar, on the main
    process) is advanced by each window's length in tokens.
    """
    processes = processes or Processes()
    targets = {plan.length: scored_tokens_fingerprint(documents, plan) for plan in plans}
    tokens = {plan.length: plan_fingerprint(documents, plan, bos_token_id) for plan in plans}
    for method in methods:
        keys = [cell_key(method, plan, tokens[plan.length]) for plan in plans]
        found = _cached_cells(cells, keys, processes)
        applied = False
        try:
            for plan, key, record in zip(plans, keys, found):
                if record is not None:
                    if progress is not None:
                        progress.update(sum(w.length for w in plan.windows[processes.rank :: processes.world_size]))
                    yield _cached_score(method, record)
                    continue
                if not applied:
                    method.apply(model)
                    applied = True
                with evaluation_mode(model):
                    score = _score_plan(model, documents, plan, method, bos_token_id, processes, progress)
                score.tokens_sha256 = targets[plan.length]
                if cells is not None and processes.is_main:
                    cells.put(key, {"score": score.cell()})
                yield score
        finally:
            if applied:
                method.remove(model)


def _cached_cells(cells, keys: list[dict], processes: Processes) -> list[dict | None]:
    """The main process's cached records for `keys`, on every process (None where a cell is missing)."""
    if cells is None:
        return [None] * len(keys)
    found = [cells.get(key) for key in keys] if processes.is_main else None
    return processes.from_main(found)  # every process (tensor-parallel ranks too) skips the same cells


def _cached_score(method: EvalMethod, record: dict) -> Score:
    return Score(method=method.label, cached=True, **record["score"])


def _score_plan(model, documents, plan: LengthPlan, method: EvalMethod, bos_token_id, processes, progress) -> Score:
    """One cell: this process's share of the windows, gathered, summed with fsum (the same on every process)."""
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
    return Score(
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
        tokens_sha256="",
    )
