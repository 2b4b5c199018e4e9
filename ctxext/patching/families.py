"""Which models ctxext can patch, found by probing their structure rather than by name, and their rope layout.

A transformers 5 RoPE model has a `rotary_emb` module on its base model that returns (cos, sin) from its
frequencies (`inv_freq`), either one set for all layers (`forward(x, position_ids)`) or one set per layer type
(`forward(x, position_ids, layer_type)` with `{layer_type}_inv_freq` buffers, as Gemma 3). Each attention layer
rotates its queries and keys with them, rotate-half style (cos, sin = the angles twice, [a, a]) or, in a few
families (Cohere), interleaved ([a0, a0, a1, a1, ...]); Llama 4 and DeepSeek V2 return the angles as one complex
tensor instead (`freqs_cis`, polar(scaling, a)), which their attention multiplies with interleaved channel pairs
read as complex numbers. `rope_layout(model)` reads all of that once, as data:
which layer types there are and which frequencies each uses, which layers apply no RoPE (SmolLM3's and
Llama 4's NoPE layers), which are sliding-window layers and how far they see, how many channels rotate
(`partial_rotary_factor`), and, for a multimodal rotary (`mrope_section`: Qwen3.5), which of the three position
sections (temporal, height, width) each rotary pair reads. The methods' math never needs to know the family.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import logging
import math

import torch
from torch import nn

from ..errors import CtxextError
from ..methods.frequency import rope_inv_freq
from .takes_effect import interface_bypass

FULL = "full_attention"  # transformers' name of a layer that attends to every earlier token
SECTIONS = 3  # multimodal RoPE's position sections: temporal, height, width
SECTION_NAMES = ("temporal", "height", "width")
# rope_parameters keys that belong to the family rather than to a rope type: Ministral 3's query temperature, and
# how a multimodal rotary splits its pairs among the position sections (Qwen3.5). A patch keeps them.
FAMILY_ROPE_KEYS = ("llama_4_scaling_beta", "mrope_section", "mrope_interleaved")


def _unwrap(model: nn.Module) -> nn.Module:
    # PEFT wraps the transformers model; the rotary embedding lives in the model it wraps. A vision-language model
    # (Qwen2-VL, Qwen3-VL, GLM-4V, ...) keeps it in its language model.
    get_base_model = getattr(model, "get_base_model", None)
    model = get_base_model() if callable(get_base_model) else model
    return language_model_of(model) or model


def language_model_of(model: nn.Module) -> nn.Module | None:
    """The text model inside a composite model (a vision-language model: its config has a `text_config`, and the
    model or its base holds the module built from it as `language_model`), or None for a text model."""
    text_config = getattr(getattr(model, "config", None), "text_config", None)
    if text_config is None:
        return None
    for holder in (model, getattr(model, "model", None)):
        language_model = getattr(holder, "language_model", None)
        if isinstance(language_model, nn.Module) and getattr(language_model, "config", None) is text_config:
            return language_model
    return None


# ------------------------------------------------------------------------------------------ the config
def is_nested(rope_parameters) -> bool:
    """Whether `rope_parameters` holds one dict per layer type ({"full_attention": {...}, ...})."""
    return bool(rope_parameters) and all(isinstance(value, dict) for value in rope_parameters.values())


def rope_parameters_of(config, layer_type: str | None = None) -> dict:
    """The rope parameters a layer type uses (the one flat dict where the config has no nesting)."""
    return layer_rope_parameters(getattr(config, "rope_parameters", None) or {}, layer_type)


def layer_rope_parameters(rope_parameters: dict, layer_type: str | None = None) -> dict:
    """`rope_parameters_of` for a config's rope parameters given as they are."""
    if not is_nested(rope_parameters):
        return rope_parameters
    if layer_type is None:
        layer_type = default_layer_type(sorted(rope_parameters))
    if layer_type not in rope_parameters:
        raise CtxextError(
            f"layer type '{layer_type}' has no rope parameters; this model has {', '.join(sorted(rope_parameters))}"
        )
    return rope_parameters[layer_type] or {}


def ntk_alpha(rope_parameters: dict) -> float | None:
    """HunYuan's NTK alpha: its checkpoints ship type 'dynamic' with an `alpha`, which transformers' HunYuan rotary
    reads as a fixed base rope_theta * alpha^(d / (d - 2)) (its 'ntk_alpha', static); None for any other form."""
    if rope_parameters.get("rope_type", rope_parameters.get("type")) != "dynamic":
        return None
    return float(rope_parameters["alpha"]) if rope_parameters.get("alpha") else None


def scales_statically(rope_parameters: dict) -> bool:
    """Whether a layer type's rope parameters scale its frequencies once for every length (linear, yarn, llama3,
    proportional, ctxext's static types): not plain RoPE, and not a type that follows the length (dynamic,
    longrope, whose short and long sets switch at L). A remapping method keeps such frequencies (`patch`)."""
    rope_type = rope_parameters.get("rope_type", rope_parameters.get("type", "default"))
    return rope_type not in ("default", "longrope") and "dynamic" not in rope_type


def module_frequencies(rotary: nn.Module, layer_type: str | None = None) -> tuple[torch.Tensor, float]:
    """(inv_freq, attention scaling) as the model's own rotary module holds them for a layer type (None: its one
    set): `inv_freq` and `attention_scaling`, or `{layer_type}_inv_freq` and `{layer_type}_attention_scaling`."""
    prefix = "" if layer_type is None else f"{layer_type}_"
    inv_freq = getattr(rotary, f"{prefix}inv_freq")
    return inv_freq.detach().float().clone(), float(getattr(rotary, f"{prefix}attention_scaling", 1.0))


