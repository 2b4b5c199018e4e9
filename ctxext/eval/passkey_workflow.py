"""`ctxext passkey` as a library call: `evaluate_passkey(PasskeyRequest(...))` -> `PasskeyResult`, whose payload
(results.json) carries its protocol."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import CtxextError
from ..outputs import atomic_output_dir, atomic_write_text, check_output_dir, provenance, write_json
from ..run_options import Invocation, RuntimeOptions
from .options import DEFAULT_LENGTHS, parse_lengths
from .passkey import NEW_TOKENS, accuracy_rows, plan_trials, run_passkey
from .report import passkey_table, plot_passkey_heatmap, write_csv
from .rows import MethodSelection
from .session import EvalSession

DEFAULT_DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)


@dataclass
class PasskeyRequest:
    """What `ctxext passkey` computes: `trials` seeded keys at every depth of every length, for every method."""

    model: str
    lengths: list[int] = field(default_factory=lambda: parse_lengths(DEFAULT_LENGTHS))
    depths: list[float] = field(default_factory=lambda: list(DEFAULT_DEPTHS))
    trials: int = 5
    seed: int = 0
    methods: MethodSelection = field(default_factory=MethodSelection)
    runtime: RuntimeOptions = field(default_factory=RuntimeOptions)
    output: str | None = None
    overwrite: bool = False
    invocation: Invocation = field(default_factory=Invocation)

    def check(self) -> list[str]:
        if self.trials < 1:
            raise CtxextError(f"--passkey-trials must be at least 1, got {self.trials}")
        if not self.lengths or not self.depths or any(not 0 <= d <= 1 for d in self.depths):
            raise CtxextError(f"give at least one length and depths between 0 and 1, got {self.lengths}, {self.depths}")
        self.methods.mappings()  # bad method flags fail before anything is loaded
        protected = [self.model] if Path(self.model).exists() else []
        if self.output is not None:
            check_output_dir(self.output, protected, self.overwrite)
        return protected


@dataclass
class PasskeyResult:
    payload: dict
    by_depth: list[dict]
    by_length: list[dict]
    labels: list[str]
    table: str
    main_process: bool = True

    @property
    def protocol(self) -> dict:
        return self.payload["protocol"]


def passkey_protocol(request: PasskeyRequest, bos: dict) -> dict:
    return {
        "name": "passkey retrieval (Landmark / YaRN format), ctxext docs/METHODS.md",
        "decoding": f"greedy, {NEW_TOKENS} new tokens",
        "success": "first integer in the output == key",
        "key_range": [1, 50000],
        "depths": request.depths,
        "trials_per_cell": request.trials,
        "seed": request.seed,
        "bos": bos,
    }


def evaluate_passkey(request: PasskeyRequest, log=None) -> PasskeyResult:
    """Passkey accuracy of every method per length and depth; writes request.output (when given) on the main
    process. `log(line)` is told what runs."""
    started = time.perf_counter()
    protected = request.check()
    session = EvalSession.open(request.model, request.methods, request.runtime)
    trials = plan_trials(request.lengths, request.depths, request.trials, request.seed)
    processes, methods = session.processes, session.methods
    if processes.is_main and log is not None:
        log(
            f"ctxext passkey: {request.trials} trials x {len(request.depths)} depths x {len(request.lengths)} "
            f"lengths x {len(methods)} methods; {session.runtime_line()}"
        )
        for line in session.beyond_training_notes(request.lengths):
            log(line)
    progress = session.progress(len(trials[processes.rank :: processes.world_size]) * len(methods), "trial")
    try:
        records = run_passkey(session.model, session.tokenizer, trials, methods, session.bos_id, processes, progress)
    finally:
        if progress is not None:
            progress.close()
    by_depth, by_length = accuracy_rows(records)
    labels = [m.label for m in methods]
    payload = {
        "command": request.invocation.command,
        "arguments": request.invocation.arguments,
        "model": session.description(),
        "protocol": passkey_protocol(request, session.bos_info),
        "methods": [m.record(session.model) for m in methods],
        "notes": session.beyond_training_notes(request.lengths),
        "lengths": request.lengths,
        "accuracy_by_length": by_length,
        "accuracy_by_depth": by_depth,
        "trials": records,
        "runtime": {
            "processes": processes.launched,
            "tensor_parallel": processes.tp,
            "seconds": time.perf_counter() - started,
        },
        "environment": provenance(),
    }
    table = passkey_table(by_length, labels, request.lengths)
    result = PasskeyResult(payload, by_depth, by_length, labels, table, processes.is_main)
    if processes.is_main and request.output is not None:
        write_passkey_outputs(result, request, protected)
    return result


def write_passkey_outputs(result: PasskeyResult, request: PasskeyRequest, protected: list[str]) -> None:
    labels = result.labels
    with atomic_output_dir(request.output, protected, request.overwrite) as staging:
        write_json(staging / "results.json", result.payload, allow_nan=True)
        write_csv(
            staging / "results.csv",
            sorted(result.by_depth, key=lambda r: (labels.index(r["method"]), r["length"], r["depth"])),
            ["method", "length", "depth", "trials", "correct", "accuracy"],
        )
        atomic_write_text(staging / "table.txt", result.table + "\n")
        plot_passkey_heatmap(
            result.by_depth,
            labels,
            request.lengths,
            request.depths,
            staging / "passkey.png",
            f"{Path(request.model).name}: passkey accuracy, {request.trials} trials per cell",
        )
