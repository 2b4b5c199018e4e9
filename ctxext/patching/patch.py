"""`patch(model, method, factor=...)` and `unpatch(model)`: the public way to apply a method to a model."""

from __future__ import annotations

import copy
import dataclasses
import itertools
import warnings
from typing import NamedTuple

import torch
from torch import nn

from ..dispatch import held_device
from ..errors import CtxextError
from ..methods import Method, MethodParams, get_method
from ..methods.attention import AttentionSettings, check_original_length_for_logn, check_query_temperature
from ..methods.remapping import RemapParams
from ..validate import boolean, whole_number
from .attention import (
    CONFIG_KEY,
    LAYERS_KEY,
    check_can_install,
    install_attention,
    record_attention_in_config,
    sync_attention_with_config,
)
from .compose import Extension, composed_rope_parameters, extension, factor_for, trained_frequencies
from .families import (
    RopeLayout,
    attention_of,
    language_model_of,
    latent_attention_scale,
    layer_rotaries,
    per_base_rotaries,
    rope_layout,
    rope_parameters_of,
    rotary_dim,
    rotary_host,
)
from .forms import NATIVE_QUERY_TEMPERATURE, rope_parameters_to_write, with_written
from .mrope_axes import axis_selective, describe_sections, parse_sections
from .record import (
    SOURCE_KEY,
    RopeRecord,
    as_shipped,
    host_rope_record,
    model_rope_record,
    recorded_source,
    rope_record,
)
from .rope_types import (
    keeps_p_rope,
)
from .rotary import PatchUndo, ScaledRotaryEmbedding
from .takes_effect import check_rotary_is_called


def patch(
    model: nn.Module,
    method: str,
    factor: float = 1.0,
    original_max_position_embeddings: int | None = None,
    logn: bool = False,
    layer_types: str | list | None = None,
    query_temperature: float | None = None,
    replace_shipped: bool = False,
    target_length: int | None = None,
    allow_shorter: bool = False,
    mrope_sections: str | list | None = None,
    planned: PatchPlan | None = None,
    **params,
) -> nn.Module:
    """Apply `method` at scale `factor` to the model's rotary embedding (and attention, where the method needs it);
    returns the same model.

    The extension counts from where the model is (ctxext.patching.compose): `factor` s means s times the trained
    context C of the model's rope record (Llama 3.1: 131072, not its pre-training 8192), and `target_length` N says
    the same in tokens (s = N / C). A static frequency method composes with a scaling the model shipped (it acts on
    the frequencies the model was trained with at C); a remapping method keeps shipped static frequencies and
    remaps past C. `replace_shipped=True`, or an explicit `original_max_position_embeddings` L, replaces the shipped
    scaling and counts from L0 (or L) instead. A patch that would leave the model a shorter context than C warns
    here (unless `allow_shorter=True`); `ctxext patch` refuses to write such a checkpoint.

    The config records the method for `save_pretrained`: `rope_parameters` names it, `max_position_embeddings` is
    L*factor (dynamic methods keep L, where transformers starts scaling). A patch replaces an earlier one. Where the
    family's config refuses that form (Phi-3, PhiMoE), a static method is written as longrope with equal factor
    sets; a dynamic or remapping method, which no such form expresses, is refused (`rope_parameters_to_write`).

    `logn=True` adds log-n query scaling; `query_temperature=beta` multiplies queries by 1 + beta ln(1 + floor(p /
    L)) (Llama 4 / Ministral 3), as the family's own `llama_4_scaling_beta` where its attention reads it, else in
    ctxext's attention wrapper, which remapping methods install too (recorded as `ctxext_attention`).

    `layer_types` (`full`, the default, `all`, or layer type names) chooses which layer types' frequencies a model
    with one set per type (Gemma 3) has scaled; attention-level methods go only on the chosen layers that apply RoPE,
    a remapping method not on a sliding layer whose window is at most L (`RopeLayout`). `mrope_sections` scales only
    those sections of a multimodal RoPE (ctxext.patching.mrope_axes).

    `planned`: the plan `plan_patch` made with these same arguments, on this model or on a meta-device skeleton of
    its config (`ctxext patch` plans before any weights load); it is carried out as it is, not made again.
    """
    plan = planned or plan_patch(
        model,
        method,
        factor,
        original_max_position_embeddings,
        logn,
        layer_types,
        query_temperature,
        replace_shipped=replace_shipped,
        target_length=target_length,
        mrope_sections=mrope_sections,
        **params,
    )
    return _carry_out(model, plan, allow_shorter, locals())