def shipped_base(rope_parameters: dict, dim: int) -> float:
    """The base a layer type's frequencies use as shipped: rope_theta, stretched by HunYuan's NTK alpha."""
    base = float(rope_parameters["rope_theta"])
    alpha = ntk_alpha(rope_parameters)
    return base if alpha is None else base * alpha ** (dim / (dim - 2))


def missing_base(rope_parameters) -> str | None:
    """Where `rope_parameters` names a rotary without its base ('rope_parameters', or
    "rope_parameters['sliding_attention']" in a config nested by layer type), or None where every set has one.

    A set lacks its base where `rope_theta` is there but null, or missing beside a scaling. transformers 5's
    `config.rope_scaling = {...}` setter (what LLaMA-Factory and axolotl assign) replaces `rope_parameters` by the
    scaling with `rope_theta` None (transformers 5.24, configuration_utils.py, the `rope_scaling` setter); the
    rotary then fails to build with `NoneType ** Tensor`, and save_pretrained writes the null to config.json."""
    if not isinstance(rope_parameters, dict):
        return None
    sets = rope_parameters.items() if is_nested(rope_parameters) else [(None, rope_parameters)]
    for key, values in sets:
        scaled = values.get("rope_type", values.get("type", "default")) != "default" or "factor" in values
        if ("rope_theta" in values or scaled) and values.get("rope_theta") is None:
            return "rope_parameters" if key is None else f"rope_parameters['{key}']"
    return None


def config_missing_base(config) -> str | None:
    """`missing_base` of a config's own rope parameters."""
    return missing_base(getattr(config, "rope_parameters", None))


class MissingBaseError(CtxextError):
    """A rope parameter set without its base (`missing_base`): one line that says how to put it back."""


def missing_base_error(where: str, what: str, in_file: str | None = None) -> MissingBaseError:
    """The one line for a rope parameter set without its base (`missing_base`): what dropped it and how to put it
    back, in the config object or (`in_file`) in that config.json."""
    dropped = "transformers drops it when config.rope_scaling is assigned"
    if in_file is not None:
        return MissingBaseError(
            f"{what}: {in_file}'s {where} has no rope_theta ({dropped}, and save_pretrained writes it so); put the "
            f"model's original base back as {where}['rope_theta'] in that file, e.g. from its original config.json"
        )
    return MissingBaseError(
        f"{what}: {where} has no rope_theta ({dropped}); set config.{where}['rope_theta'] to the model's original "
        "base, e.g. from its original config.json"
    )


def check_supported(config, what: str | None = None) -> None:
    """What a config alone says ctxext cannot patch, as a one-line CtxextError (weights are never loaded)."""
    model_type = getattr(config, "model_type", None)
    what = what or (f"model type '{model_type}'" if model_type else "this model")
    rope_parameters = getattr(config, "rope_parameters", None)
    where = missing_base(rope_parameters)
    if where is not None:
        raise missing_base_error(where, what)
    types = list(rope_parameters.values()) if is_nested(rope_parameters) else [rope_parameters or {}]
    if not any(isinstance(values, dict) and "rope_theta" in values for values in types):
        raise CtxextError(f"{what} has no rotary position embedding (RoPE): there is nothing for ctxext to scale")


def config_refusal(config, rope_parameters: dict) -> str | None:
    """Why the model's config class refuses `rope_parameters` (the whole value, nested by layer type where the
    config nests them), in one line, or None where it takes them. Asked of the class's own `validate_rope`, which
    transformers runs when the config is built, loaded and saved (Phi-3's takes only 'default' and 'longrope';
    PhiMoE's needs `short_mscale` and `long_mscale` beside any scaled type, which its rotary reads), on a copy."""
    if not callable(getattr(config, "validate_rope", None)):
        return None
    trial = copy.deepcopy(config)
    trial.rope_parameters = copy.deepcopy(rope_parameters)
    rope_logger = logging.getLogger("transformers.modeling_rope_utils")
    level = rope_logger.level
    rope_logger.setLevel(logging.ERROR)  # its warnings about keys it does not know are for the real config
    try:
        trial.validate_rope()
    except (ValueError, KeyError, TypeError, RuntimeError) as error:  # Runtime: a size it reads is set per layer
        return f"{type(config).__name__}: {str(error).strip().splitlines()[0]}"
    finally:
        rope_logger.setLevel(level)
    return None


def own_partial_rotary_factor(rope_parameters: dict, config=None) -> float | None:
    """The share of each head the model rotates (None: all of it), from its rope parameters (or its config).

    Under rope type `proportional` (p-RoPE, Gemma 4) `partial_rotary_factor` is p, the share of pairs that keep a
    frequency, and the whole head rotates; elsewhere it is the share of channels rotated (Phi, GPT-NeoX)."""
    if rope_parameters.get("rope_type") == "proportional":
        return None
    return rope_parameters.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None))


def rotary_dim(config, layer_type: str | None = None) -> int:
    """The number of rotated channels per head of a layer type: its head_dim, times the model's own partial rotary
    factor (each read from the layer type's own configuration, `layer_config`)."""
    own = layer_config(config, layer_type)
    factor = own_partial_rotary_factor(rope_parameters_of(config, layer_type), own)
    return int(head_dim_of(config, layer_type) * (factor or 1.0))


def layer_config(config, layer_type: str | None = None):
    """The configuration a layer type's layers are built from: `config.per_layer_config[layer_type]` where the
    config sets attributes per layer (Gemma 4: its full-attention layers' head_dim is `global_head_dim`, and
    reading `config.head_dim` raises transformers' AmbiguousGlobalPerLayerAttributeError), else the config. None:
    the layer type an extension moves by default (`default_layer_type`)."""
    if not getattr(config, "is_heterogeneous", False):
        return config
    layer_type = layer_type or default_layer_type(getattr(config, "layer_types", None) or ())
    try:
        return config.per_layer_config[layer_type]
    except (ValueError, KeyError, TypeError, IndexError):  # no such type, or its layers differ among themselves
        return config


