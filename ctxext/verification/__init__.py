"""Checking what ctxext writes and runs against independent code: `ctxext check` (each attention-level method
against the naive reference, and its cost: check.py), and harnesses that run other engines' own code on the
checkpoints ctxext writes (vLLM's and SGLang's rotary modules in child processes: engine_rope.py; llama.cpp's
perplexity: llamacpp.py; both driven by `ctxext export --check`: parity.py). Nothing here writes a checkpoint:
that is ctxext.serving (forms, GGUF) and ctxext.checkpoint."""

__all__: list[str] = []  # nothing at the package level: its modules are the surface
