"""ctxext: extend the context window of Hugging Face RoPE models (LLaMA, Mistral, Qwen, Gemma, Phi and the others).

    import ctxext
    ctxext.patch(model, "yarn", factor=4)
    ctxext.save_pretrained(model, "out/")  # the native form engines load, as `ctxext patch` writes it
    ctxext.unpatch(model)

Importing ctxext is cheap (no torch, no transformers); `patch`, `unpatch`, `save_pretrained`, `applied_method`, `METHODS`,
`rope_record` (a config's rope: `RopeRecord`) load the library on first use. After `import ctxext`, ctxext's rope types and load hook are registered with
transformers as soon as transformers is imported (see registration.py), so checkpoints saved with them load
with plain `from_pretrained`.
"""

import importlib

from .errors import CtxextError

__version__ = "0.1.0"
__all__ = [
    "METHODS",
    "CtxextError",
    "RopeRecord",
    "applied_method",
    "patch",
    "rope_record",
    "save_pretrained",
    "unpatch",
    "__version__",
]

# name -> the module that defines it, imported on first access
_LAZY = {
    "METHODS": "ctxext.methods",
    "RopeRecord": "ctxext.patching.record",  # a model's rope as its config ships it: L0, C, each layer type's base
    "rope_record": "ctxext.patching.record",
    "applied_method": "ctxext.patching",
    "patch": "ctxext.patching",
    "save_pretrained": "ctxext.checkpoint",
    "unpatch": "ctxext.patching",
}


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'ctxext' has no attribute '{name}'")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY))


from . import registration  # noqa: E402  (last: it may import ctxext.patching, which needs the names above)

registration.install()