def _carry_out(model: nn.Module, plan: PatchPlan, allow_shorter: bool, arguments: dict) -> nn.Module:
    """`patch`'s plan carried out on `model` (the plan may come from a skeleton of its config): a shorter context
    warns, an earlier patch is undone, the plan is applied and the call kept (`_keep_call`)."""
    plan = plan._replace(host=rotary_host(model))
    try:
        check_not_shorter(plan, allow_shorter)
    except CtxextError as error:  # in memory it may be an experiment; `ctxext patch` refuses to write it
        warnings.warn(str(error), stacklevel=3)
    unpatch(model)
    apply_plan(plan)
    _keep_call(model, arguments)
    return model


def _keep_call(model: nn.Module, arguments: dict) -> None:
    """`patch`'s call, kept on the patched rotary as `patch_call`: an adapter's record repeats it on the base it
    loads on (ctxext.integrations.adapters)."""
    call = {key: value for key, value in arguments.items() if key not in ("model", "params", "plan", "planned")}
    rotary_host(model).rotary_emb.patch_call = {**call, **arguments["params"]}


def apply_plan(plan: PatchPlan) -> None:
    """Carry out a plan on its (unpatched) model: the config records the method, the scaled rotary replaces the
    model's own (kept for `unpatch`), and the attention wrapper goes on where the method needs it."""
    host, layout = plan.host, plan.layout
    check_rotary_is_called(host, plan.spec.name)  # before any change: a forward that bypasses it is refused
    undo = _write_config(plan)
    scaled = _scaled_rotary(plan)
    scaled.undo = undo
    scaled.to(rotary_device(host))
    host.rotary_emb = scaled
    undo.per_base_rotaries = replace_per_base_rotaries(host, scaled)
    undo.layer_rotaries = replace_layer_rotaries(host, scaled)
    if layout.latent_attention:  # the softmax scale MLA attention computed from the rope parameters at build time
        undo.latent_attention_scales = rescale_latent_attention(host, host.config)
    record_attention_in_config(
        host.config, plan.attention, None if plan.layers == layout.attention_layers() else plan.layers
    )
    install_attention(host, plan.attention, layers=plan.layers, layout=layout)


def _write_config(plan: PatchPlan) -> PatchUndo:
    """The plan's rope parameters and context written into the model's config; returns what undoes it."""
    config = plan.host.config
    undo = PatchUndo(
        copy.deepcopy(config.rope_parameters),
        config.max_position_embeddings,
        copy.deepcopy(getattr(config, CONFIG_KEY, None)),
        source_rope=copy.deepcopy(getattr(config, SOURCE_KEY, None)),
    )
    setattr(config, SOURCE_KEY, recorded_source(config) or shipped_rope(plan.host))  # before ctxext's first change
    config.rope_parameters = copy.deepcopy(with_written(config.rope_parameters, plan.written))
    config.max_position_embeddings = plan.max_position_embeddings
    if hasattr(config, "original_max_position_embeddings"):
        # Phi-3 keeps L outside its rope parameters too, and transformers' yarn, llama3 and longrope read that one
        # first (standardize_rope_params in modeling_rope_utils.py copies it over the rope parameters' own)
        undo.original_max_position_embeddings = config.original_max_position_embeddings
        composed = plan.extension.composed
        config.original_max_position_embeddings = plan.record.pretraining_length if composed else plan.method_length
    return undo


