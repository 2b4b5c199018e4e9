"""`ctxext search --tp N`: one search on a model split by transformers' tensor parallelism over the N processes a
launcher started.

Every process holds a shard of every layer, so every forward needs all of them, with the same inputs. The first
process runs the search as one process would (the study, the proposals, the records, the outputs: `Leader`); each
time it scores something on the model (a trial's parameters, the held-out re-scoring) it first sends the others
what to score, and they score the same on their shards (`follow`). Their own plan is the first process's: the
plan reads only the request, the model's config and the data. Each score runs as one process (`alone`), so a
passkey objective does not share its trials among the processes as data-parallel evaluation would.
"""

from __future__ import annotations

import contextlib

from ..errors import CtxextError
from ..runtime import Processes, alone, cpu_processes
from .loop import InvalidParams
from .objective import Objective, held_out_scores

STOP = None  # the message that ends the others' `follow`


def check_tensor_parallel_search(request) -> None:
    """What a tensor-parallel search refuses: --workers (each would load the whole model again) and DPE's
    --select-pairs (its measurement averages the heads a process holds: each shard would pick other pairs)."""
    if request.workers > 1:
        raise CtxextError(
            f"--tp {request.runtime.tp} and --workers {request.workers}: each worker loads a model of its own, but "
            "under --tp the launched processes hold one model together; drop --workers"
        )
    if request.select_pairs is not None:
        raise CtxextError(
            f"--tp {request.runtime.tp} and --select-pairs: DPE's selection averages |q_p||k_p| over the query heads, "
            "and each process holds only its own heads (it would pick other pairs); select the pairs in one process "
            "(ctxext patch --select-pairs) and give them as --selected-pairs"
        )


def make_objective(plan, model) -> Objective:
    settings = plan.settings
    return Objective(
        settings.objective,
        settings.base,
        model,
        plan.tokenizer,
        plan.calibration,
        settings.length,
        settings.stride,
        plan.bos_id,
        plan.passkey_trials,
    )


class Leader:
    """On the first process: scoring through it sends the other processes the same work first."""

    def __init__(self, processes: Processes):
        self.processes = processes
        self.stopped = False

    def objective(self, objective: Objective):
        def scored(params: dict) -> dict:
            self.processes.from_main(("trial", params))
            with alone():
                return objective(params)

        return scored

    def held_out(self, history: list[dict], score):
        self.processes.from_main(("held_out", history))
        with alone():
            return score(history)

    def stop(self) -> None:
        """Tell the others the model's work is done (once): they return while this process writes the outputs, so
        none waits in a collective for longer than its timeout (a checkpoint written from a large model, say)."""
        if not self.stopped:
            self.stopped = True
            self.processes.from_main(STOP)


def held_out_scorer(plan, model, baseline: bool):
    """history -> the held-out scores (`ctxext.search.objective.held_out_scores`) on `plan`'s held-out documents."""
    return lambda history: held_out_scores(plan.settings, history, model, plan.held_out, plan.bos_id, baseline=baseline)


def follow(processes: Processes, plan, model) -> None:
    """On the other processes: score what the first process scores, until it says it is done."""
    objective = make_objective(plan, model)
    held_out = held_out_scorer(plan, model, plan.request.baseline)
    while (message := processes.from_main(None)) is not STOP:
        kind, payload = message
        with alone():
            if kind == "trial":
                with contextlib.suppress(InvalidParams):  # the first process records it as invalid, and goes on
                    objective(payload)
            else:
                held_out(payload)


def tensor_parallel_processes(request) -> Processes:
    check_tensor_parallel_search(request)
    return Processes(cpu=cpu_processes(request.runtime.device), tp=request.runtime.tp)
