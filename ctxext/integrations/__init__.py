"""ctxext with other libraries' trainers and loaders: PEFT adapters that carry the patch their base was trained
under (`adapters`, wrapped into PEFT's and transformers' save and load by `hooks` at `import ctxext`), and the
directory TRL's GRPO hands vLLM (`trl`: `from ctxext.integrations import vllm_model_dir`)."""

from __future__ import annotations

import importlib

# name -> the module that defines it, imported on first use: `import ctxext.integrations` (the adapter hooks)
# stays as light as its modules
_EXPORTS = {
    "VllmModelDir": "trl",
    "vllm_model_dir": "trl",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