def _scaled_rotary(plan: PatchPlan) -> ScaledRotaryEmbedding:
    """ctxext's rotary module for the plan, around the model's own (read after the config is written: a composed
    scaling is answered by the family's module built from the patched config)."""
    host, layout = plan.host, plan.layout
    keys = plan.chosen or (None,)
    return ScaledRotaryEmbedding(
        plan.spec,
        plan.params,
        {key: (layout.rotary_dims[key], layout.bases[key]) for key in keys},
        plan.method_length,
        original=host.rotary_emb,
        angles=layout.angles,
        sections=layout.sections,
        shipped=plan.shipped,
        composed=family_rotary(host.rotary_emb, host.config) if plan.composed else None,
        composed_keys=plan.composed,
        rotated_pairs=p_rope_pairs_of(plan.record, keys, plan.spec),
    )


def p_rope_pairs_of(record: RopeRecord, keys: tuple, spec: Method) -> dict:
    """{layer type: the pairs that turn} for the chosen types that rotate with p-RoPE (Gemma 4's full layers),
    where the method keeps that layout (every method but `proportional`, which sets its own p)."""
    if not keeps_p_rope(spec):
        return {}
    pairs = {key: record.of(key).rotated_pairs for key in keys}
    return {key: n for key, n in pairs.items() if n is not None}


def rotary_device(host: nn.Module) -> torch.device:
    """Where the model's rotary module lives: its buffers' device, else the first weight's that is not offloaded to
    disk (accelerate leaves those on the meta device: ctxext.dispatch.held_device)."""
    return held_device(itertools.chain(host.rotary_emb.buffers(), host.parameters()))


def family_rotary(original: nn.Module, config) -> nn.Module:
    """A new rotary module of the model's own class built from `config` (the patched rope parameters): what a
    reload of the saved checkpoint builds, so that a composed scaling runs in memory exactly as it will there."""
    try:
        with torch.device("cpu"):
            return type(original)(config=copy.deepcopy(config))
    except (TypeError, ValueError, KeyError) as error:
        raise CtxextError(
            f"{type(original).__name__} cannot be built from the composed rope parameters ({error}); use "
            "--replace-shipped to replace the shipped scaling instead"
        ) from None


class PatchPlan(NamedTuple):
    """What `patch` will do, decided before anything changes."""

    host: nn.Module
    layout: RopeLayout
    record: RopeRecord  # the model's rope as shipped, read once
    extension: Extension  # where the method counts from, and what it does to the shipped scaling
    chosen: tuple | None  # the layer types whose frequencies are scaled (None: the one shared set)
    spec: Method
    params: MethodParams
    method_length: int  # L the method is given
    attention: AttentionSettings
    layers: tuple  # the attention layers an attention-level method goes on
    native_query_temperature: float | None  # beta written for the family's own code to apply (Ministral 3)
    written: dict  # {layer type (None: the one set): the rope parameters the config records}
    shipped: tuple  # the layer types whose shipped frequencies stay as they are (`kept_shipped_frequencies`)
    composed: tuple  # the layer types whose shipped scaling the method composes with (answered by the family's module)
    max_position_embeddings: int  # what the config records after the patch
    left_alone: tuple = ()  # chosen layer types a remapping method leaves as shipped: their layers slide within L
    reach_note: str = ""  # how a remapping method's reach and the declared length relate (`remap_reach_note`)
    part: str = ""  # where in a composite model the patch goes, e.g. " (the language model of qwen2_vl)"

    @property
    def context_before(self) -> int:
        return self.record.trained_context

    def describe(self) -> str:
        """One line on what the patch does to the model's context, e.g. 'yarn x2 composes with the shipped llama3
        x8: 131072 -> 262144'."""
        how = f" {self.extension.how}" if self.extension.how else f" counts from L = {self.method_length}"
        told = (
            f"{self.spec.name} x{self.params.factor:g}{how}{self.part}: {self.context_before} -> "
            f"{self.max_position_embeddings}"
        )
        if self.left_alone:
            told += (
                f"; {', '.join(self.left_alone)} left as shipped (their layers slide within L = "
                f"{self.method_length}, so they never see a distance to remap)"
            )
        return told + self.reach_note + self.layer_types_note()

    def layer_types_note(self) -> str:
        """Which layer types the patch scales, on a model with frequencies per layer type: '; layer types:
        full_attention (sliding_attention left as shipped)'. Empty where one set serves every layer."""
        if not self.chosen:
            return ""
        others = [key for key in self.layout.types if key not in self.chosen and key not in self.left_alone]
        return f"; layer types: {', '.join(self.chosen)}" + (
            f" ({', '.join(others)} left as shipped)" if others else ""
        )


