"""ctxext: extend the context window of LLaMA, Mistral, Qwen2 and Qwen3 models.

    import ctxext
    ctxext.patch(model, "yarn", factor=4)
    ctxext.unpatch(model)

Importing ctxext registers its rope types with transformers, so checkpoints saved with them load again.
"""

from .errors import CtxextError
from .methods import METHODS
from .patching import applied_method, patch, unpatch

__version__ = "0.1.0"
__all__ = ["METHODS", "CtxextError", "applied_method", "patch", "unpatch", "__version__"]
