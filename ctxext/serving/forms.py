"""config.json as ctxext writes it: the rope form `ctxext.patching.forms` decided, in both spellings,
`rope_parameters` (transformers 5) and `rope_scaling` plus `rope_theta` (what transformers 4.x and the engines
pinned to it read); a vision-language model's in its text_config. This module writes the file and decides
nothing about the form."""

from __future__ import annotations

import json
from pathlib import Path

from ..patching.families import is_nested, missing_base, missing_base_error
from ..patching.forms import RopeForm, model_rope_form
from ..patching.rope_types import with_float_numbers


def with_both_spellings(config: dict, rope_parameters: dict) -> dict:
    """A config.json dict with `rope_parameters` (transformers 5) and `rope_scaling` + `rope_theta` (4.x).

    Every config.json ctxext writes goes through here: the engines' float parameters are written as floats
    (`with_float_numbers`), whatever form the parameters came in (a checkpoint loaded as it is included)."""
    require_base(rope_parameters)
    rope_parameters = with_float_numbers(rope_parameters)
    out = dict(config)
    out["rope_parameters"] = dict(rope_parameters)
    out["rope_theta"] = rope_parameters["rope_theta"]
    scaling = {k: v for k, v in rope_parameters.items() if k not in ("rope_theta", "partial_rotary_factor")}
    # 4.x writes no rope_scaling for plain RoPE; its readers take a missing one as 'default'.
    out["rope_scaling"] = None if scaling["rope_type"] == "default" else scaling
    if "partial_rotary_factor" in rope_parameters:
        out["partial_rotary_factor"] = rope_parameters["partial_rotary_factor"]
    return out


def require_base(rope_parameters: dict) -> None:
    """No config.json ctxext writes has a rope parameter set without its base (`missing_base`): transformers and
    the engines could not build its rotary."""
    where = missing_base(rope_parameters)
    if where is not None:
        raise missing_base_error(where, "ctxext will not write a config.json whose rotary cannot be built")


def text_config_of(config: dict) -> dict:
    """The part of a config.json dict that holds the rope and the lengths: a vision-language model's text_config,
    else the whole config."""
    return config["text_config"] if isinstance(config.get("text_config"), dict) else config


def with_text_config(config: dict, text: dict) -> dict:
    """`config` with the part `text_config_of` returns replaced by `text`."""
    return {**config, "text_config": text} if text_config_of(config) is not config else text


def write_config_for_serving(model, folder, format: str = "native") -> RopeForm:
    """Rewrite `folder`/config.json, just written by `model.save_pretrained`, with the model's rope form in both
    spellings. The caller writes `folder` atomically; this only replaces one file inside it."""
    form = model_rope_form(model, format)
    path = Path(folder) / "config.json"
    written = json.loads(path.read_text())
    # a vision-language model keeps its language model's rope in text_config
    config = text_config_of(written)
    if is_nested(form.rope_parameters):  # no 4.x spelling nests by layer type: transformers 5's form alone
        require_base(form.rope_parameters)
        config["rope_parameters"] = with_float_numbers(form.rope_parameters)
    else:
        config = with_both_spellings(config, form.rope_parameters)
    path.write_text(json.dumps(with_text_config(written, config), indent=2, sort_keys=True) + "\n")
    return form