def plan_patch(
    model: nn.Module,
    method: str,
    factor: float = 1.0,
    original_max_position_embeddings: int | None = None,
    logn: bool = False,
    layer_types: str | list | None = None,
    query_temperature: float | None = None,
    replace_shipped: bool = False,
    target_length: int | None = None,
    mrope_sections: str | list | None = None,
    **params,
) -> PatchPlan:
    """Everything `patch` decides before it changes anything, or the one-line CtxextError that refuses it.
    Reads the model's modules and config only, so it also answers for a model built on the meta device."""
    host = rotary_host(model)
    layout, record, from_source = _rope_to_patch(host, replace_shipped, original_max_position_embeddings)
    chosen = layout.select_types(layer_types)
    keys = chosen or (None,)
    spec = get_method(method)
    boolean("logn", logn)
    boolean("replace_shipped", replace_shipped)
    if original_max_position_embeddings is not None:
        original_max_position_embeddings = whole_number(
            "original_max_position_embeddings", original_max_position_embeddings
        )
    ext, method_params = _extension_and_params(
        record, layout, spec, keys, factor, target_length, original_max_position_embeddings, replace_shipped, params
    )
    L = ext.method_length
    spec, method_params, on_sections = _on_mrope_sections(layout, ext, spec, method_params, L, mrope_sections)
    if logn:
        check_original_length_for_logn(L)
    native_temperature, wrapped_temperature = _split_query_temperature(record, keys, query_temperature)
    attention = AttentionSettings.for_method(spec.name, method_params, logn, L, wrapped_temperature)
    check_shape(host.config, method_params, L)
    # A remapping method changes (query, key) distances, which a sliding layer within L never has past L; log-n
    # alone scales queries by their own position, and stays on every RoPE layer of the chosen types.
    layers = layout.attention_layers(chosen, L if attention.remap is not None else None)
    if attention.active:  # the ordered refusal rules (ctxext.patching.refusals)
        check_can_install(host, attention, int(round(L * method_params.factor)), layout, layers)
    left_alone = ()
    if attention.remap is not None and chosen:  # a type whose every layer slides within L keeps what it shipped
        chosen, left_alone = _split_by_remapped_layers(chosen, layout, layers)
        keys = chosen
    shipped = kept_shipped_frequencies(record, keys) if attention.remap is not None else ()
    composed_written = _composed_rope_parameters(host, record, ext.composed, spec, method_params, L)
    shipped += tuple(key for key in ext.composed if key not in composed_written)  # composing changed nothing
    written = rope_parameters_to_write(
        host, layout, keys, spec, method_params, L, native_temperature, shipped, composed_written
    )
    length_asked = target_length is not None or method_params.factor != 1.0
    new_context, note = _declared_context(written, shipped, record, attention, L, method_params.factor, length_asked)
    note += from_source
    return PatchPlan(
        *(host, layout, record, ext, chosen, spec, method_params, L, attention, layers, native_temperature),
        *(written, shipped, tuple(composed_written), new_context, left_alone, note, _part_patched(model) + on_sections),
    )


def _on_mrope_sections(layout: RopeLayout, ext: Extension, spec, method_params, L: int, mrope_sections):
    """(method, parameters, a note for `describe`): the method itself, or on the chosen MRoPE sections only, as
    per-pair longrope (ctxext.patching.mrope_axes)."""
    sections = parse_sections(mrope_sections)
    if sections is None:
        return spec, method_params, ""
    if ext.composed:
        raise CtxextError("mrope_sections does not compose with a shipped scaling; use --replace-shipped to replace it")
    asked = spec.name
    spec, method_params = axis_selective(layout, spec, method_params, L, sections)
    note = f", {asked} on the {describe_sections(sections)} sections only (per-pair longrope; the others as trained)"
    return spec, method_params, note


