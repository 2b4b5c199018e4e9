"""Loading models and tokenizers as clear one-line errors (ctxext.runtime picks device, dtype and attention)."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from .errors import CtxextError, first_line


def check_model_source(name_or_path: str) -> None:
    """Fail early, with a clear message, for a local path that does not exist."""
    path = Path(name_or_path).expanduser()
    if path.exists():
        if not (path / "config.json").is_file():
            raise CtxextError(f"'{name_or_path}' is not a model directory (it has no config.json)")
        return
    looks_local = name_or_path.startswith((".", "/", "~")) or name_or_path.count("/") > 1
    if looks_local:
        raise CtxextError(f"model path '{name_or_path}' does not exist")
    if os.environ.get("HF_HUB_OFFLINE") == "1":
        raise CtxextError(f"model '{name_or_path}' is not a local directory, and HF_HUB_OFFLINE=1 rules out the hub")


def load_config(name_or_path: str):
    """The model's config alone (cheap): lets commands reject unsupported models before loading weights."""
    from transformers import AutoConfig

    check_model_source(name_or_path)
    try:
        return AutoConfig.from_pretrained(name_or_path)
    except (OSError, ValueError, KeyError) as error:
        raise CtxextError(f"could not load the config of '{name_or_path}': {first_line(error)}") from None


def load_model(
    name_or_path: str,
    dtype: torch.dtype | str = "auto",
    device: torch.device | str = "cpu",
    attn_implementation: str | None = None,
):
    """A causal LM from a local directory or a hub id, as a clear CtxextError when it cannot be loaded."""
    from transformers import AutoModelForCausalLM

    check_model_source(name_or_path)
    try:
        model = AutoModelForCausalLM.from_pretrained(name_or_path, dtype=dtype, attn_implementation=attn_implementation)
    except (OSError, ValueError, KeyError) as error:
        raise CtxextError(f"could not load model '{name_or_path}': {first_line(error)}") from None
    return model.to(device).eval()


def load_tokenizer(name_or_path: str):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(name_or_path)
    except (OSError, ValueError, KeyError) as error:
        raise CtxextError(f"could not load a tokenizer for '{name_or_path}': {first_line(error)}") from None