def head_dim_of(config, layer_type: str | None = None) -> int:
    """A layer type's query/key head size, from its own configuration (`layer_config`); a one-line CtxextError where
    even that holds none (its layers have several)."""
    own = layer_config(config, layer_type)
    try:
        return int(getattr(own, "head_dim", None) or own.hidden_size // own.num_attention_heads)
    except RuntimeError:  # transformers' AmbiguousGlobalPerLayerAttributeError: a size that differs per layer
        name = getattr(config, "model_type", None) or type(config).__name__
        raise CtxextError(
            f"{name}: its layers{f' of type {layer_type}' if layer_type else ''} have several head sizes "
            "(per_layer_config), which ctxext reads per layer type only"
        ) from None


SLIDING = ("sliding_attention", "chunked_attention")  # layer types that see a bounded window of earlier tokens


def default_layer_type(types) -> str | None:
    """The layer type an extension moves by default: full_attention; where a model has none, its first layer type
    that is not sliding (DeepSeek V3.2's `indexed_attention`, Zaya's `hybrid`); else its first."""
    types = list(dict.fromkeys(types))
    if FULL in types:
        return FULL
    return next((t for t in types if not is_sliding_type(t)), types[0] if types else None)


def is_sliding_type(layer_type: str) -> bool:
    """Whether a layer type's name says it sees only a window of earlier tokens (sliding_attention,
    chunked_attention, Zaya's hybrid_sliding, ...)."""
    return layer_type in SLIDING or "sliding" in layer_type


# ------------------------------------------------------------------------------------------ the model
@dataclasses.dataclass(frozen=True)
class RopeLayout:
    """How one model applies RoPE, per decoder layer. Read once by `rope_layout`; plain data.

    `per_type_rotary`: the rotary module keeps one set of frequencies per layer type (its forward takes the
    layer type); otherwise one set serves every layer. `angles`: how cos/sin lay the angles a out per head,
    "halves" ([a, a], rotate-half: most families), "interleaved" ([a0, a0, a1, a1, ...]: Cohere), "once" ([a]:
    gpt-oss, whose attention splits the head itself) or "complex" (no (cos, sin) but one complex tensor,
    polar(scaling, a), one entry per pair: Llama 4 and DeepSeek V2, whose attention multiplies interleaved channel
    pairs by it). `uses_rope[i]` is False for a NoPE layer; `windows[i]` is a sliding
    layer's window (None for a full one); `attention[i]` is False for a layer without softmax attention (linear
    attention, Mamba, convolution), which RoPE never reaches. `sections`: for a multimodal rotary, the position
    section (0 temporal, 1 height, 2 width) each rotary pair reads from position ids shaped (3, batch, seq); None
    where every pair reads the one position (plain RoPE).
    """

    model_type: str | None
    layer_types: tuple[str, ...]
    per_type_rotary: bool
    angles: str
    uses_rope: tuple[bool, ...]
    windows: tuple[int | None, ...]
    attention: tuple[bool, ...]
    rotary_dims: dict
    bases: dict
    latent_attention: bool = False  # MLA (DeepSeek): RoPE on a separate qk_rope_head_dim slice of each head
    sections: tuple[int, ...] | None = None
    # Per layer, read from its attention module once: its class name, whether it adds learned sinks to the softmax,
    # and (v_head_dim, head_dim) where its values have another head size than its queries and keys (else None).
    attention_classes: tuple[str | None, ...] = ()
    sinks: tuple[bool, ...] = ()
    value_head_dims: tuple[tuple[int, int] | None, ...] = ()
    # Per layer: where its running forward comes from, where that forward never calls transformers' attention
    # interface (Unsloth's fast attention, a family that attends in its own code), else None (`interface_bypass`)
    interface_bypasses: tuple[str | None, ...] = ()

    @property
    def types(self) -> tuple[str, ...]:
        """The distinct layer types that apply RoPE, in layer order."""
        seen = []
        for layer_type, rope, attends in zip(self.layer_types, self.uses_rope, self.attention):
            if rope and attends and layer_type not in seen:
                seen.append(layer_type)
        return tuple(seen)

    def non_sliding_types(self) -> tuple[str, ...]:
        """The RoPE layer types `--layer-types full` means: those whose layers are not all sliding-window layers
        (by their windows, or a name that says so: `is_sliding_type`); all of them where every type slides."""
        sliding = {
            layer_type
            for layer_type in self.types
            if is_sliding_type(layer_type)
            or layer_type != FULL
            and all(self.windows[i] is not None for i, t in enumerate(self.layer_types) if t == layer_type)
        }
        return tuple(t for t in self.types if t not in sliding) or self.types

    def select_types(self, choice: str | list | tuple | None) -> tuple[str, ...] | None:
        """The layer types a frequency method scales, from `--layer-types` (full, all or names); None means the
        one set of frequencies every layer shares.

        `full` (the default) is every RoPE layer type that is not sliding (`non_sliding_types`: full_attention,
        DeepSeek V3.2's indexed_attention, Zaya's hybrid, ...), or all of them where every one slides: Gemma 3's
        recipe, since a sliding layer never sees a key farther than its window. On a model whose rotary module
        serves every layer type with one set of frequencies, only `all` and `full` are accepted, and both scale
        that one set.
        """
        names = _layer_type_names(choice)
        if not self.per_type_rotary:
            if names in (["full"], ["all"]):
                return None
            raise CtxextError(
                f"--layer-types {','.join(names)}: this model's rotary module serves every layer with one set of "
                "frequencies; use --layer-types all (or full)"
            )
        if names == ["all"]:
            return self.types
        if names == ["full"]:
            names = list(self.non_sliding_types())
        unknown = [name for name in names if name not in self.types]
        if unknown:
            raise CtxextError(
                f"unknown layer type '{unknown[0]}'; this model's RoPE layer types are {', '.join(self.types)}"
            )
        return tuple(name for name in self.types if name in names)

    def attention_layers(self, chosen: tuple | None = None, method_length: int | None = None) -> tuple[int, ...]:
        """The layers an attention-level method goes on: those that apply RoPE, of a chosen layer type (None:
        every type), and that can see past L (`method_length`; None: whatever their window)."""
        return tuple(
            i
            for i, layer_type in enumerate(self.layer_types)
            if self.attention[i]
            and self.uses_rope[i]
            and (chosen is None or layer_type in chosen)
            and (method_length is None or self.sees_past(i, method_length))
        )

    def sees_past(self, layer: int, length: int) -> bool:
        """Whether layer `layer` can attend farther back than `length` tokens (a sliding layer within it cannot)."""
        window = self.windows[layer]
        return window is None or window > length

    def describe(self) -> list[dict]:
        """One row per layer type: what `ctxext methods --model` prints."""
        rows = []
        for layer_type in dict.fromkeys(self.layer_types):
            layers = [i for i, t in enumerate(self.layer_types) if t == layer_type]
            rope = [i for i in layers if self.uses_rope[i] and self.attention[i]]
            windows = {self.windows[i] for i in layers}
            rows.append(
                {
                    "layer_type": layer_type,
                    "layers": len(layers),
                    "rope_layers": len(rope),
                    "nope_layers": [i for i in layers if self.attention[i] and not self.uses_rope[i]],
                    "attention": any(self.attention[i] for i in layers),
                    "sliding_window": None if windows == {None} else max(w or 0 for w in windows),
                    "rotary_dim": self.rotary_dims.get(layer_type if self.per_type_rotary else None),
                    "rope_theta": self.bases.get(layer_type if self.per_type_rotary else None),
                }
            )
        return rows


def _layer_type_names(choice) -> list[str]:
    if choice is None:
        return ["full"]
    names = choice.split(",") if isinstance(choice, str) else list(choice)
    names = [str(name).strip() for name in names if str(name).strip()]
    if not names:
        raise CtxextError("--layer-types is empty; give full, all, or layer type names separated by commas")
    if len(names) > 1 and ({"full", "all"} & set(names)):
        raise CtxextError("--layer-types: 'full' and 'all' stand alone, not in a list of layer types")
    return names


def rotary_host(model: nn.Module) -> nn.Module:
    """The base model: the module whose forward computes RoPE once for all its decoder layers, with its rotary
    module (found by what it is, `is_rotary_module`, whatever its name: LFM2-MoE's `pos_emb`) and its decoder layers
    (falcon's `h`, DBRX's `blocks`) reachable as `rotary_emb` and `layers` (`_alias`); or a one-line CtxextError
    saying what is missing."""
    model = _unwrap(model)
    config = getattr(model, "config", None)
    name = getattr(config, "model_type", None) or type(model).__name__
    if config is not None:
        check_supported(config, f"model type '{name}'")
    prefix = getattr(model, "base_model_prefix", None) or "model"
    for host in (model, getattr(model, prefix, None), getattr(model, "model", None)):
        if not isinstance(host, nn.Module):
            continue
        if not isinstance(getattr(host, "rotary_emb", None), nn.Module):
            found = [child for child, module in host.named_children() if is_rotary_module(module)]
            if len(found) != 1:
                continue
            _alias(host, "rotary_emb", found[0])
        stacks = decoder_stacks(host, depth=1) if getattr(host, "layers", None) is None else []
        if len(stacks) == 1:
            _alias(host, "layers", stacks[0])
        return host
    raise _no_rotary_error(model, name, config)


def _no_rotary_error(model: nn.Module, name: str, config) -> CtxextError:
    if config is None or not getattr(config, "rope_parameters", None):
        return CtxextError(f"{name} has no rotary position embedding (RoPE): there is nothing for ctxext to scale")
    paths = [path for path, module in model.named_modules() if is_rotary_module(module)]
    if not paths:
        return CtxextError(
            f"{name} has rope parameters in its config but no rotary module (no module holds inv_freq and takes "
            "(x, position_ids)): no layer of it computes RoPE, so there is nothing for ctxext to scale"
        )
    listed = ", ".join(paths[:3]) + (f" and {len(paths) - 3} more" if len(paths) > 3 else "")
    return CtxextError(
        f"{name} has no rotary module on its base model: its {len(paths)} rotary module(s) sit at {listed}, which "
        "ctxext does not patch (it patches the one rotary module a base model calls for all its decoder layers)"
    )


def is_rotary_module(module: nn.Module) -> bool:
    """Whether `module` is a rotary embedding of the kind transformers builds: an `inv_freq` buffer (or one per layer
    type, `{layer_type}_inv_freq`) and forward(x, position_ids[, layer_type])."""
    buffers = [name for name, _ in module.named_buffers(recurse=False)]
    if not any(name == "inv_freq" or name.endswith("_inv_freq") for name in buffers):
        return False
    try:
        parameters = list(inspect.signature(module.forward).parameters)
    except (TypeError, ValueError):
        return False
    return len(parameters) >= 2 and parameters[1] == "position_ids"


class _AliasedModules(dict):
    """A module's `_modules` in which a second name reaches a child (`aliases`: {second name: its name}): what
    nn.Module's attribute lookup and assignment read, while named_modules, state_dict and saving see only the
    child's own name. ctxext reads and replaces a model's rotary module and layers as `rotary_emb` and `layers`."""

    aliases: dict

    def _name(self, key):
        return self.__dict__.get("aliases", {}).get(key, key)

    def __contains__(self, key):
        return super().__contains__(self._name(key))

    def __getitem__(self, key):
        return super().__getitem__(self._name(key))

    def __setitem__(self, key, value):
        super().__setitem__(self._name(key), value)

    def __delitem__(self, key):
        super().__delitem__(self._name(key))

    def get(self, key, default=None):
        return super().get(self._name(key), default)


def _alias(host: nn.Module, alias: str, name: str) -> None:
    """Make `host.<alias>` read and replace `host.<name>` (`_AliasedModules`)."""
    modules = host.__dict__["_modules"]
    if not isinstance(modules, _AliasedModules):
        modules = _AliasedModules(modules)
        modules.aliases = {}
        host.__dict__["_modules"] = modules
    modules.aliases[alias] = name


def decoder_stacks(host: nn.Module, depth: int = 3) -> list[str]:
    """Paths (within `depth` levels of `host`) of the module lists of decoder layers: lists in which a layer has a
    softmax-attention submodule (`attention_of`), outermost first, a list inside another one left out."""
    found = []
    for path, module in host.named_modules():
        inside = any(path.startswith(f"{outer}.") for outer in found)
        candidate = path and path.count(".") < depth and not inside and isinstance(module, nn.ModuleList)
        if candidate and any(attention_of(layer) is not None for layer in module):
            found.append(path)
    return found


def per_base_rotaries(host: nn.Module) -> nn.ModuleList | None:
    """The rotary modules a model's layers read instead of `rotary_emb`, or None where they read `rotary_emb`.

    Granite SWA (granite_swa, granitemoe_swa) builds `rotary_embs`, one rotary module per distinct non-zero
    `config.layer_rope_theta`, and its forward never calls `rotary_emb` (transformers 5.24,
    models/granite_swa/modeling_granite_swa.py, GraniteSWAModel.__init__ and forward). A patch must replace those.
    """
    modules = getattr(host, "rotary_embs", None)
    return modules if isinstance(modules, nn.ModuleList) else None


def _layer_bases(config, layer_count: int) -> tuple[float, ...]:
    """Each layer's RoPE base where the model has one rotary module per base (`layer_rope_theta`, 0 for a NoPE
    layer): one base shared by every RoPE layer, the config's rope_theta, is all ctxext patches there."""
    name = getattr(config, "model_type", None) or type(config).__name__
    bases = getattr(config, "layer_rope_theta", None)
    if not bases or len(bases) < layer_count:
        raise CtxextError(
            f"this rotary module computes positions in its own way: {name} has one rotary module per base "
            "('rotary_embs') but no base per layer ('layer_rope_theta')"
        )
    distinct = sorted({float(base) for base in bases[:layer_count] if base})
    shared = float(rope_parameters_of(config).get("rope_theta") or 0)
    if len(distinct) > 1 or (distinct and distinct[0] != shared):
        listed = ", ".join(f"{base:g}" for base in distinct)
        raise CtxextError(
            f"{name} gives its layers RoPE of several bases (layer_rope_theta: {listed}; rope_theta {shared:g}), "
            "one rotary module each, which ctxext does not patch yet"
        )
    return tuple(float(base) for base in bases[:layer_count])


def _decoder_layers(host: nn.Module) -> list[nn.Module]:
    """The base model's decoder layers (`layers`, or the one list of them `rotary_host` found under another name), or
    a one-line CtxextError naming what there is instead."""
    layers = getattr(host, "layers", None)
    if layers is not None:
        return list(layers)
    stacks = decoder_stacks(host)
    if not stacks:
        raise CtxextError(
            f"{type(host).__name__} has no list of decoder layers with an attention module (a ModuleList whose "
            "layers hold self_attn or the like) for ctxext to patch"
        )
    raise CtxextError(
        f"{type(host).__name__} runs its decoder layers as {len(stacks)} stacks ({', '.join(stacks)}), not one list "
        "of layers, which ctxext does not patch"
    )


def attention_of(layer: nn.Module) -> nn.Module | None:
    """A decoder layer's softmax-attention module (None for linear-attention, Mamba or convolution layers)."""
    for holder in (layer, *layer.children()):  # or one level down (DBRX: norm_attn_norm.attn)
        for name in ("self_attn", "self_attention", "attention", "attn"):
            module = getattr(holder, name, None)
            if isinstance(module, nn.Module) and hasattr(module, "layer_idx"):
                return module
    return None


def has_attention_sinks(module: nn.Module | None) -> bool:
    """Whether an attention module adds learned per-head sinks to its softmax (`sinks`, passed to the attention
    function as `s_aux`: gpt-oss, Granite SWA), which is more than softmax(q.k)."""
    return isinstance(getattr(module, "sinks", None), torch.Tensor)


def value_head_dim(module: nn.Module | None) -> int | None:
    """An attention module's value head size where it differs from its query/key head size (MiMo V2 Flash's
    `v_head_dim`; multi-head latent attention is told apart by the layout), else None."""
    value, head = getattr(module, "v_head_dim", None), getattr(module, "head_dim", None)
    return int(value) if value is not None and head is not None and value != head else None


def _rotary_call(rotary: nn.Module, layer_type: str | None, device=None):
    """What `rotary` returns at positions 0..7 of a float32 probe ((cos, sin), or one complex tensor)."""
    x = torch.zeros(1, 1, 8, dtype=torch.float32, device=device or _device_of(rotary))
    positions = torch.arange(8, device=x.device)[None]
    return rotary(x, positions) if layer_type is None else rotary(x, positions, layer_type)


def _device_of(module: nn.Module):
    for tensor in module.buffers():
        return tensor.device
    return "cpu"


def _is_complex_tensor(out) -> bool:
    return isinstance(out, torch.Tensor) and out.is_complex()


def _meta_layout(rotary: nn.Module, layer_type: str | None) -> str:
    """The angle layout of a rotary module whose buffers are not filled yet (a model being loaded), from the form
    of what it returns on the meta device: "complex" for one complex tensor, else rotate-half assumed. A copy is
    called: a rotary's forward may cache state (transformers' longrope keeps `long_inv_freq`), which would stay on
    the meta device in the model being loaded."""
    try:
        with torch.no_grad():
            out = _rotary_call(copy.deepcopy(rotary), layer_type, device="meta")
    except Exception:  # noqa: BLE001 - a module that cannot run on meta: the sizes are all there is to read
        return "halves"
    return "complex" if _is_complex_tensor(out) else "halves"


def _matches_complex(freqs_cis: torch.Tensor, angles: torch.Tensor) -> bool:
    """Whether a complex rotary output is polar(scaling, p * inv_freq), one scaling for every entry (the
    magnitude at position 0), as Llama 4's and DeepSeek V2's `freqs_cis` are."""
    values = freqs_cis.to(torch.complex64).cpu().reshape(-1, freqs_cis.shape[-1])[-8:]
    if values.shape != angles.shape:
        return False
    scale = values[0].abs().max().clamp_min(1e-12)
    expected = torch.polar(torch.full_like(angles, float(scale)), angles)
    return torch.allclose(values, expected, atol=1e-4 * float(scale))


def _probe_rotary(rotary: nn.Module, layer_type: str | None) -> tuple[str, int]:
    """(angle layout, rotary_dim) from one call of the model's own rotary module, checked against its inv_freq.

    What ctxext replaces must be what the model computes: cos = cos(p * inv_freq) * scaling, with the angles
    laid out twice (rotate-half), interleaved or once, or one complex tensor polar(scaling, p * inv_freq).
    Anything else is a one-line CtxextError.
    """
    what = f"this rotary module computes positions in its own way: {type(rotary).__name__}"
    name = "inv_freq" if layer_type is None else f"{layer_type}_inv_freq"
    inv_freq = getattr(rotary, name, None)
    if not isinstance(inv_freq, torch.Tensor) or inv_freq.dim() != 1:
        raise CtxextError(f"{what} (no inv_freq buffer)")
    if inv_freq.is_meta:  # a model being loaded (its buffers not filled yet): the sizes and the output's form only
        return _meta_layout(rotary, layer_type), 2 * inv_freq.shape[0]
    try:
        with torch.no_grad():
            out = _rotary_call(rotary, layer_type)
    except Exception as error:  # noqa: BLE001 - any failure of a foreign module means it is not the usual kind
        raise CtxextError(f"{what} ({type(error).__name__} when called as rotary_emb(x, position_ids))") from None
    inv_freq = getattr(rotary, name)  # the call may swap the buffer before 5.23 (compat.py: longrope's inv_freq)
    angles = torch.arange(8, dtype=torch.float32)[:, None] * inv_freq.float().cpu()[None]
    if _is_complex_tensor(out):
        if _matches_complex(out, angles):
            return "complex", 2 * angles.shape[-1]
        raise CtxextError(f"{what} (its complex output is not polar(scaling, position x inv_freq))")
    if not (isinstance(out, tuple) and len(out) == 2 and all(isinstance(t, torch.Tensor) for t in out)):
        raise CtxextError(f"{what} (it returns neither (cos, sin) nor one complex tensor)")
    cos, sin = (t.float().cpu().reshape(-1, t.shape[-1])[-8:] for t in out)
    for layout in ANGLE_LAYOUTS:
        if _is_cos_sin_of(cos, sin, laid_out(angles, layout)):
            return layout, 2 * angles.shape[-1]
    raise CtxextError(f"{what} (its (cos, sin) are not cos/sin of position x inv_freq)")


ANGLE_LAYOUTS = ("halves", "interleaved", "once")  # how (cos, sin) lay the angles out per head


def laid_out(angles: torch.Tensor, layout: str) -> torch.Tensor:
    """Angles (..., pairs) laid out per head as a rotary module's (cos, sin) carry them."""
    if layout == "halves":
        return torch.cat((angles, angles), -1)
    if layout == "interleaved":
        return angles.repeat_interleave(2, -1)
    return angles


def _is_cos_sin_of(cos: torch.Tensor, sin: torch.Tensor, angles: torch.Tensor) -> bool:
    """Whether (cos, sin) are cos/sin of `angles` times one attention scaling (cos at position 0, first row)."""
    scale = cos[0].abs().max().clamp_min(1e-12)
    tolerance = 1e-4 * float(scale)
    return (
        angles.shape == cos.shape
        and torch.allclose(cos, angles.cos() * scale, atol=tolerance)
        and torch.allclose(sin, angles.sin() * scale, atol=tolerance)
    )


def _filled_copy(rotary: nn.Module, inv_freq: torch.Tensor) -> tuple[nn.Module, torch.Tensor]:
    """(`rotary`, its inv_freq) where they hold numbers; for a module on the meta device (a model being loaded), a
    CPU copy whose inv_freq is made up: which section a pair reads does not depend on its frequency."""
    if not inv_freq.is_meta:
        return rotary, inv_freq
    made_up = 1.0 / (2.0 + torch.arange(inv_freq.shape[0], dtype=torch.float32))
    probe = copy.deepcopy(rotary).to_empty(device="cpu")
    probe.inv_freq = made_up.clone()
    return probe, made_up


def _sectioned_cos_sin(rotary: nn.Module, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) of `rotary` at 3-section position ids `positions` (3, 8), as float32 rows (8, channels)."""
    device = _device_of(rotary)
    x = torch.zeros(1, 1, positions.shape[-1], dtype=torch.float32, device=device)
    with torch.no_grad():
        cos, sin = rotary(x, positions[:, None, :].to(device))
    return tuple(t.float().cpu().reshape(-1, t.shape[-1]) for t in (cos, sin))


def _probe_sections(rotary: nn.Module, layout: str) -> tuple[int, ...]:
    """Which position section each rotary pair of a multimodal rotary module reads, probed, never read by name.

    Called with position ids (3, batch, seq) in which one section moves and the others stay at 0, a pair whose sine
    is not 0 reads that section; each pair must read exactly one. Then, at positions that differ in every section,
    (cos, sin) must be cos/sin(p_section(i) x inv_freq_i): that is what ctxext's module computes with its own
    frequencies (Qwen3.5 interleaves the sections: pair 3j + 1 reads height, 3j + 2 width, up to their sizes).
    """
    what = f"this rotary module computes positions in its own way: {type(rotary).__name__}"
    if layout not in ANGLE_LAYOUTS:
        raise CtxextError(f"{what} (multimodal RoPE sections with {layout} angles)")
    module, inv_freq = _filled_copy(rotary, rotary.inv_freq)
    pairs, steps = inv_freq.shape[0], torch.arange(8)
    try:
        reads = []
        for section in range(SECTIONS):
            positions = torch.zeros(SECTIONS, steps.shape[0], dtype=torch.long)
            positions[section] = steps
            _, sin = _sectioned_cos_sin(module, positions)
            reads.append((sin[:, :pairs] if layout != "interleaved" else sin[:, 0::2]).ne(0).any(0))
        different = torch.stack((steps, 3 * steps + 1, 5 * steps + 2))
        cos, sin = _sectioned_cos_sin(module, different)
    except Exception as error:  # noqa: BLE001 - any failure of a foreign module means it is not the usual kind
        raise CtxextError(f"{what} ({type(error).__name__} when called with 3-section position ids)") from None
    reads = torch.stack(reads)  # (section, pair)
    if not bool((reads.sum(0) == 1).all()):
        raise CtxextError(f"{what} (its rotary pairs do not each read one section of the 3-section position ids)")
    sections = tuple(int(section) for section in reads.int().argmax(0))
    angles = different[list(sections)].T.float() * inv_freq.float().cpu()
    if not _is_cos_sin_of(cos, sin, laid_out(angles, layout)):
        raise CtxextError(f"{what} (its (cos, sin) are not cos/sin of each pair's section position x inv_freq)")
    return sections


def _layer_rope_keys(config, modules: list) -> tuple[str, ...]:
    """Each layer's type as the key of the rope parameters it reads: `config.layer_types` (full_attention past their
    end), or where the layer's attention names the rope parameters it reads, that name (`rope_layer_type`: DeepSeek
    V4 keys them main and compress, not by its layer types; sliding layers read main, compressed ones compress)."""
    configured = list(getattr(config, "layer_types", None) or [])
    rope_parameters = getattr(config, "rope_parameters", None) or {}
    keys = []
    for i, module in enumerate(modules):  # each layer's attention module (`attention_of`), read once by the layout
        named = getattr(module, "rope_layer_type", None)
        if isinstance(named, str) and is_nested(rope_parameters) and named in rope_parameters:
            keys.append(named)
        else:
            keys.append(configured[i] if i < len(configured) else FULL)
    return tuple(keys)


def layer_rotaries(host: nn.Module) -> list[tuple[str, nn.Module, str, nn.Module]]:
    """(path, parent, attribute name, module) of each rotary module inside the decoder layers (a module holding
    `inv_freq` buffers), other than the base model's own: DeepSeek V4's compressors and their indexers each build a
    DeepseekV4RotaryEmbedding from the model's config and call it with layer_type='compress' (transformers 5.24,
    modeling_deepseek_v4.py: DeepseekV4HCACompressor, DeepseekV4Indexer, DeepseekV4CSACompressor). A patch puts
    the base model's scaled rotary in their place (`replace_layer_rotaries` in patch.py)."""
    found, pending = [], [("layers", _layers_module(host))]
    while pending:  # not into a rotary module: ctxext's own (put there by a patch) holds the model's as `original`
        path, parent = pending.pop(0)
        for name, child in parent.named_children():
            if child is host.rotary_emb:
                continue
            if any(buffer.endswith("inv_freq") for buffer, _ in child.named_buffers(recurse=False)):
                found.append((f"{path}.{name}", parent, name, child))
            else:
                pending.append((f"{path}.{name}", child))
    return found