def _part_patched(model: nn.Module) -> str:
    """' (the language model of qwen2_vl)' where `model` is a composite model whose language model is patched."""
    language_model = language_model_of(model)
    return f" (the language model of {model.config.model_type})" if language_model is not None else ""


def _rope_to_patch(host: nn.Module, replace, given_L) -> tuple[RopeLayout, RopeRecord, str]:
    """(layout, record, a note for `describe`) of the rope a patch starts from: the model's as it is or, where the
    patch replaces what the model has (`replace_shipped`, or an explicit L other than its C) and the config records
    the rope from before ctxext changed it (SOURCE_KEY: a checkpoint ctxext wrote, reloaded), that one's base and
    L0, so that ntk x4 then ntk x2 replacing it is ntk x2 on the source (C stays what the model serves now, so a
    shorter result is still said). Without it, the raised base a native form wrote would read as the model's own,
    and the new base change would go on top of the old one."""
    layout, record = rope_layout(host), host_rope_record(host)
    source = recorded_source(host.config)
    replacing = bool(replace) or (given_L is not None and given_L != record.trained_context)
    before = rope_record(host.config, source) if source is not None and replacing else record
    if before == record:
        return layout, record, ""
    before = dataclasses.replace(before, trained_context=max(before.trained_context, record.trained_context))
    note = (
        f"; replaces the patch ctxext recorded ({SOURCE_KEY}) and starts from the rope from before it "
        f"({before.describe()}), not from the {record.trained_context} tokens the model serves now"
    )
    return dataclasses.replace(layout, bases={key: before.of(key).base for key in layout.bases}), before, note


def _declared_context(written, shipped, record, attention, L: int, factor: float, length_asked: bool):
    """(max_position_embeddings after the patch, what `describe` says of a remapping method's reach): without a
    length asked for, the reach of the method's own parameters where that is longer (`RemapParams.reach`)."""
    reach = None if attention.remap is None else attention.remap.reach(L)
    new_context = _context_after(written, shipped, record, L, factor)
    if reach is not None and not length_asked:
        new_context = max(new_context, reach)
    return new_context, remap_reach_note(attention.method, attention.remap, L, reach, new_context, length_asked)


def remap_reach_note(method: str, remap: RemapParams | None, L: int, reach, declared: int, length_asked: bool) -> str:
    """What `ctxext patch` says of a remapping method's reach (`RemapParams.reach`) beside the length it declares:
    without --factor or --target-length the reach is declared; with one, the length asked wins, said where the
    parameters keep relative positions within L for fewer tokens than that."""
    if remap is None:
        return ""
    setting = f"{method} {remap.describe()}"
    if reach is None:
        return (
            ""
            if length_asked
            else f"; {setting} keeps every relative position within L = {L} at any length ({remap.reach_rule()}): "
            "give --factor or --target-length for the length to declare"
        )
    if not length_asked:
        return f"; {setting} keeps relative positions within L = {L} up to {reach} tokens ({remap.reach_rule()})"
    if reach >= declared:
        return ""
    within = remap.setting_within(declared, L)
    return (
        f"; {setting} keeps relative positions within L = {L} only up to {reach} tokens ({remap.reach_rule()}): "
        f"{declared} declared as asked" + (f" ({within} reaches it)" if within else "")
    )


def _extension_and_params(
    record: RopeRecord, layout: RopeLayout, spec: Method, keys: tuple, factor, target_length, given_L, replace, params
) -> tuple[Extension, MethodParams]:
    """Where the method counts from (ctxext.patching.extension) and its parameters there: a --target-length turns
    into the factor from that L."""
    remaps = issubclass(spec.params_cls, RemapParams)
    given = spec.make_params(factor=1.0 if target_length is not None else factor, **params)
    ext = extension(record, spec, given, keys, remaps, given_L, replace)
    method_params = spec.make_params(factor=factor_for(target_length, factor, ext.method_length), **params)
    if ext.composed and layout.latent_attention:
        return _latent_attention_yarn(record, spec, ext.composed, method_params, params)
    return ext, method_params


