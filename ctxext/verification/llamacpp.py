"""llama.cpp itself, through llama-cpp-python (the optional extra `ctxext[llamacpp]`), as the judge of a GGUF file:
the negative log-likelihood llama.cpp assigns to a token sequence.

llama.cpp runs in a child process (`python -m ctxext.verification.llamacpp REQUEST ANSWER`): a build of it has segfaulted
in its first eval on some CPUs (llama-cpp-python 0.3.36 built on a Xeon with AMX), and a crash there must be a
one-line finding in ctxext's table, never the end of ctxext."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from ..errors import CtxextError
from ..extras import EXTRAS

INSTALL_HINT = EXTRAS["llamacpp"].install


class JudgeCrashed(CtxextError):
    """The judge's process died of a signal: what it was scoring has no answer on this machine."""


def llama_cpp_available() -> bool:
    try:
        import llama_cpp  # noqa: F401, PLC0415 (optional: the llamacpp extra)
    except ImportError:
        return False
    return True


def llama_cpp_nll(gguf_path, token_ids: list[int], n_threads: int | None = None) -> tuple[float, int]:
    """(sum of -log p(token t | tokens < t) over t = 1..n-1, n-1) from llama.cpp's logits for one sequence,
    computed in a child process. The file's own rope keys decide the positions (nothing is overridden).

    Raises JudgeCrashed when llama.cpp dies of a signal, CtxextError when it fails otherwise."""
    if len(token_ids) < 2:
        raise CtxextError("llama.cpp scoring needs at least 2 tokens")
    with tempfile.TemporaryDirectory(prefix="ctxext-llamacpp-") as scratch:
        request, answer = Path(scratch) / "request.json", Path(scratch) / "answer.json"
        request.write_text(json.dumps({"gguf": str(gguf_path), "ids": list(token_ids), "threads": n_threads}))
        child = subprocess.run(
            [sys.executable, "-m", "ctxext.verification.llamacpp", str(request), str(answer)],
            capture_output=True,
            text=True,
        )
        if child.returncode < 0:
            raise JudgeCrashed(crash_finding(-child.returncode, Path(gguf_path).name))
        if child.returncode != 0 or not answer.is_file():
            lines = [line for line in child.stderr.splitlines() if line.strip()]
            raise CtxextError(f"llama.cpp failed on {Path(gguf_path).name}: {lines[-1] if lines else child.returncode}")
        result = json.loads(answer.read_text())
    return result["nll"], result["n"]


def crash_finding(signal_number: int, what: str) -> str:
    """The one line a crashed judge leaves in the table."""
    try:
        name = signal.Signals(signal_number).name
    except ValueError:
        name = "unknown signal"
    return (
        f"llama.cpp crashed (signal {signal_number}, {name}) on this machine while scoring {what}; no verdict. "
        "A llama-cpp-python build for this CPU (e.g. CMAKE_ARGS='-DGGML_NATIVE=OFF') or llama.cpp's own "
        "llama-perplexity can judge the file instead"
    )


def _nll_in_this_process(gguf_path, token_ids: list[int], n_threads: int | None) -> tuple[float, int]:
    """The scoring itself (the child's work). Memory: n x vocab float32 logits."""
    try:
        from llama_cpp import Llama  # noqa: PLC0415 (optional: the llamacpp extra)
    except ImportError:
        raise CtxextError(f"llama.cpp is not installed here; {INSTALL_HINT}") from None
    n = len(token_ids)
    llm = Llama(
        model_path=str(gguf_path),
        n_ctx=n,
        n_batch=min(n, 512),
        logits_all=True,
        n_threads=n_threads or os.cpu_count(),
        verbose=False,
    )
    try:
        llm.eval(list(token_ids))
        total = 0.0
        for start in range(0, n - 1, 1024):  # log-softmax in slices: n x vocab float64 at once is too much
            rows = np.asarray(llm.scores[start : min(start + 1024, n - 1)], dtype=np.float64)
            targets = np.asarray(token_ids[start + 1 : start + 1 + len(rows)])
            log_norm = np.logaddexp.reduce(rows, axis=1)
            total += float(np.sum(log_norm - rows[np.arange(len(rows)), targets]))
    finally:
        llm.close()
    return total, n - 1


def main(argv: list[str]) -> int:
    request_path, answer_path = argv
    request = json.loads(Path(request_path).read_text())
    try:
        nll, n = _nll_in_this_process(request["gguf"], request["ids"], request["threads"])
    except CtxextError as error:
        print(error, file=sys.stderr)
        return 2
    Path(answer_path).write_text(json.dumps({"nll": nll, "n": n}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
