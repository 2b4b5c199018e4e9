"""Every private API that ctxext uses (of torch, transformers, accelerate, lm-eval and the standard library).

Each entry says where it is used, what for, why no public API does the job and what breaks if it goes. Most are
wrapped here; the ones used in place are named with their file. tests/test_compat.py checks every entry against
the installed versions (checked on torch 2.13, transformers 5.24, accelerate 1.15, lm-eval 0.4.13,
huggingface_hub 2.4, Python 3.10-3.13), so an upgrade that drops or changes one fails a test instead of a run.
Everything not listed here is a public API. No longer used: `tensor._version` (the remapping's per-forward plan
is told apart by the identity of each forward's position ids and mask, and keyed by the frequencies'
data_ptr), and nothing reads `config._commit_hash` here any more (see `hub_commit`).

This module imports nothing heavy at import time: registration.py, which `import ctxext` runs, uses it.

Differences between the transformers versions CI tests (5.16.1, 5.19.0, 5.20.2 and the newest, 5.24;
`make test-versions`, docs/guides/transformers-versions.md), besides `cache_keyword` below:

- longrope's and the dynamic types' inv_freq (transformers < 5.23): `dynamic_rope_update` swaps the buffer for
  another tensor (register_buffer) where 5.23 and later copy into it, so a reference to `inv_freq` taken before a
  call is stale after it. ctxext/patching/families.py `_probe_rotary` reads the buffer after its probe call (a
  Phi-3 longrope model that had run past its original length was refused before).
- MRoPE (transformers < 5.17): Qwen2-VL's, Qwen2.5-VL's and GLM-4V's rotary modules return one (cos, sin) per
  position section, merged in the attention. ctxext reads the merged form and refuses the older one in one line
  (tests/test_vision_language.py skips there).
- A config.json's top-level `partial_rotary_factor` (transformers < 5.20): it stays on the loaded config as an
  attribute, save_pretrained writes it back, and the next load folds it into the rope parameters; a proportional
  checkpoint patched again with yarn then reloads with the proportion as a partial rotary factor. Not fixed here
  (the attribute is also the family's own in Phi, Persimmon and StableLM there).
- `config.rope_scaling = {...}` (transformers < 5.21): the setter leaves `{'type': ..., 'factor': ...}` without
  rope_type, rope_theta or a warning, and a config.json saved so loads with the class's default base: ctxext
  refuses the in-memory config (no rope_theta), but cannot tell a reloaded one from a config with that base.
- Doge (transformers < 5.18) adds its dynamic mask to no causal mask under sdpa: its own forward is not causal,
  and position remapping refuses the mask.

Used in place (not wrapped, because their code is the CLI's or the harness's own):

- `argparse.ArgumentParser._actions` (Python 3.x), ctxext/cli/common.py `split_method_params`: the parser's
  option strings, to tell a method parameter flag (`--beta-fast 32`) from an option or an abbreviation of one.
  argparse has no public list of a parser's options. If it went, every command that takes method parameters
  would fail with an AttributeError at parse time. ctxext/cli/aliases.py `add_alias` finds the option an old
  spelling stands for in the same list (an AttributeError when a command's parser is built, if it went).
- `argparse.HelpFormatter._fill_text` (Python 3.x; argparse documents only the formatter classes' names as
  public), ctxext/cli/common.py `HelpFormatter`: keep examples and numbered parts of --help as written while
  prose is wrapped. If it were renamed, --help would wrap the examples into one paragraph (no error).
- `lm_eval.tasks._factory.TaskFactory` and `TaskManager._factory` (lm-eval 0.4.13), ctxext/tasks/harness.py
  `_with_metadata`: a TaskManager with other task metadata (max_seq_lengths) without indexing every task YAML
  again, which takes seconds per cell. If either went, `_with_metadata` returns None and a fresh
  `TaskManager(metadata=...)` is built: the same results, slower.
- `HFLM._rank` / `HFLM._world_size` (lm-eval 0.4.13), ctxext/tasks/harness.py `harness_model`: HFLM sets up
  data parallelism only for a model it loads itself, and ctxext hands it a patched one; its public `rank` and
  `world_size` properties read these. If they stopped reading them, each of N processes would answer every
  request instead of every N-th: N times the work (and the wrong share of requests per process).
- `config._commit_hash` (transformers 4.x; transformers 5.24 no longer sets it and drops it from loaded
  configs), read only by `hub_commit` below, which ctxext/eval/session.py `model_files_key` calls (tasks and eval) for
  the commit of a hub model in a result's provenance; on 5.24 it falls back to the hub cache's ref.
"""