# What a yarn over L0 in place of a shipped yarn keeps of it unless given: its ramp, and DeepSeek's temperature
# (mscale on cos/sin, mscale_all_dim in the softmax scale MLA attention builds from the rope parameters)
LATENT_YARN_KEYS = ("beta_fast", "beta_slow", "mscale", "mscale_all_dim")


def _latent_attention_yarn(record: RopeRecord, spec: Method, keys: tuple, method_params, params: dict):
    """(Extension, parameters) of yarn x s on multi-head latent attention that shipped a yarn (DeepSeek V3, Kimi K2:
    yarn x40 over L0 4096, C 163840): one yarn over L0 at factor s C / L0 replaces the shipped one, keeping its
    LATENT_YARN_KEYS unless given; that is DeepSeek's own form, whose softmax scale the family's attention derives
    from the written factor, so a reload computes what the patch does. It is not yarn x s composed with the shipped
    frequencies (their ramps differ: docs/guides/methods.md, 'DeepSeek V3 / Kimi K2'), and the line says so. Any
    other method there is refused: its composed per-pair form cannot carry that softmax scale."""
    shipped = [record.of(key) for key in keys]
    if spec.name != "yarn" or any(rope.rope_type != "yarn" for rope in shipped):
        raise CtxextError(
            f"{spec.name} does not compose with the shipped {record.full.describe()} of multi-head latent attention "
            "(its softmax scale is built from the shipped yarn's factor); use yarn, which extends it as one yarn "
            "over L0, or --replace-shipped"
        )
    C, L0, kept = record.trained_context, record.pretraining_length, shipped[0].parameters
    given = {**{name: kept[name] for name in LATENT_YARN_KEYS if name in kept}, **params}
    how = (
        f"over L0 = {L0} replaces the shipped {shipped[0].describe()} (x{method_params.factor:g} of C = {C}; on "
        "multi-head latent attention yarn extends a shipped yarn as one yarn over L0, not composed with it)"
    )
    return Extension(L0, (), how), spec.make_params(factor=method_params.factor * C / L0, **given)


def _split_query_temperature(record: RopeRecord, keys: tuple, beta: float | None) -> tuple[float | None, float | None]:
    """(beta for the family's own attention, beta for ctxext's wrapper): it goes where the family's own attention
    reads it (Ministral 3's llama_4_scaling_beta), else into ctxext's attention wrapper."""
    native = beta is not None and any(NATIVE_QUERY_TEMPERATURE in record.of(key).parameters for key in keys)
    return (check_query_temperature(beta), None) if native else (None, beta)


def _context_after(written: dict, shipped: tuple, record: RopeRecord, L: int, factor: float) -> int:
    """max_position_embeddings after the patch: L x factor (L where the rope follows the length itself: dynamic),
    and never less than the shipped reach where a shipped scaling stays."""
    new_context = L if follows_length(written) else int(round(L * factor))
    return max(new_context, record.max_position_embeddings) if shipped else new_context


def _split_by_remapped_layers(chosen: tuple, layout: RopeLayout, layers: tuple) -> tuple[tuple, tuple]:
    """(the chosen layer types with a layer a remapping method goes on, the chosen types it leaves as shipped)."""
    remapped = {layout.layer_types[i] for i in layers}
    return tuple(key for key in chosen if key in remapped), tuple(key for key in chosen if key not in remapped)


def _composed_rope_parameters(host: nn.Module, record: RopeRecord, keys: tuple, spec, method_params, L: int) -> dict:
    """{layer type: the rope parameters of the method composed with its shipped scaling} for `keys`
    (ctxext.patching.compose), leaving out a type where composing changes nothing (method none)."""
    written = {
        key: composed_rope_parameters(
            record.of(key),
            spec,
            method_params,
            trained_frequencies(_unpatched_rotary(host), record.of(key)),
            record.trained_context,
            record.pretraining_length,
            int(round(L * method_params.factor)),
        )
        for key in keys
    }
    return {key: values for key, values in written.items() if values is not None}


