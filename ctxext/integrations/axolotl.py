"""axolotl's plugin for ctxext: `plugins: [ctxext.integrations.axolotl.CtxextPlugin]` and a `ctxext:` block in
the training YAML (configs/integrations/axolotl-yarn.yaml).

    ctxext:
      method: yarn          # any ctxext method (`ctxext methods`)
      factor: 4             # or target_length: 32768; neither: target_length = sequence_len
      params: {}            # the method's parameters (beta_fast, group_size, ...)
      # logn, layer_types, query_temperature, replace_shipped, original_max_position_embeddings, allow_shorter:
      # the keywords of ctxext.patch

axolotl 0.19 (read: axolotl/integrations/base.py, loaders/model.py, train.py) calls `register(cfg)` on the raw
config, before validation: the block is checked there, in one line, before any weight loads. Its validator
rejects attn_implementation names it does not know (`ctxext_sdpa`), so the attention is not named in the YAML:
`post_model_build` (after the model is built, before LoRA goes on) calls `ctxext.patch`, which switches the
attention of attention-level methods itself. The adapter axolotl saves carries the patch: after `import ctxext`
(this module imports it) PEFT's save writes ctxext.yaml beside adapter_config.json, in every checkpoint and the
output directory (ctxext.integrations.adapters); `post_train` writes it to the output directory where no save
did. axolotl's own `model_config: {rope_scaling: ...}` assigns config.rope_scaling, which transformers 5 turns
into rope parameters without rope_theta; with a `ctxext:` block that is refused here (two scalings), and alone
it meets ctxext's one-line error on the missing base (ctxext.patching.families.missing_base).

axolotl is not a dependency of ctxext (0.19 pins transformers 5.16.1): without it, this module still imports
(the plugin then derives from `object`), so that its checks are tested in ctxext's own environment.
"""

from __future__ import annotations

import logging
from pathlib import Path

from ..errors import CtxextError, did_you_mean
from ..methods import METHODS, get_method
from ..patching import patch, rotary_host
from ..record_file import RECORD_FILE
from .adapters import write_adapter_record

try:  # axolotl's plugin base and pydantic (axolotl's dependency), where axolotl is installed
    from axolotl.integrations.base import BasePlugin
    from pydantic import BaseModel
except ImportError:  # ctxext's own environment: the checks stay importable
    BasePlugin = BaseModel = object

LOG = logging.getLogger("axolotl.integrations.ctxext")  # under axolotl's logger, whose handlers print its lines
BLOCK = "ctxext"  # the YAML key
# The keywords of ctxext.patch a block may give beside method, factor and params.
PATCH_KEYWORDS = (
    "target_length",
    "logn",
    "layer_types",
    "query_temperature",
    "replace_shipped",
    "original_max_position_embeddings",
    "allow_shorter",
)
KEYS = ("method", "factor", "params", *PATCH_KEYWORDS)


class CtxextArgs(BaseModel):
    """The `ctxext:` block in axolotl's config schema (axolotl merges each plugin's input args into it); its
    contents are checked by `patch_call`, which gives one-line errors."""

    ctxext: dict | None = None


def patch_call(cfg) -> dict | None:
    """The `ctxext.patch` keywords the config's `ctxext:` block asks for (None without a block), checked: a
    known method, known keys, the method's parameters; a one-line CtxextError otherwise."""
    block = cfg.get(BLOCK)
    if block is None:
        return None
    if not isinstance(block, dict) or not block.get("method"):
        raise CtxextError(f"axolotl config: '{BLOCK}:' needs a mapping with a method, e.g. {{method: yarn, factor: 4}}")
    for key in block:
        if key not in KEYS:
            raise CtxextError(
                f"axolotl config: '{BLOCK}.{key}' is not a ctxext setting{did_you_mean(key, KEYS)}; "
                f"the settings are: {', '.join(KEYS)}"
            )
    method, params = str(block["method"]), block.get("params") or {}
    if method not in METHODS:
        raise CtxextError(f"axolotl config: unknown ctxext method '{method}'{did_you_mean(method, METHODS)}")
    if not isinstance(params, dict):
        raise CtxextError(f"axolotl config: '{BLOCK}.params' must be a mapping of {method}'s parameters")
    call = {key: block[key] for key in PATCH_KEYWORDS if block.get(key) is not None}
    if block.get("factor") is not None:
        call["factor"] = float(block["factor"])
    elif "target_length" not in call and cfg.get("sequence_len"):
        call["target_length"] = int(cfg["sequence_len"])  # neither given: the length axolotl trains at
    try:
        get_method(method).make_params(factor=call.get("factor", 1.0), **params)  # a bad parameter fails here
    except CtxextError as error:
        raise CtxextError(f"axolotl config: {BLOCK}.params: {error}") from None
    return {"method": method, **call, **params}


def check_one_scaling(cfg) -> None:
    """A `ctxext:` block beside axolotl's own `model_config.rope_scaling` is two scalings of one rotary."""
    overrides = cfg.get("overrides_of_model_config") or cfg.get("model_config") or {}
    if cfg.get(BLOCK) is not None and isinstance(overrides, dict) and overrides.get("rope_scaling") is not None:
        raise CtxextError(
            "axolotl config: model_config.rope_scaling and a 'ctxext:' block both scale the rotary; keep one "
            "(ctxext's method counts from the rope the model ships, so drop model_config.rope_scaling)"
        )


class CtxextPlugin(BasePlugin):
    """Applies the config's `ctxext:` block to the model axolotl builds, before LoRA, and records the patch with
    the adapter (ctxext.yaml)."""

    def get_input_args(self) -> str:
        return f"{__name__}.CtxextArgs"

    def register(self, cfg) -> None:
        """On the raw config, before validation and before any weight loads: the block's one-line errors."""
        check_one_scaling(cfg)
        patch_call(cfg)

    def post_model_build(self, cfg, model) -> None:
        """`ctxext.patch` with the block's call, on the model axolotl built (before LoRA goes on)."""
        call = patch_call(cfg)
        if call is None:
            return
        patch(model, **call)
        config = rotary_host(model).config
        LOG.info("ctxext: %s applied; the model's context is now %s", call["method"], config.max_position_embeddings)
        length = cfg.get("sequence_len")
        if length and int(length) > int(config.max_position_embeddings):
            LOG.warning(
                "ctxext: sequence_len %s is longer than the patched context %s", length, config.max_position_embeddings
            )

    def post_train(self, cfg, model) -> None:
        """ctxext.yaml in the output directory, where an adapter is saved there and no save wrote it."""
        output = cfg.get("output_dir")
        if patch_call(cfg) is None or not output or not (Path(output) / "adapter_config.json").is_file():
            return
        if not (Path(output) / RECORD_FILE).is_file():
            write_adapter_record(model, output)