from __future__ import annotations

import contextlib
import inspect
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from .errors import CtxextError

if TYPE_CHECKING:
    import torch


# ---------------------------------------------------------------------------------------------- torch
# torch.ops.aten._scaled_dot_product_flash_attention_for_cpu (private op, torch >= 2.2; checked on 2.13), in
# ctxext/patching/remap_kernel.py: the fused CPU attention that also returns the log-sum-exp, which the remapping
# kernel merges regions with. Public scaled_dot_product_attention does not return it. Without the op, `pick_backend`
# takes "blockwise" on the CPU, whose blocks then score with plain float32 matmuls (the log-sum-exp computed).
def cpu_attention_with_lse_available() -> bool:
    import torch  # noqa: PLC0415 (out of `import ctxext` and --help, which import compat)

    return hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu")


def cpu_attention_with_lse(query, key, value, bias, scale):
    """(output, log-sum-exp) of softmax attention on CPU; bias is additive (or None)."""
    import torch  # noqa: PLC0415 (out of `import ctxext` and --help, which import compat)

    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        query, key, value, 0.0, False, attn_mask=bias, scale=scale
    )
    return out, lse


# --------------------------------------------------------------------------------------- transformers
# config._attn_implementation (private attribute, transformers 5.x), in ctxext/patching/attention.py: the
# attention implementation a model runs. The public setter is PreTrainedModel.set_attn_implementation, which
# ctxext uses to switch to its own registered implementation; reading the current name has no public getter.
# If it went, patching any attention method (log-n, the remapping methods) would fail with an AttributeError.
def attention_implementation(config) -> str | None:
    return config._attn_implementation


def family_eager_attention(module: torch.nn.Module):
    """The model family's module-level `eager_attention_forward` (transformers 5.x modeling files).

    transformers' AttentionInterface has no "eager" entry: each model file passes its own eager function as
    the default. ctxext's attention wrapper needs the same default to hand "eager" models back to it. If a
    modeling file renamed it, an attention method on an eager model would fail at its first forward.
    """
    return sys.modules[type(module).__module__].eager_attention_forward


class _ConfigWithImplementation:
    def __init__(self, config, implementation: str):
        self._config = config
        self._attn_implementation = implementation

    def __getattr__(self, name):
        return getattr(self._config, name)


class _ModuleWithImplementation:
    def __init__(self, module: torch.nn.Module, implementation: str):
        self._module = module
        self.config = _ConfigWithImplementation(module.config, implementation)

    def __getattr__(self, name):
        return getattr(self._module, name)


# transformers' flash_attention_forward (integrations/flash_attention.py, transformers 5.x) picks the kernel to
# import from `module.config._attn_implementation`. Under ctxext's wrapper that names the wrapper, so the
# wrapper hands FlashAttention a view of the module whose config names the wrapped implementation; every
# other attribute is the module's own. No public argument selects the kernel. If transformers read the name
# elsewhere, log-n or a remapping method on a FlashAttention model would fail at its first forward
# (tests/test_flash_inner.py runs that path).
def module_with_attention_implementation(module: torch.nn.Module, implementation: str):
    return _ModuleWithImplementation(module, implementation)


# PretrainedConfig's `_validate_<rope_type>_rope_parameters` hooks (private, transformers 5.x), in
# ctxext/patching/rope_types.py: transformers validates rope_parameters by calling a method named after the rope
# type; ctxext's own types need one. There is no public registry for rope-parameter validators. If the naming
# changed, configs with ctxext's rope types would load with a warning and without their parameters checked.
def add_rope_validator(rope_type: str, validator) -> None:
    from transformers.modeling_rope_utils import RotaryEmbeddingConfigMixin  # noqa: PLC0415 (out of `import ctxext` and --help, which import compat)

    setattr(RotaryEmbeddingConfigMixin, f"_validate_{rope_type}_rope_parameters", validator)


def hub_commit(name_or_path: str, config=None, cache_dir: str | Path | None = None) -> str | None:
    """The commit of hub model `name_or_path` that a load used, for a result's provenance (None if unknown).

    transformers 4.x recorded it as the private `config._commit_hash`; 5.24 resolves the revision once per
    load and keeps it nowhere. Where the config has none, the commit is read from the hub cache with
    huggingface_hub's public `try_to_load_from_cache`: the snapshot that the cache's `main` ref points to,
    which is what the load read (an online load updates the ref before it reads the files).
    """
    commit = getattr(config, "_commit_hash", None)
    if commit:
        return commit
    from huggingface_hub import try_to_load_from_cache  # noqa: PLC0415 (out of `import ctxext` and --help, which import compat)

    try:
        cached = try_to_load_from_cache(str(name_or_path), "config.json", cache_dir=cache_dir)
    except ValueError:  # not a repo id (a local path, say)
        return None
    return Path(cached).parent.name if isinstance(cached, str) else None  # .../snapshots/<commit>/config.json


