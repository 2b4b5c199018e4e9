"""`ctxext serve`: a patched checkpoint behind transformers' own OpenAI-compatible server, ctxext in the process.

transformers 5 ships `transformers serve` (FastAPI + uvicorn: /v1/chat/completions, /v1/completions, streaming).
It loads a checkpoint with plain `from_pretrained`; with ctxext imported first, ctxext's rope types and load hook
are registered, so a checkpoint `ctxext patch` wrote comes up with its method installed, attention-level methods
(self_extend, dual_chunk, gali, rerope, dpe, logn, ...) included. Everything here is checked before the weights
load: the serving packages, the checkpoint, its method record (a model is built on the meta device from the
config, which runs the same hook) and the port.

Continuous batching (transformers' paged cache) swaps the attention implementation for its paged kernels, which
ctxext's attention wrapper does not run under: it is offered for checkpoints whose method only changes the
rotary frequencies, and refused, with the reason, for attention-level methods, which are served one request at a
time.
"""

from __future__ import annotations

import errno
import json
import socket
from dataclasses import dataclass, field
from pathlib import Path

import torch

from . import patching  # noqa: F401  (registers ctxext's rope types and load hook before any model loads)
from .auto_classes import auto_model_class
from .errors import CtxextError
from .extras import require
from .loading import check_model_source, describe_failure, load_config
from .patching.attention import CONFIG_KEY
from .request_checks import ContextLimit, checked_server
from .runtime import resolve_device, resolve_dtype
from .serving.engines import read_served_model, served_length

DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


@dataclass(frozen=True)
class ServePlan:
    """What `ctxext serve` will start: the checkpoint, where, and how."""

    model: str
    host: str
    port: int
    device: str
    dtype: str
    attention_method: str | None  # the attention-level method the checkpoint records, if any
    continuous_batching: bool
    context: ContextLimit  # the most tokens, prompt plus max_tokens, a request may ask for
    refused: dict = field(default_factory=dict)  # {endpoint: why every request to it is refused}

    def describe(self) -> str:
        method = self.attention_method or "rotary frequencies only"
        batching = "continuous batching" if self.continuous_batching else "one request at a time"
        return (
            f"serving {self.model} ({method}; {self.device}, {self.dtype}; {batching}; requests up to "
            f"{self.context.tokens} tokens, {self.context.source}) at http://{self.host}:{self.port}/v1"
        )


def check_serving_packages() -> None:
    """transformers' server needs fastapi, uvicorn, pydantic and openai: say so before anything loads."""
    require("serve", "ctxext serve")


def check_port_free(host: str, port: int) -> None:
    """Fail at once, not after the weights load, when `host:port` cannot be listened on."""
    if not 0 < port < 65536:
        raise CtxextError(f"--port must be between 1 and 65535, got {port}")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((host, port))
        except OSError as error:
            reason = "already in use" if error.errno == errno.EADDRINUSE else error.strerror
            raise CtxextError(f"cannot listen on {host}:{port}: {reason}; choose another --port") from error


def recorded_attention_method(model: str) -> str | None:
    """The attention-level method the checkpoint records, after checking that its whole record builds.

    A model is built from the config on the meta device (no weights, no memory): transformers validates the rope
    parameters and ctxext's load hook installs the recorded attention method, so an unknown rope type or method
    record fails here, as one line, rather than inside the server.
    """
    config = load_config(model)
    try:
        with torch.device("meta"):
            auto_model_class(config).from_config(config)
    except (CtxextError, ValueError, KeyError, TypeError) as error:
        raise CtxextError(f"'{model}' records a method ctxext cannot install: {describe_failure(error)}") from error
    record = getattr(config, CONFIG_KEY, None) or {}
    return record.get("method")


def declared_context(model: str, max_context: int | None = None) -> ContextLimit:
    """The context requests are held to: `max_context` where the operator gives one, else what the checkpoint
    declares (`ctxext.serving.engines.served_length`, the length `ctxext export` starts engines with)."""
    if max_context is not None:
        if isinstance(max_context, bool) or not isinstance(max_context, int) or max_context < 1:
            raise CtxextError(f"--max-context must be a whole number of tokens >= 1, got {max_context!r}")
        return ContextLimit(max_context, "--max-context")
    if (Path(model) / "config.json").is_file():
        tokens = served_length(read_served_model(model))
    else:  # a hub id: its config alone
        tokens = int(getattr(load_config(model), "max_position_embeddings", 0) or 0)
    if tokens < 1:
        raise CtxextError(f"'{model}' declares no context (max_position_embeddings); give --max-context N")
    return ContextLimit(tokens, "the context the checkpoint declares")


def endpoints_without_a_chat_template(model: str) -> dict:
    """{endpoint: reason} for the chat and responses endpoints where a local checkpoint's tokenizer has no chat
    template (transformers' handlers would fail with HTTP 500 there); a hub id is left to its tokenizer."""
    folder = Path(model)
    if not (folder / "config.json").is_file():
        return {}
    tokenizer_config = folder / "tokenizer_config.json"
    settings = json.loads(tokenizer_config.read_text()) if tokenizer_config.is_file() else {}
    if settings.get("chat_template") or any(folder.glob("chat_template.*")):
        return {}
    reason = f"'{model}' has no chat template (tokenizer_config.json, chat_template.jinja): use /v1/completions"
    return {"chat": reason, "responses": reason}


def plan_serve(
    model: str,
    host: str,
    port: int,
    device: str,
    dtype: str,
    continuous_batching: bool = False,
    max_context: int | None = None,
) -> ServePlan:
    """Every check `ctxext serve` makes before loading weights, and the settings it will serve with."""
    check_serving_packages()
    check_model_source(model)
    method = recorded_attention_method(model)
    context = declared_context(model, max_context)
    if continuous_batching and method:
        raise CtxextError(
            f"--continuous-batching runs transformers' paged attention kernels, which do not run ctxext's "
            f"'{method}' attention; serve it without --continuous-batching (one request at a time)"
        )
    check_port_free(host, port)
    chosen = resolve_device(device)
    return ServePlan(
        model=model,
        host=host,
        port=port,
        device=str(chosen),
        dtype=DTYPE_NAMES[resolve_dtype(dtype, chosen)],
        attention_method=method,
        continuous_batching=continuous_batching,
        context=context,
        refused=endpoints_without_a_chat_template(model),
    )


def start_server(plan: ServePlan, blocking: bool = True):
    """transformers' `Serve` with the checkpoint preloaded; `blocking` False returns it running in a thread
    (stop it with `.kill_server()`)."""
    from transformers.cli.serve import Serve  # noqa: PLC0415  (imports fastapi and uvicorn: the serve extra)

    try:
        with checked_server(plan.context, plan.refused):  # each request's fields and length checked before any work
            return Serve(
                force_model=plan.model,
                continuous_batching=plan.continuous_batching,
                device=plan.device,
                dtype=plan.dtype,
                host=plan.host,
                port=plan.port,
                non_blocking=not blocking,
            )
    except (OSError, ValueError, KeyError, RuntimeError) as error:
        raise CtxextError(f"could not serve '{plan.model}': {describe_failure(error)}") from error