def _layers_module(host: nn.Module) -> nn.Module:
    layers = getattr(host, "layers", None)
    return layers if isinstance(layers, nn.Module) else nn.ModuleList()


def check_layer_rotaries(host: nn.Module, rotary: nn.Module) -> None:
    """Refuse, naming the module, a rotary module inside the layers (`layer_rotaries`) that a patch of the base
    model's rotary would not reproduce: another class, or other frequencies than `rotary` holds under one name."""
    for path, _, _, module in layer_rotaries(host):
        what = f"{path} ({type(module).__name__}) computes rope positions of its own"
        if type(module) is not type(rotary):
            raise CtxextError(f"{what}, not with the base model's {type(rotary).__name__}, which ctxext does not patch")
        for name, buffer in module.named_buffers(recurse=False):
            theirs = getattr(rotary, name, None)
            if buffer.is_meta or not name.endswith("inv_freq"):
                continue
            if not isinstance(theirs, torch.Tensor) or theirs.is_meta or not torch.equal(buffer.cpu(), theirs.cpu()):
                raise CtxextError(
                    f"{what}: its {name} differs from the base model's rotary_emb, which ctxext does not patch"
                )


def _rotary_keys(config, rotary, layer_types: tuple, uses_rope: tuple, attention: tuple) -> list:
    """The layer types whose own rope parameters a per-type rotary reads: those of layers that attend with RoPE."""
    keys = [t for t, rope, attends in zip(layer_types, uses_rope, attention) if rope and attends]
    missing = sorted({t for t in keys if t not in config.rope_parameters})
    if missing:
        raise CtxextError(
            f"this rotary module computes positions in its own way: {type(rotary).__name__} (its rope "
            f"parameters are keyed {', '.join(sorted(config.rope_parameters))}, not by layer type {missing[0]})"
        )
    return list(dict.fromkeys(keys))


