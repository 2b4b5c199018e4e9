"""llama.cpp itself, through llama-cpp-python (the optional extra `ctxext[llamacpp]`), as the judge of a GGUF file:
the negative log-likelihood llama.cpp assigns to a token sequence."""

from __future__ import annotations

import os

from ..errors import CtxextError

INSTALL_HINT = (
    "pip install 'ctxext[llamacpp]' (llama-cpp-python; it builds llama.cpp from source with cmake and a "
    "C++ compiler, about 10 minutes on 2 cores)"
)


def llama_cpp_available() -> bool:
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return False
    return True


def llama_cpp_nll(gguf_path, token_ids: list[int], n_threads: int | None = None) -> tuple[float, int]:
    """(sum of -log p(token t | tokens < t) over t = 1..n-1, n-1) from llama.cpp's logits for one sequence.

    The file's own rope keys decide the positions (nothing is overridden). Memory: n x vocab float32 logits.
    """
    try:
        from llama_cpp import Llama
    except ImportError:
        raise CtxextError(f"llama.cpp is not installed here; {INSTALL_HINT}") from None
    import numpy as np

    n = len(token_ids)
    if n < 2:
        raise CtxextError("llama.cpp scoring needs at least 2 tokens")
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
