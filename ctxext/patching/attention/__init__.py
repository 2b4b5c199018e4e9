"""Attention-level methods inside a model, through transformers' AttentionInterface: log-n query scaling, the
query temperature and the position-remapping methods (ReRoPE, Leaky ReRoPE, SelfExtend, DPE, GALI, Dual Chunk
Attention, STRING).

`install_attention(host, settings)` registers a wrapper around the model's attention implementation (eager,
sdpa, flex_attention or FlashAttention) as `wrapper_name(inner)` (e.g. `ctxext_sdpa`, `ctxext_fa2`, with the
inner one's mask function) and switches the model to it with `set_attn_implementation`; the settings sit on
each attention module. What a method cannot run under is refused before anything changes
(`check_can_install`). The model's own attention forward still projects, rotates, caches and calls the
attention function; the wrapper then:

- **log-n**: multiplies each query by max(1, ln n / ln L) and hands over to the model's own implementation;
- **remapping**: while every pair lies in the method's first region (r' = r) it hands over too, bit for bit;
  past that it turns the rotated queries and cached keys back to unrotated ones with the model's own
  (cos, sin) at their positions, rotates them per region, and runs a remapping backend
  (ctxext.patching.remap_kernel) on a region plan that the forward's first layer builds for all layers
  (`ForwardPlan`). The KV cache stays the usual one (rotated keys), so decoding with a cache equals a full
  forward; each of its layers also keeps its keys as the method rotates them (`KeptKeys`), so that a decode
  step rotates only its new keys.

`remove_attention` (in `install`) switches the implementation back. A checkpoint keeps the settings as `ctxext_attention` in
config.json; `register_load_hook` (run at `import ctxext`) re-installs them on any model built from such a
config, so plain `AutoModelForCausalLM.from_pretrained` works after `import ctxext`.

Where things are: `install` (install/remove, the wrapper's registration, config.json and the load hook),
`forward` (`ctxext_attention` and the remapped forward), `regions` (each region's queries and keys, `KeptKeys`),
`layout` (a full forward's padding, packed documents and each key's position within its document, read
from the mask, the position ids and `cu_seq_lens_k`), `positions` (key positions and padding with a KV cache), `rotation` (apply/undo RoPE, (cos, sin) at any
position), `memo` (`ForwardPlan`, `ForwardMemo`) and `state` (`AttentionState`, what a patched layer carries).

Threads: one patched model may run forwards in several threads at once, at different lengths. The settings on
the layers are read-only during a forward, and the `ForwardPlan` that a forward's layers share is kept per
thread (`ForwardMemo`), so no thread sees another's positions, regions or (cos, sin); ctxext's rotary module
keeps its dynamic frequencies the same way (patching/rotary.py). Not covered: changing the patch
(`patch`, `unpatch`, `set_attention_tuning`) while another thread runs the model, and a rotary module of
transformers' own dynamic types, which updates its frequencies in place (a dynamic checkpoint loaded without
ctxext's stateless method): give each thread its own model there.
"""

# The names used outside this package (ctxext.patching.patch, ctxext.eval, ctxext.verification, ctxext.serve,
# ctxext.integrations, the docs, tests and benchmarks). The rest (`ctxext_attention`, `remove_attention`,
# `ForwardPlan`, `AttentionState`, ...) is imported from its module: install, forward, memo, regions, state.
from .install import (
    CONFIG_KEY,
    LAYERS_KEY,
    attention_request,
    check_can_install,
    install_attention,
    installed_layers,
    installed_settings,
    record_attention_in_config,
    register_load_hook,
    set_attention_tuning,
    sync_attention_with_config,
    wrapper_name,
)
from .regions import KeptKeys, kept_keys_bytes
from .rotation import undo_rotation

__all__ = [
    "CONFIG_KEY",
    "LAYERS_KEY",
    "KeptKeys",
    "attention_request",
    "check_can_install",
    "install_attention",
    "installed_layers",
    "installed_settings",
    "kept_keys_bytes",
    "record_attention_in_config",
    "register_load_hook",
    "set_attention_tuning",
    "sync_attention_with_config",
    "undo_rotation",
    "wrapper_name",
]