def rope_layout(model: nn.Module) -> RopeLayout:
    """The model's rope layout (see `RopeLayout`), probed from its modules; a one-line CtxextError where the
    model is not the kind ctxext can patch."""
    host = rotary_host(model)
    config = host.config
    rotary = getattr(host.rotary_emb, "original", None) or host.rotary_emb  # look through ctxext's own module
    per_type = "layer_type" in inspect.signature(rotary.forward).parameters and is_nested(config.rope_parameters)
    multimodal = getattr(rotary, "mrope_section", None) is not None  # positions in 3 sections (Qwen3.5)
    if multimodal and per_type:
        raise CtxextError(
            f"{config.model_type} uses multimodal RoPE (mrope_section) with frequencies per layer type, which "
            "ctxext does not patch yet"
        )
    layers = _decoder_layers(host)
    modules = [attention_of(layer) for layer in layers]
    layer_types = _layer_rope_keys(config, modules)
    attention = tuple(module is not None for module in modules)
    uses_rope = tuple(module is not None and bool(getattr(module, "use_rope", True)) for module in modules)
    if per_base_rotaries(host) is not None:  # Granite SWA: a layer whose base is 0 applies no RoPE
        uses_rope = tuple(rope and bool(base) for rope, base in zip(uses_rope, _layer_bases(config, len(layers))))
    windows = tuple(
        None if module is None else _window(module, config, layer_type)
        for module, layer_type in zip(modules, layer_types)
    )
    keys = _rotary_keys(config, rotary, layer_types, uses_rope, attention) if per_type else [None]
    dims, bases, layouts = {}, {}, set()
    for key in keys:
        layout, dim = _probe_rotary(rotary, key)
        if layout != "once" and dim != rotary_dim(config, key) and rotary_dim(config, key) % 2:
            raise CtxextError(
                f"this model rotates an odd number of channels per head ({rotary_dim(config, key)}: head_dim x "
                "partial_rotary_factor), whose frequencies ctxext cannot reproduce; it needs whole rotary pairs"
            )
        layouts.add(layout)
        dims[key] = dim
        bases[key] = shipped_base(rope_parameters_of(config, key), dim)
    check_layer_rotaries(host, rotary)
    angles = layouts.pop() if len(layouts) == 1 else "mixed"
    return RopeLayout(
        model_type=getattr(config, "model_type", None),
        layer_types=layer_types,
        per_type_rotary=per_type,
        angles=angles,
        uses_rope=uses_rope,
        windows=windows,
        attention=attention,
        rotary_dims=dims,
        bases=bases,
        latent_attention=bool(getattr(config, "qk_rope_head_dim", None)),
        sections=_probe_sections(rotary, angles) if multimodal else None,
        attention_classes=tuple(None if module is None else type(module).__name__ for module in modules),
        sinks=tuple(has_attention_sinks(module) for module in modules),
        value_head_dims=tuple(_value_and_head_dims(module) for module in modules),
        interface_bypasses=tuple(interface_bypass(module) for module in modules),
    )


