"""Loading models and tokenizers as clear one-line errors (ctxext.runtime picks device, dtype and attention;
ctxext.dispatch places a model over several devices, CPU and disk).

A load that fails is one line that names what could not be loaded and why: the error's type and first line, and
the innermost error it wraps (a JSON syntax error behind transformers' "not a valid JSON file", say), each
shortened; the original error stays chained (`raise ... from`), for a traceback where one is wanted.
"""

from __future__ import annotations

import os
import textwrap
import weakref
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError
from transformers import AutoConfig, AutoTokenizer, DistributedConfig
from transformers.utils import logging as transformers_logging

from .auto_classes import auto_model_class
from .dispatch import Placement, check_placement, check_tensor_parallel_model, offload_folder, remove_folder
from .errors import CtxextError, first_line
from .patching.families import MissingBaseError, config_missing_base, missing_base_error

CAUSE_CHARS = 200  # each error's part of a one-line load error is shortened to this


def _error_chain(error: BaseException) -> Iterator[BaseException]:
    """`error`, the error it was raised from or while handling, that one's, and so on (each once)."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        yield error
        error = error.__cause__ or (None if error.__suppress_context__ else error.__context__)


def _one_error(error: BaseException) -> str:
    text = f"{type(error).__name__}: {first_line(error)}" if str(error).strip() else type(error).__name__
    return textwrap.shorten(text, CAUSE_CHARS, placeholder=" ...")


def describe_failure(error: BaseException) -> str:
    """One line for a failed load: 'Type: message' of `error`, and of the innermost error it wraps."""
    innermost = list(_error_chain(error))[-1]
    if innermost is error:
        return _one_error(error)
    return f"{_one_error(error)} (caused by {_one_error(innermost)})"


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
    check_model_source(name_or_path)
    try:
        config = AutoConfig.from_pretrained(name_or_path)
    except Exception as error:  # noqa: BLE001 - whatever the config class raises (its strict validators: a field of
        # the wrong type, an architecture it refuses) is a config ctxext cannot read, said in one line
        raise CtxextError(f"could not load the config of '{name_or_path}': {describe_failure(error)}") from error
    where = config_missing_base(config)
    if where is not None:  # written by a trainer's config.rope_scaling = {...}: say so, not `NoneType ** Tensor`
        raise missing_base_error(where, f"'{name_or_path}'", in_file="config.json")
    return config


def load_model(
    name_or_path: str,
    dtype: torch.dtype | str = "auto",
    device: torch.device | str = "cpu",
    attn_implementation: str | None = None,
    progress: bool = True,
    placement: Placement | None = None,
    tp: int = 1,
):
    """A causal LM from a local directory or a hub id, as a clear CtxextError when it cannot be loaded.
    `progress` False: without transformers' own bars (loading weights, downloads), as --no-progress promises.
    `placement` (ctxext.dispatch): accelerate places the model over devices, CPU and disk by its map, checked
    against the model's config before any weight loads; the model is then not moved to `device`. `tp` > 1 (under a
    launcher with that many processes): transformers' tensor parallelism (`DistributedConfig(tp_plan="auto")`), this
    process's shard of every layer on its own device."""
    check_model_source(name_or_path)
    if placement is not None:
        check_placement(placement, load_config(name_or_path))
    if tp > 1:
        check_tensor_parallel_model(tp, load_config(name_or_path))
    bars_were_on = transformers_logging.is_progress_bar_enabled()
    if not progress:
        transformers_logging.disable_progress_bar()
    try:
        model = _from_pretrained(name_or_path, dtype, attn_implementation, placement, tp)
    except MissingBaseError:  # load_config's one line on a dropped rope_theta, not wrapped in another
        raise
    except (OSError, ValueError, KeyError, RuntimeError, TypeError, SafetensorError) as error:
        # RuntimeError: weights whose shapes differ from the config's; SafetensorError: a damaged weights file;
        # TypeError: a rotary without its base (`NoneType ** Tensor`), which load_config names
        if isinstance(error, TypeError):
            load_config(name_or_path)
        raise CtxextError(f"could not load model '{name_or_path}': {describe_failure(error)}") from error
    finally:
        if bars_were_on and not progress:
            transformers_logging.enable_progress_bar()
    return model.eval() if placement is not None or tp > 1 else model.to(device).eval()


def _from_pretrained(
    name_or_path: str, dtype, attn_implementation: str | None, placement: Placement | None, tp: int = 1
):
    """transformers' load; with a placement, accelerate's dispatch, and an offload folder that goes with the model;
    with `tp` > 1, transformers' tensor parallelism."""
    model_class = auto_model_class(AutoConfig.from_pretrained(name_or_path))  # its errors are the load's
    if tp > 1:
        return model_class.from_pretrained(
            name_or_path,
            dtype=dtype,
            attn_implementation=attn_implementation,
            distributed_config=DistributedConfig(tp_plan="auto", tp_size=tp),
        )
    if placement is None:
        return model_class.from_pretrained(name_or_path, dtype=dtype, attn_implementation=attn_implementation)
    folder = offload_folder()
    try:
        model = model_class.from_pretrained(
            name_or_path, dtype=dtype, attn_implementation=attn_implementation, **placement.loading_arguments(folder)
        )
    except BaseException:
        remove_folder(folder)
        raise
    weakref.finalize(model, remove_folder, folder)
    return model


# Files any of which means a checkpoint directory has a tokenizer (fast, sentencepiece, BPE, WordPiece, tiktoken,
# mistral-common): one that is there but fails to load is an error, never taken for an absent tokenizer.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "spiece.model",
    "sentencepiece.bpe.model",
    "vocab.json",
    "merges.txt",
    "vocab.txt",
    "tekken.json",
    "special_tokens_map.json",
    "added_tokens.json",
)


def has_tokenizer_files(path: str | Path) -> bool:
    """Whether the local directory `path` holds any tokenizer file (TOKENIZER_FILES, or a *.tiktoken)."""
    path = Path(path).expanduser()
    return any((path / name).is_file() for name in TOKENIZER_FILES) or any(path.glob("*.tiktoken"))


def load_tokenizer(name_or_path: str, optional: bool = False):
    """The tokenizer of a local directory or a hub id, as a clear CtxextError when it cannot be loaded.
    `optional` (what `ctxext patch` asks, which only copies it): None for a local directory with no tokenizer
    files at all (a training checkpoint: weights and config.json); a tokenizer that is there but broken, or a
    hub id's, still fails as one line. Commands that turn text into tokens (eval, passkey) leave it False."""
    path = Path(name_or_path).expanduser()
    if optional and path.is_dir() and not has_tokenizer_files(path):
        return None
    try:
        return AutoTokenizer.from_pretrained(name_or_path)
    except (OSError, ValueError, KeyError) as error:
        raise CtxextError(f"could not load a tokenizer for '{name_or_path}': {describe_failure(error)}") from error
