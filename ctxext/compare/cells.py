"""The cells of a compare: one perplexity (a row or native, one document, one length) or one passkey result (a row,
one length), each a small JSON file written atomically as soon as it is computed (`ctxext.outputs.CellCache`), keyed
by the model, dtype, BOS, the method's settings, the tokens and the protocol. The same command finds them again and
computes only what is missing; cells computed on other machines fill the same table, each naming its machine
(and, under `accelerate launch`, its process: {"rank", "of"}).

The key is the one scripts/compare_methods.py used, so the committed cells of docs/comparison.md are read as they
are: context {model, dtype, bos}; perplexity {kind, config, document, length, tokens, protocol}; passkey {kind,
config, length, keys}.
"""

from __future__ import annotations

import math
import os
import time

from ..config import MethodConfig
from ..dispatch import input_device
from ..errors import CtxextError
from ..eval.data import Document, tokens_fingerprint
from ..eval.passkey import plan_trials, run_passkey
from ..eval.perplexity import sliding_window_nll, text_tokens_per_window
from ..memory import PeakMemory
from ..outputs import CellCache
from ..search.loop import InvalidParams
from ..search.objective import checked_method, score_perplexity

ONE_WINDOW = "one window"
PASSKEY_SEED = 0  # the table's keys; the needle objective of the searches uses other keys (seed 1)
BLOCK_SEED = 100  # the keys of a row's further passkey trials (the decide stage): block b is seeded by 100 + b
STOP_AFTER_ENV = "CTXEXT_COMPARE_STOP_AFTER_CELLS"  # tests only: exit (as if killed) after this many new cells


def native_protocol(L: int) -> str:
    return f"{L}/{L // 2}"


def perplexity_key(config: dict | None, document: str, length: int, tokens: str, protocol: str) -> dict:
    return {
        "kind": "perplexity",
        "config": config,
        "document": document,
        "length": length,
        "tokens": tokens,
        "protocol": protocol,
    }


def passkey_key(config: dict | None, length: int, trials, block: int = 0) -> dict:
    """A passkey cell's key; a further block of trials (block >= 1, the decide stage) also names its block."""
    key = {"kind": "passkey", "config": config, "length": length, "keys": [(t.depth, t.key) for t in trials]}
    return {**key, "block": block} if block else key


def block_trials(length: int, depths: list[float], keys_per_depth: int, block: int):
    """The trials of a passkey block: block 0 is the table's cell (seed 0), block b >= 1 the same depths and number
    of keys, seeded by BLOCK_SEED + b (the same keys for every row)."""
    return plan_trials([length], list(depths), keys_per_depth, seed=BLOCK_SEED + block if block else PASSKEY_SEED)


class Cells:
    """Finds or computes cells on one model. `compute=False` (report-only) finds only; a missing cell is None."""

    def __init__(self, folder, context: dict, model_loader, tokenizer, bos_id, machine: str, compute: bool = True):
        self.cache = CellCache(folder, context)
        self.model_loader = model_loader
        self.tokenizer = tokenizer
        self.bos_id = bos_id
        self.machine = machine
        self.compute = compute
        self.computed = 0
        self.stop_after = int(os.environ[STOP_AFTER_ENV]) if os.environ.get(STOP_AFTER_ENV) else None
        self.on_computed = None  # called with (description, record) after each new cell
        self.process = (0, 1)  # (rank, processes) under `accelerate launch`: recorded in the cells it computes

    def _store(self, key: dict, value: dict, description: str) -> dict:
        rank, processes = self.process
        by = {"process": {"rank": rank, "of": processes}} if processes > 1 else {}
        record = self.cache.put(key, {**value, "machine": self.machine, **by})
        self.computed += 1
        if self.on_computed is not None:
            self.on_computed(description, record)
        if self.stop_after is not None and self.computed >= self.stop_after:
            os._exit(3)  # tests: as if killed here, after the cell was written
        return record

    def perplexity(self, label: str, config: dict | None, document, length: int, native_L: int | None = None):
        """One window over the document's first tokens for a window of `length` (a row), or the unpatched model in
        L-token windows with stride L/2 over the same tokens (native_L=L)."""
        ids = document.ids[: text_tokens_per_window(length, self.bos_id)]
        protocol = native_protocol(native_L) if native_L else ONE_WINDOW
        key = perplexity_key(config, document.name, length, tokens_fingerprint([ids]), protocol)
        found = self.cache.get(key)
        if found is not None or not self.compute:
            return found
        model = self.model_loader()
        device = input_device(model)
        began = time.perf_counter()
        with PeakMemory(device) as memory:
            if native_L:
                nll, tokens = sliding_window_nll(model, ids, native_L, native_L // 2, self.bos_id)
            else:
                nll, tokens = score_one_window(model, config, document.name, ids, length, self.bos_id)
        seconds = time.perf_counter() - began
        value = {
            "nll_sum": nll,
            "tokens": tokens,
            "seconds": seconds,
            "peak_memory_bytes": memory.bytes,
            "memory_kind": memory.kind,
        }
        return self._store(key, value, f"{label} @ {length} on {document.name}: {math.exp(nll / tokens):.3f}")

    def passkey(self, label: str, config: dict, length: int, depths: list[float], keys_per_depth: int):
        return self.passkey_block(label, config, length, depths, keys_per_depth, 0)

    def passkey_block(
        self, label: str, config: dict, length: int, depths, keys_per_depth: int, block: int, find_only=False
    ):
        """Block `block` of a row's passkey trials at `length` (0: the table's cell); its records number the trials
        from block * its size, so the blocks of a row together are one run of trials. `find_only`: never compute."""
        trials = block_trials(length, depths, keys_per_depth, block)
        key = passkey_key(config, length, trials, block)
        found = self.cache.get(key)
        if found is not None or not self.compute or find_only:
            return found
        model = self.model_loader()
        began = time.perf_counter()
        method = checked_method(label, MethodConfig.from_mapping(config))
        records = run_passkey(model, self.tokenizer, trials, [method], self.bos_id)
        for record in records:
            record["trial"] += block * len(trials)
        value = {
            "correct": sum(r["correct"] for r in records),
            "trials": len(records),
            "records": records,
            "seconds": time.perf_counter() - began,
        }
        first = block * len(trials) + 1
        which = f" (trials {first}-{first + len(trials) - 1})" if block else ""
        return self._store(key, value, f"passkey {label} @ {length}{which}: {value['correct']}/{value['trials']}")


def score_one_window(model, config: dict, name: str, ids, length: int, bos_id):
    try:
        scored = score_perplexity(model, MethodConfig.from_mapping(config), [Document(name, ids)], length, None, bos_id)
    except InvalidParams as error:
        raise CtxextError(f"{config['method']} cannot run on this model: {error}") from None
    return scored["nll_sum"], scored["tokens"]