def _value_and_head_dims(module: nn.Module | None) -> tuple[int, int] | None:
    """(v_head_dim, head_dim) of an attention module whose values have another head size (MiMo V2 Flash), else None."""
    value = value_head_dim(module)
    return None if value is None else (value, int(module.head_dim))


def _window(module: nn.Module, config, layer_type: str) -> int | None:
    """A layer's sliding window, or None where it sees every earlier token."""
    if getattr(config, "use_sliding_window", True) is False or getattr(module, "is_sliding", True) is False:
        return None
    if getattr(module, "compressor", None) is not None:  # DeepSeek V4: compressed entries reach every earlier token
        return None
    window = getattr(module, "sliding_window", None)
    if window is None and (layer_type == "sliding_attention" or not getattr(config, "layer_types", None)):
        window = getattr(config, "sliding_window", None)
    if window is None and layer_type == "chunked_attention":
        window = getattr(config, "attention_chunk_size", None)
    return int(window) if window else None


def rotary_wavelengths(model: nn.Module) -> list[float] | None:
    """Each rotary pair's wavelength in tokens, 2*pi / theta_i, at the model's plain base (None without one)."""
    config = _unwrap(model).config
    rope_parameters = rope_parameters_of(config)
    if rope_parameters.get("rope_theta") is None:
        return None
    dim = rotary_dim(config)
    return (2 * math.pi / rope_inv_freq(dim, shipped_base(rope_parameters, dim)).double()).tolist()


# ------------------------------------------------------------------------- multi-head latent attention
def latent_attention_scale(rope_parameters: dict, qk_head_dim: int) -> float:
    """The softmax scale an MLA family (DeepSeek V2/V3, MiniCPM3, GLM-4 MoE Lite, ...) computes from its rope
    parameters when its attention is built: qk_head_dim^-1/2, times m(s, mscale_all_dim)^2 under a scaled rope
    type that sets mscale_all_dim, where m(s, c) = 0.1 c ln s + 1 (1 for s <= 1). YaRN's temperature in
    DeepSeek's convention: the rest of it, m(s, mscale) / m(s, mscale_all_dim), is in cos/sin."""
    scale = qk_head_dim**-0.5
    mscale_all_dim = rope_parameters.get("mscale_all_dim") or 0
    factor = rope_parameters.get("factor") or 1.0
    if rope_parameters.get("rope_type", "default") != "default" and mscale_all_dim and factor > 1:
        m = 0.1 * mscale_all_dim * math.log(factor) + 1.0
        scale *= m * m
    return scale
