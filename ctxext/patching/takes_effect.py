"""Whether a patch takes effect: the model's forward calls the scaled rotary ctxext installs, and each attention
layer an attention-level method goes on calls transformers' attention interface, where ctxext's function runs.

ctxext replaces the base model's `rotary_emb` and registers its attention function with transformers'
`AttentionInterface`; both work only through the model's own forward code. A library that replaces that code
(Unsloth's fast attention replaces the attention classes' `forward` with its own, which never consults
`ALL_ATTENTION_FUNCTIONS`; a model forward that computes its rotary angles elsewhere) would leave the model
training or generating unpatched while ctxext reports a patch. The check is structural and costs no forward: the
code object that runs (the instance's own `forward` where one was set, else the class's; decorators and
accelerate's hooks looked through by their `__wrapped__`) must name what ctxext replaced. A forward with no Python
code to read (a compiled one) is taken on trust.
"""

from __future__ import annotations

import functools
import inspect
import types
from collections.abc import Callable

from torch import nn

from ..errors import CtxextError

INTERFACE = "ALL_ATTENTION_FUNCTIONS"  # transformers' attention forwards look the implementation up here
ROTARY_NAMES = ("rotary_emb", "rotary_embs")  # the base model's rotary module(s) (Granite SWA: one per base)


def running_forward(module: nn.Module) -> Callable:
    """The function that runs as `module`'s forward: an instance attribute (accelerate's hook: the forward it
    wraps), else the class's, with decorators' and partials' wrappers looked through."""
    forward = module.__dict__.get("_old_forward") or module.__dict__.get("forward") or type(module).forward
    for _ in range(16):  # wrappers of wrappers, boundedly
        if isinstance(forward, functools.partial):
            forward = forward.func
        elif isinstance(forward, types.MethodType):
            forward = forward.__func__
        elif hasattr(forward, "__wrapped__"):
            forward = inspect.unwrap(forward)
        else:
            break
    return forward


def referenced_names(function: Callable) -> set[str] | None:
    """The global and attribute names `function`'s code (and the code nested in it) refers to; None where it has
    no Python code."""
    code = getattr(function, "__code__", None)
    if code is None:
        return None
    names, pending = set(), [code]
    while pending:
        current = pending.pop()
        names.update(current.co_names)
        pending.extend(const for const in current.co_consts if isinstance(const, types.CodeType))
    return names


def _origin(function: Callable) -> str:
    """'forward' of module 'unsloth.models.llama', for a message."""
    return f"{getattr(function, '__qualname__', 'forward')} from module '{getattr(function, '__module__', '?')}'"


def interface_bypass(module: nn.Module | None) -> str | None:
    """Where the running forward of an attention module comes from ('fast_forward from module
    'unsloth.models.llama''), where it never looks up transformers' attention interface; None where it does (or
    cannot be read, or there is no module)."""
    if module is None:
        return None
    forward = running_forward(module)
    names = referenced_names(forward)
    return None if names is None or INTERFACE in names else _origin(forward)


def check_rotary_is_called(host: nn.Module, method: str) -> None:
    """Refuse, in one line, a base model whose running forward never calls its rotary module: the scaled rotary
    ctxext puts there would not change the angles the layers rotate by."""
    forward = running_forward(host)
    names = referenced_names(forward)
    # a rotary module ctxext reaches as rotary_emb under its own name (families._alias: LFM2-MoE's pos_emb)
    aliases = getattr(host.__dict__.get("_modules"), "aliases", {})
    called = (*ROTARY_NAMES, *(aliases[name] for name in ROTARY_NAMES if name in aliases))
    if names is None or any(name in names for name in called):
        return
    raise CtxextError(
        f"{type(host).__name__}'s forward ({_origin(forward)}) never calls its rotary module (rotary_emb), so "
        f"{method} would not take effect; load the model without the library that replaced its forward"
    )
