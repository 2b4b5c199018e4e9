"""Serving what ctxext patches: native rope forms for transformers/vLLM/SGLang, GGUF files for llama.cpp, and
the engine table of `ctxext export --check`."""
