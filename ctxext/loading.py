"""Loading models and tokenizers, with the device, dtype and attention implementation picked automatically."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from .errors import CtxextError, first_line


def cpu_has_native_bf16() -> bool:
    """True where the CPU has bf16 matrix instructions (AMX or AVX512-BF16), so bf16 is faster than fp32."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "amx_bf16" in flags or "avx512_bf16" in flags


def resolve_device(device: str = "auto") -> torch.device:
    if device == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    try:
        return torch.device(device)
    except RuntimeError:
        raise CtxextError(f"unknown device '{device}'; use auto, cpu, cuda, cuda:N or mps") from None


DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """'auto': bf16 on a GPU that supports it or a CPU with native bf16, else fp32."""
    if dtype == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        if device.type == "cpu" and cpu_has_native_bf16():
            return torch.bfloat16
        return torch.float32
    if dtype not in DTYPES:
        raise CtxextError(f"unknown dtype '{dtype}'; use auto, {', '.join(DTYPES)}")
    return DTYPES[dtype]


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


def load_model(name_or_path: str, dtype: torch.dtype | str = "auto", device: torch.device | str = "cpu",
               attn_implementation: str | None = None):
    """A causal LM from a local directory or a hub id, as a clear CtxextError when it cannot be loaded."""
    from transformers import AutoModelForCausalLM

    check_model_source(name_or_path)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            name_or_path, dtype=dtype, attn_implementation=attn_implementation
        )
    except (OSError, ValueError, KeyError) as error:
        raise CtxextError(f"could not load model '{name_or_path}': {first_line(error)}") from None
    return model.to(device).eval()


def load_tokenizer(name_or_path: str):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(name_or_path)
    except (OSError, ValueError, KeyError) as error:
        raise CtxextError(f"could not load a tokenizer for '{name_or_path}': {first_line(error)}") from None
