"""Serving what ctxext patches: native rope forms for transformers/vLLM/SGLang (forms.py), GGUF files for llama.cpp
(gguf.py), and what each engine makes of a checkpoint, an ordered table of rules read from the engines' source at
pinned versions (engines.py, lengths.py). Running the engines' own code on it is ctxext.verification's."""

__all__: list[str] = []  # nothing at the package level: its modules are the surface