def follows_length(written: dict) -> bool:
    """Whether the written rope parameters follow the length (a dynamic type). transformers' dynamic update only
    recomputes frequencies past max_position_embeddings, so such a patch keeps L there, and never shortens the
    context it reaches."""
    return any("dynamic" in values["rope_type"] for values in written.values())


def check_not_shorter(plan: PatchPlan, allow_shorter: bool = False) -> None:
    """Refuse, in one line, a patch that leaves the model less context than the trained context C it has now (a
    dynamic method, which grows with the length, never does), unless `allow_shorter`."""
    boolean("allow_shorter", allow_shorter)
    if follows_length(plan.written) or allow_shorter or plan.max_position_embeddings >= plan.record.trained_context:
        return
    raise CtxextError(
        f"{plan.spec.name} x{plan.params.factor:g} from L = {plan.method_length} gives the model "
        f"{plan.max_position_embeddings} tokens of context, shorter than the {plan.record.trained_context} it has "
        f"now ({plan.record.describe()}); drop the explicit L / --replace-shipped to extend from there, or give "
        "--allow-shorter to write it anyway"
    )


def _unpatched_rotary(host: nn.Module) -> nn.Module:
    current = host.rotary_emb
    return current.original if isinstance(current, ScaledRotaryEmbedding) else current


def kept_shipped_frequencies(record: RopeRecord, keys: tuple) -> tuple:
    """The layer types (of `keys`) whose frequencies a remapping method keeps as the model shipped them: those a
    static scaling sets (Llama 3.1's llama3, Gemma 3's linear on its global layers, a yarn). Remapping only moves
    positions, so the model keeps computing exactly what it computed within L; the kept parameters are what the config
    records. Frequencies that follow the length (dynamic, longrope) are not kept: there the method rotates with
    plain RoPE at the base, as it does on a model that shipped none. Frequency methods always replace."""
    return tuple(key for key in keys if record.of(key).static)


def rescale_latent_attention(host: nn.Module, config) -> list:
    """Give each MLA attention module the softmax scale its family computes from `config`'s (new) rope
    parameters, so the model in memory is the one a reload of the saved checkpoint builds; [(module, old scale)]."""
    changed = []
    for layer in host.layers:
        module = attention_of(layer)
        if module is not None and hasattr(module, "qk_head_dim") and hasattr(module, "scaling"):
            changed.append((module, module.scaling))
            module.scaling = latent_attention_scale(config.rope_parameters, module.qk_head_dim)
    return changed


def replace_per_base_rotaries(host: nn.Module, scaled: nn.Module) -> list:
    """Put `scaled` in place of each rotary module the layers read instead of `rotary_emb` (Granite SWA's
    `rotary_embs`, whose one base `rope_layout` has checked is rope_theta); the modules replaced, in order."""
    modules = per_base_rotaries(host)
    if modules is None:
        return []
    replaced = list(modules)
    for index in range(len(modules)):
        modules[index] = scaled
    return replaced


def replace_layer_rotaries(host: nn.Module, scaled: nn.Module) -> list:
    """Put `scaled` in place of each rotary module inside the layers (`families.layer_rotaries`: DeepSeek V4's
    compressors and indexers, which `rope_layout` has checked hold the base model's frequencies), so that every
    rope position the model computes is scaled alike; [(parent, name, the module replaced)] for `unpatch`."""
    replaced = []
    for _, parent, name, module in layer_rotaries(host):
        replaced.append((parent, name, module))
        setattr(parent, name, scaled)
    return replaced


def restore_per_base_rotaries(host: nn.Module, replaced: list) -> None:
    """Undo `replace_per_base_rotaries`."""
    modules = per_base_rotaries(host)
    for index, module in enumerate(replaced):
        modules[index] = module


def check_shape(config, method_params, original_max_position_embeddings: int) -> None:
    """What `patch` refuses about the model's shape, from its config alone (so before any weights load): DPE's
    groups must divide the rotary pairs and its selected pairs exist."""
    if hasattr(method_params, "check_model"):
        method_params.resolved(original_max_position_embeddings).check_model(
            rotary_dim(config), config.num_hidden_layers
        )


