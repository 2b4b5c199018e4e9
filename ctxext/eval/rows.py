"""Method flags, a method YAML or a sweep YAML -> the rows of an evaluation (`EvalMethod`s), in one place.

`ctxext eval`, `ctxext passkey`, `ctxext tasks` and the `evaluate` module all build their rows here, so a
loaded checkpoint means the same thing everywhere: a dynamic rope type is computed statelessly (each forward at
its own length, see `ctxext.patching.rope_types.stateless_method_for`), a scaled checkpoint's recorded
pre-training length is the L every method scales from, and `none` on a plain checkpoint is the model as loaded.
The command line validates the flags with `MethodSelection.mappings` before any model loads.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field

from ..config import TOP_LEVEL_KEYS, MethodConfig, read_yaml_mapping
from ..errors import CtxextError, did_you_mean
from ..methods import METHODS, get_method
from ..methods.remapping import DpeParams, RemapParams
from ..patching import rotary_host, unpatch
from ..patching.attention import installed_settings, set_attention_tuning
from ..patching.record import RopeRecord, rope_record
from ..patching.rope_types import stateless_method_for

AS_LOADED = {"method": "none", "as_loaded": True}


@dataclass
class EvalMethod:
    """A row of the results: a MethodConfig to patch in, or None for the model exactly as loaded.

    `check(model, config)`, when given, runs before the config is patched in and may raise (a search uses it to
    turn parameters the model rejects into an invalid trial); it plays no part in what the row computes, and
    neither does `kept_keys` (False: an attention-level method keeps no rotated keys in the cache between decode
    steps, `ctxext.patching.attention.set_attention_tuning`)."""

    label: str
    config: object | None = None  # ctxext.config.MethodConfig
    description: dict = field(default_factory=dict)
    check: Callable[[object, object], None] | None = field(default=None, compare=False, repr=False)
    kept_keys: bool = field(default=True, compare=False)

    def apply(self, model) -> None:
        if self.config is None:
            unpatch(model)
        else:
            if self.check is not None:
                self.check(model, self.config)
            self.config.apply(model)
        if not self.kept_keys and installed_settings(rotary_host(model)) is not None:
            set_attention_tuning(model, keep_keys=False)

    def remove(self, model) -> None:
        unpatch(model)

    def record(self, model) -> dict:
        """The row as results.json records it: its label and description, and, where the row patches a method in,
        `method_length`: the L the method counts from on `model` (PatchPlan.method_length: the trained context C,
        the pre-training length L0 where the shipped scaling is replaced, or the L given); left out where the patch
        cannot be planned."""
        record = {"label": self.label, **self.description}
        if self.config is not None:
            with contextlib.suppress(CtxextError):
                record["method_length"] = self.config.plan(model).method_length
        return record


@dataclass
class MethodSelection:
    """Which methods to evaluate: --method names (repeatable), a method or sweep YAML (`methods:`), parameter
    flags applied to every method that has them, and whether to add the `none` baseline. No method at all:
    the model as loaded."""

    methods: list[str] | None = None
    config: str | None = None
    overrides: dict = field(default_factory=dict)
    baseline: bool = True

    @property
    def source(self) -> str | None:
        return f"config file '{self.config}'" if self.config else None

    def mappings(self) -> list[dict] | None:
        """One validated flat mapping per method asked for (None: none asked for); an unknown method or key
        fails here, before any model is loaded."""
        base, entries = self._config_entries()
        if entries is None:
            if self.methods:
                entries = [{"method": m} for m in self.methods]
            elif self.config is not None:
                entries = [{}]
        if entries is None:
            if self.overrides:
                raise CtxextError(f"--{next(iter(self.overrides)).replace('_', '-')} needs a --method or --config")
            return None
        mappings = [{**base, **entry} for entry in entries]
        apply_overrides(mappings, self.overrides)
        for mapping in mappings:
            MethodConfig.from_mapping(mapping, source=self.source)
        return mappings

    def _config_entries(self) -> tuple[dict, list[dict] | None]:
        """(keys shared by every method, the sweep's entries or None) from the YAML, if any."""
        if self.config is None:
            return {}, None
        data = read_yaml_mapping(self.config)
        if "methods" not in data:
            return data, None
        entries = data.pop("methods")
        if not isinstance(entries, list) or not entries:
            raise CtxextError(f"config file '{self.config}': 'methods' must be a non-empty list")
        entries = [{"method": e} if isinstance(e, str) else e for e in entries]
        if any(not isinstance(e, dict) for e in entries):
            raise CtxextError(f"config file '{self.config}': each entry of 'methods' must be a name or a mapping")
        if self.methods:
            raise CtxextError("give the methods either in the sweep YAML ('methods:') or with --method, not both")
        return data, entries


def apply_overrides(mappings: list[dict], overrides: dict) -> None:
    """Set each flag on every mapping whose method has that key; a flag no method has is an error."""
    for key, value in overrides.items():
        used = False
        for mapping in mappings:
            spec = get_method(mapping.get("method", "none"))
            if key in TOP_LEVEL_KEYS or key in [f.name for f in dataclasses.fields(spec.params_cls)]:
                mapping[key] = value
                used = True
        if not used:
            methods = ", ".join(m.get("method", "none") for m in mappings)
            every = sorted(
                {f.name.replace("_", "-") for m in METHODS.values() for f in dataclasses.fields(m.params_cls)}
            )
            name = key.replace("_", "-")
            raise CtxextError(f"none of the methods ({methods}) has a parameter '{name}'{did_you_mean(name, every)}")


# ------------------------------------------------------------------------------------------------- rows
def shipped_record(model_config) -> RopeRecord | None:
    """The model's rope record, built once per set of rows, or None for a model without RoPE (evaluated as
    loaded)."""
    try:
        return rope_record(model_config)
    except CtxextError:
        return None


def _is_plain(record: RopeRecord | None) -> bool:
    return record is None or not record.shipped_scaling


def as_loaded_row(record: RopeRecord | None) -> EvalMethod:
    """The model as loaded; a dynamic rope type through its stateless ctxext method (the same numbers whatever
    order the windows come in)."""
    if _is_plain(record):
        return EvalMethod("none", None, dict(AS_LOADED))
    rope = dict(record.full.parameters)
    factor = rope.get("factor")
    label = f"as loaded ({rope.get('rope_type')}{f' x{factor:g}' if factor else ''})"
    stateless = stateless_method_for(rope)
    if stateless is None:
        return EvalMethod(label, None, {"as_loaded": True, "rope_parameters": rope})
    name, params = stateless
    L0 = record.pretraining_length
    config = MethodConfig.from_mapping({"method": name, **params, "original_max_position_embeddings": L0})
    return EvalMethod(label, config, {"as_loaded": True, "rope_parameters": rope, "computed_as": config.to_dict()})


def mapping_row(mapping: dict, record: RopeRecord | None, source: str | None = None) -> EvalMethod:
    """One method mapping as a row; on a model that ships a scaling, the method extends from its trained context C
    as `ctxext patch` does (ctxext.patching.compose)."""
    config = MethodConfig.from_mapping(mapping, source=source)
    if config.method == "none" and _is_plain(record):
        return EvalMethod("none", None, dict(AS_LOADED))
    return EvalMethod(config.label, config, config.to_dict())


def baseline_row(record: RopeRecord | None) -> EvalMethod:
    """Plain RoPE: the model as loaded when it is plain, else `none` patched in."""
    if _is_plain(record):
        return EvalMethod("none", None, dict(AS_LOADED))
    plain = MethodConfig("none", replace_shipped=True, allow_shorter=True)  # the shipped scaling replaced by none
    return EvalMethod("none", plain, plain.to_dict())


def method_rows(selection: MethodSelection, model_config) -> list[EvalMethod]:
    """The rows in order: the `none` baseline first (unless `selection.baseline` is False), then the methods
    asked for (the model as loaded when none is), with labels that tell every row apart."""
    return rows_for_record(selection, shipped_record(model_config))


def rows_for_record(selection: MethodSelection, record: RopeRecord | None) -> list[EvalMethod]:
    """`method_rows` from the model's rope record, where the caller has built it already."""
    mappings = selection.mappings()
    if mappings is None:
        rows = [as_loaded_row(record)]
    else:
        rows = [mapping_row(mapping, record, selection.source) for mapping in mappings]
    if selection.baseline and not any(row.label == "none" for row in rows):
        rows.insert(0, baseline_row(record))
    distinguish_labels(rows)
    return rows


def beyond_training_notes(
    rows: list[EvalMethod], lengths: list[int], model_trained_context: int | None, wavelengths: list | None = None
) -> list[str]:
    """One line per row whose method is meant to keep relative positions below L but, as set, uses a larger one
    at some of `lengths` (e.g. SelfExtend's default G 4 at 8x): what it reaches, and the setting that stays
    below L. DPE moves r' past L on purpose, except on the rotary pairs whose wavelength (`wavelengths`, one per
    pair, in tokens) exceeds L: they saw less than one whole period in training, and are checked alone."""
    notes = []
    for row in rows:
        config = row.config
        L = config and (config.original_max_position_embeddings or model_trained_context)
        if not L:
            continue
        params = get_method(config.method).make_params(factor=config.factor, **config.params)
        if isinstance(params, DpeParams):
            note = _dpe_note(row.label, params.resolved(L), lengths, L, wavelengths) if wavelengths else None
            notes += [note] if note else []
            continue
        if not isinstance(params, RemapParams):
            continue
        past = [n for n in sorted(lengths) if (params.largest_relative_position(n) or 0) > L - 1]
        if past:
            longest = past[-1]
            within = params.setting_within(longest, L)
            notes.append(
                f"note: {row.label} uses relative positions up to {params.largest_relative_position(longest):g} "
                f"at {longest} tokens, past the {L} the model was trained on (at {', '.join(map(str, past))})"
                + (f"; {within} keeps them below {L}" if within else "")
            )
    return notes


def _dpe_note(label: str, params, lengths: list[int], L: int, wavelengths: list) -> str | None:
    slow = [p for p, wavelength in enumerate(wavelengths) if wavelength > L]
    n_pairs = len(wavelengths)
    if n_pairs % len(params.scales):
        return None  # groups that do not divide the pairs: patching the model says so, in one line
    past = [n for n in sorted(lengths) if slow and params.largest_relative_position_on(n, slow, n_pairs) > L - 1]
    if not past:
        return None
    longest = past[-1]
    within = params.setting_within_on(longest, slow, n_pairs, L)
    return (
        f"note: {label} uses relative positions up to {params.largest_relative_position_on(longest, slow, n_pairs):g} "
        f"at {longest} tokens on rotary pairs {slow[0]}-{slow[-1]}, whose wavelengths exceed the {L} the model was "
        f"trained on (at {', '.join(map(str, past))})" + (f"; {within} keeps them below {L}" if within else "")
    )


# ----------------------------------------------------------------------------------------------- labels
def _settings(row: EvalMethod, defaults: bool = False) -> dict:
    """Every setting of a row's method with the defaults resolved (`defaults`: the method's defaults at the
    row's factor instead): what rows of one label can differ in."""
    if row.config is None:
        return {}

    config = row.config
    params = get_method(config.method).make_params(factor=config.factor, **({} if defaults else config.params))
    values = {f.name: getattr(params, f.name) for f in dataclasses.fields(params) if f.name != "factor"}
    original = None if defaults else config.original_max_position_embeddings
    return {"original_max_position_embeddings": original, **values}


def _short(value) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def distinguish_labels(rows: list[EvalMethod]) -> None:
    """Rows that share a label get the settings that set them apart: of the settings that differ between them,
    those a row does not leave at the method's default, e.g. 'yarn x4' (the defaults) and 'yarn x4 beta_fast=16
    beta_slow=2'. Rows that differ in nothing are numbered ('yarn x4 (2)'). A unique label stays as it is."""
    groups: dict[str, list[EvalMethod]] = {}
    for row in rows:
        groups.setdefault(row.label, []).append(row)
    for label, group in groups.items():
        if len(group) < 2:
            continue
        settings = [_settings(row) for row in group]
        keys = list(dict.fromkeys(k for s in settings for k in s))
        differing = [k for k in keys if len({repr(s.get(k)) for s in settings}) > 1]
        for row, values in zip(group, settings):
            default = _settings(row, defaults=True)
            shown = [f"{k}={_short(values[k])}" for k in differing if k in values and values[k] != default.get(k)]
            row.label = " ".join([label, *shown])
    seen: dict[str, int] = {}
    for row in rows:
        seen[row.label] = seen.get(row.label, 0) + 1
        if seen[row.label] > 1:
            row.label = f"{row.label} ({seen[row.label]})"