# The keyword a model's forward takes its KV cache by (a version difference, not a private API): `cache` from
# transformers 5.24 (which still takes `past_key_values`, with a deprecation warning, until 5.40), `past_key_values`
# in 5.0-5.23 (checked on 5.16.1, 5.19.0 and 5.20.2), where `cache=` falls into the forward's **kwargs unread and the
# forward runs without the cache: each decode step then sees only its own token (no error). ctxext/verification/
# check.py `decoded_logits` and the tests pass a cache through `cache_kwargs`; ctxext's attention wrapper reads
# either name (ctxext/patching/attention/install.py).
def cache_keyword(model) -> str:
    """`cache` or `past_key_values`: the keyword `model`'s forward takes its KV cache by."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def cache_kwargs(model, cache) -> dict:
    """`{keyword: cache}` for `model(..., **cache_kwargs(model, cache))`, on every transformers 5.x."""
    return {cache_keyword(model): cache}


# transformers.cli.serving.server.build_server (transformers 5.24; the server module is new in 5.x and not a
# documented API), in ctxext/request_checks.py `checked_server`: `Serve.__init__` builds the FastAPI app through it
# and starts uvicorn in the same call, so it is the one moment ctxext can reach the handlers
# (`handle_request(body, request_id)` of the chat, completion and response handlers) and the `GenerationState`
# (`get_manager`, whose managers' `generate_streaming` / `generate_non_streaming` receive the handler's tokenized
# `inputs` and the request's GenerationConfig). ctxext wraps those instance methods while the app is built. If the
# names or signatures changed, `serving_build_server` raises a CtxextError naming them before the server starts
# (tests/test_compat.py checks each name), instead of serving unchecked requests.
SERVING_HANDLERS = {"chat": "chat_handler", "completions": "completion_handler", "responses": "response_handler"}


@contextlib.contextmanager
def serving_build_server(prepare):
    """While active, transformers' `build_server` first calls `prepare({endpoint: handler}, generation_state)`."""
    from transformers.cli.serving import server  # noqa: PLC0415 (the serve extra: fastapi, uvicorn)

    original = server.build_server
    signature = inspect.signature(original)
    missing = [name for name in (*SERVING_HANDLERS.values(), "generation_state") if name not in signature.parameters]
    if missing:
        raise CtxextError(
            f"this transformers' server builds its app without {', '.join(missing)}: ctxext serve cannot check "
            "requests there; install a transformers version ctxext is tested with (5.24)"
        )

    def build_server(*args, **kwargs):
        bound = signature.bind(*args, **kwargs).arguments
        prepare({endpoint: bound[name] for endpoint, name in SERVING_HANDLERS.items()}, bound["generation_state"])
        return original(*args, **kwargs)

    server.build_server = build_server
    try:
        yield
    finally:
        server.build_server = original


# ----------------------------------------------------------------------------------------- accelerate
# AcceleratorState._reset_state / GradientState._reset_state (private, accelerate 1.x), in ctxext/runtime.py:
# forget the process state so that a second Accelerator in the same process (tests, the tiny-model pretraining
# before a fine-tune) starts clean. accelerate has no public reset. If they went, a second Accelerator in one
# process would fail with an AttributeError (or inherit the first one's settings).
def reset_accelerate_state() -> None:
    from accelerate.state import AcceleratorState, GradientState  # noqa: PLC0415 (out of `import ctxext` and --help, which import compat)

    AcceleratorState._reset_state()
    GradientState._reset_state()


# -------------------------------------------------------------------------------------------- importlib
# ModuleSpec._initializing (private, CPython 3.4+), in ctxext/registration.py: importlib sets it on a module's
# spec while the module's code runs, and it is how importlib itself tells a partly initialised module. ctxext
# waits until no transformers module is half-imported before it registers its rope types (importing
# ctxext.patching in the middle of transformers' own imports would find names not yet defined). There is no
# public test. If it went, this returns False always and the wait is lost: `import ctxext` before transformers
# could then fail with an ImportError of a transformers name, depending on the import order.
def module_is_initializing(module) -> bool:
    return bool(getattr(getattr(module, "__spec__", None), "_initializing", False))