def trained_context_of(model: nn.Module) -> int | None:
    """The length a patch counts from by default: the trained context C of the model's rope record (what the model
    serves now; an in-memory patch is looked through, so patching again counts from the same C)."""
    return model_rope_record(model).trained_context


def unpatch(model: nn.Module) -> nn.Module:
    """Undo `patch`: the original rotary module and config values come back, bit for bit. No-op if unpatched."""
    host = rotary_host(model)
    scaled = host.rotary_emb
    if isinstance(scaled, ScaledRotaryEmbedding):
        host.rotary_emb = scaled.original
        undo = scaled.undo
        restore_per_base_rotaries(host, undo.per_base_rotaries)
        for parent, name, module in undo.layer_rotaries:
            setattr(parent, name, module)
        host.config.rope_parameters = undo.rope_parameters
        host.config.max_position_embeddings = undo.max_position_embeddings
        if undo.has_top_level_original_length:
            host.config.original_max_position_embeddings = undo.original_max_position_embeddings
        for module, scale in undo.latent_attention_scales:
            module.scaling = scale
        if undo.source_rope is not None:
            setattr(host.config, SOURCE_KEY, undo.source_rope)
        elif hasattr(host.config, SOURCE_KEY):
            delattr(host.config, SOURCE_KEY)
        saved_attention = undo.attention
        if saved_attention is not None:
            setattr(host.config, CONFIG_KEY, saved_attention)
        elif hasattr(host.config, CONFIG_KEY):
            delattr(host.config, CONFIG_KEY)
        sync_attention_with_config(host)
    return model


def applied_method(model: nn.Module) -> dict | None:
    """What `patch` applied to this model (method, parameters, original length, attention settings), or None.

    A checkpoint of an attention-level method reloads with the model's own rotary (its frequencies are plain) and
    ctxext's attention installed from `ctxext_attention`: that record answers then, with the original length None
    where it does not hold one (a remapping method's L is in the checkpoint's ctxext.yaml)."""
    scaled = rotary_host(model).rotary_emb
    if not isinstance(scaled, ScaledRotaryEmbedding):
        return _recorded_attention_method(model)
    return {
        "method": scaled.method.name,
        "params": scaled.params.to_dict(),
        "original_max_position_embeddings": scaled.original_max_position_embeddings,
        "rope_type": host_rope_type(model),
        "layer_types": [key for key in scaled.scaled if key is not None] or "all",
        "attention": copy.deepcopy(getattr(rotary_host(model).config, CONFIG_KEY, None)),  # log-n, ReRoPE
    }


def _recorded_attention_method(model: nn.Module) -> dict | None:
    """`applied_method` for a model whose rotary is its own: the attention method its config records, or None."""
    config = rotary_host(model).config
    record = copy.deepcopy(getattr(config, CONFIG_KEY, None))
    if not record:
        return None
    settings = AttentionSettings.from_dict({k: v for k, v in record.items() if k != LAYERS_KEY})
    return {
        "method": settings.method or "none",
        "params": dict(settings.params),
        "original_max_position_embeddings": settings.original_max_position_embeddings,
        "rope_type": host_rope_type(model),
        "layer_types": "all",
        "attention": record,
    }


def shipped_rope(model: nn.Module) -> dict:
    """The model's rope as it shipped, an in-memory patch looked through (`record.as_shipped`). ctxext.yaml keeps
    it, so that a check can rebuild the source."""
    return as_shipped(rotary_host(model))


def recorded_rope_parameters(model: nn.Module) -> dict:
    """The rope parameters the model's config records now: after a patch, what `save_pretrained` writes."""
    return copy.deepcopy(dict(rotary_host(model).config.rope_parameters or {}))


def host_rope_type(model: nn.Module) -> str:
    """The rope type the config records: the full-attention layers' one where it is nested by layer type."""
    return rope_parameters_of(rotary_host(model).config)["rope_type"]
