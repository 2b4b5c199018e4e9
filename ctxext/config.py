"""Method configs: YAML files and CLI flags -> a validated `MethodConfig` -> `patch(model, ...)`.

A method YAML is a flat mapping (see configs/methods/*.yaml):

    method: yarn
    factor: 4
    target_length: 262144                     # optional, instead of factor: the context to reach, in tokens
    original_max_position_embeddings: 4096   # optional: count from this L and replace a shipped scaling
    replace_shipped: true                     # optional: replace a shipped scaling, counting from L0
    allow_shorter: true                       # optional: allow a context shorter than the model's trained one
    beta_fast: 32                             # any parameter of the method
    logn: true                                # optional: log-n query scaling on top (any method)
    layer_types: full                         # optional: which layer types to scale (full, all, or names)
    query_temperature: 0.1                    # optional: q *= 1 + beta ln(1 + floor(p / L)) (Llama 4 style)

Flags given on the command line override keys from the file. Importing this module is cheap (no torch): the
CLI reads flag values with `parse_value` before it knows whether a model will be loaded.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from .errors import CtxextError, did_you_mean
from .eval.options import parse_length
from .validate import boolean, whole_number

TOP_LEVEL_KEYS = (
    "method",
    "factor",
    "original_max_position_embeddings",
    "logn",
    "layer_types",
    "mrope_sections",
    "query_temperature",
    "replace_shipped",
    "target_length",
    "allow_shorter",
)
# The keys that say where the extension counts from (ctxext.patching.compose), passed to patch as they are.
EXTENSION_KEYS = ("replace_shipped", "target_length", "allow_shorter")


@dataclass
class MethodConfig:
    """What to apply to a model: a method, its scale, the original length and the method's parameters."""

    method: str = "none"
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    params: dict[str, Any] = field(default_factory=dict)
    logn: bool = False  # log-n query scaling, max(1, ln n / ln L), on top of the method
    # Which layer types a model with one set of frequencies per type has scaled: None (= "full"), "all", or
    # names such as "full_attention,sliding_attention" (see ctxext.patching.families.RopeLayout)
    layer_types: str | None = None
    # On multimodal RoPE (Qwen2-VL, ...): the position sections whose pairs the method scales, e.g. "temporal";
    # None scales every pair (see ctxext.patching.mrope_axes)
    mrope_sections: str | list | None = None
    query_temperature: float | None = None  # beta of q *= 1 + beta ln(1 + floor(p / L)), on top of the method
    # Where the extension counts from (ctxext.patching.compose): by default s times the model's trained context C,
    # composed with a shipped scaling. `target_length` N gives s = N / C; `replace_shipped` counts from L0 and
    # replaces the shipped scaling; `allow_shorter` lets a patch leave a context shorter than C.
    replace_shipped: bool = False
    target_length: int | None = None
    allow_shorter: bool = False

    def validate(self) -> MethodConfig:
        """Raise a CtxextError for anything `patch` would reject, before any model is loaded."""
        from .methods import get_method  # noqa: PLC0415 -- torch stays out of --help
        from .methods.attention import check_original_length_for_logn, check_query_temperature  # noqa: PLC0415 -- torch stays out of --help

        spec = get_method(self.method)
        spec.make_params(factor=self.factor, **self.params)
        boolean("logn", self.logn)
        # 4096.0 (YAML, or 4e3 on the command line) is 4096, as patch() reads it.
        self.original_max_position_embeddings = whole_number(
            "original_max_position_embeddings", self.original_max_position_embeddings, allow_none=True
        )
        boolean("replace_shipped", self.replace_shipped)
        boolean("allow_shorter", self.allow_shorter)
        if isinstance(self.target_length, str):  # '256k', as every length flag takes it
            self.target_length = parse_length(self.target_length, "target_length")
        self.target_length = whole_number("target_length", self.target_length, allow_none=True)
        if self.logn and self.original_max_position_embeddings is not None:
            check_original_length_for_logn(self.original_max_position_embeddings)
        if self.query_temperature is not None:
            check_query_temperature(self.query_temperature)
        if self.mrope_sections is not None:
            from .patching.mrope_axes import parse_sections  # noqa: PLC0415 -- torch stays out of --help

            parse_sections(self.mrope_sections)
        if self.layer_types is not None and not (isinstance(self.layer_types, str) and self.layer_types.strip()):
            raise CtxextError(
                f"layer_types must be full, all, or layer type names separated by commas, got {self.layer_types!r}"
            )
        return self

    def apply(self, model, planned=None):
        """Patch `model` with this config; `planned`: what `plan` returned for it on this model or on a meta-device
        skeleton of its config, carried out instead of planned again."""
        from .patching import patch  # noqa: PLC0415 -- torch stays out of --help

        return patch(
            model,
            self.method,
            factor=self.factor,
            original_max_position_embeddings=self.original_max_position_embeddings,
            logn=self.logn,
            layer_types=self.layer_types,
            query_temperature=self.query_temperature,
            planned=planned,
            **self.extension,
            **self.sections,
            **self.params,
        )

    def plan(self, model):
        """What `patch` would decide for this config on `model` (ctxext.patching.patch.PatchPlan), changing nothing,
        or its one-line refusal; a shorter context is not refused here (`check_not_shorter` is the caller's)."""
        from .patching.patch import plan_patch  # noqa: PLC0415 -- torch stays out of --help

        return plan_patch(
            model,
            self.method,
            self.factor,
            self.original_max_position_embeddings,
            self.logn,
            self.layer_types,
            self.query_temperature,
            replace_shipped=self.replace_shipped,
            target_length=self.target_length,
            **self.sections,
            **self.params,
        )

    @property
    def sections(self) -> dict:
        """`mrope_sections` as `patch` takes it, where set."""
        return {} if self.mrope_sections is None else {"mrope_sections": self.mrope_sections}

    @property
    def extension(self) -> dict:
        """The keys that say where the extension counts from, as `patch` takes them (only those set)."""
        return {key: getattr(self, key) for key in EXTENSION_KEYS if getattr(self, key) not in (None, False)}

    def to_dict(self) -> dict[str, Any]:
        """The flat YAML form (the same shape `from_mapping` reads)."""
        out = {"method": self.method, "factor": self.factor}
        if self.original_max_position_embeddings is not None:
            out["original_max_position_embeddings"] = self.original_max_position_embeddings
        if self.logn:
            out["logn"] = True
        if self.layer_types is not None:
            out["layer_types"] = self.layer_types
        if self.query_temperature is not None:
            out["query_temperature"] = self.query_temperature
        return {**out, **self.sections, **self.extension, **self.params}

    @property
    def label(self) -> str:
        """A short name for tables and plots, e.g. 'yarn x4', 'ntk_mixed x4 +logn', 'rerope w512', 'self_extend G4 w1024'."""
        from .methods import get_method  # noqa: PLC0415 -- torch stays out of --help
        from .methods.remapping import RemapParams  # noqa: PLC0415 -- torch stays out of --help

        params = get_method(self.method).make_params(factor=self.factor, **self.params)
        if isinstance(params, RemapParams):  # no scale: name the settings, e.g. the window
            name = f"{self.method} {params.describe()}".strip()
        else:
            name = self.method if self.method == "none" else f"{self.method} x{self.factor:g}"
            if self.target_length is not None:
                name = f"{self.method} to {self.target_length}"
        if self.mrope_sections is not None:
            sections = self.mrope_sections if isinstance(self.mrope_sections, str) else ",".join(self.mrope_sections)
            name = f"{name} on {sections}"
        name = f"{name} +logn" if self.logn else name
        return name if self.query_temperature is None else f"{name} +qt{self.query_temperature:g}"

    @classmethod
    def from_mapping(cls, mapping: dict[str, Any], source: str | None = None) -> MethodConfig:
        """Validate a flat mapping; `source` (e.g. the YAML path) prefixes error messages."""
        try:
            return cls._from_mapping(mapping)
        except CtxextError as error:
            raise CtxextError(f"{source}: {error}" if source else str(error)) from None

    @classmethod
    def _from_mapping(cls, mapping: dict[str, Any]) -> MethodConfig:
        if not isinstance(mapping, dict):
            raise CtxextError(f"a method config must be a mapping of keys to values, got {type(mapping).__name__}")
        values = dict(mapping)
        method = values.pop("method", "none")
        if not isinstance(method, str):
            raise CtxextError(f"'method' must be a method name, got {method!r}")
        from .methods import get_method  # noqa: PLC0415 -- torch stays out of --help

        spec = get_method(method)
        allowed = list(TOP_LEVEL_KEYS) + [f.name for f in dataclasses.fields(spec.params_cls) if f.name != "factor"]
        for key in values:
            if key not in allowed:
                raise CtxextError(f"unknown key '{key}' for method '{method}'{did_you_mean(key, allowed)}")
        config = cls(
            method=method,
            factor=values.pop("factor", 1.0),
            original_max_position_embeddings=values.pop("original_max_position_embeddings", None),
            logn=values.pop("logn", False),
            layer_types=values.pop("layer_types", None),
            mrope_sections=values.pop("mrope_sections", None),
            query_temperature=values.pop("query_temperature", None),
            replace_shipped=values.pop("replace_shipped", False),
            target_length=values.pop("target_length", None),
            allow_shorter=values.pop("allow_shorter", False),
            params=values,
        )
        return config.validate()


def parse_value(text: str):
    """A flag's or override's value: int, float, or YAML (true/false, lists); '1e6' is a float here, unlike in
    YAML 1.1."""
    for convert in (int, float):
        try:
            return convert(text)
        except ValueError:
            pass
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def read_yaml_mapping(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise CtxextError(f"config file '{path}' does not exist")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        raise CtxextError(f"config file '{path}' is not valid YAML{where}") from None
    if not isinstance(data, dict):
        raise CtxextError(f"config file '{path}' must be a YAML mapping of keys to values, got {type(data).__name__}")
    return data


def load_method_config(path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> MethodConfig:
    """Read a method YAML (optional) and apply overrides (from CLI flags); validated."""
    mapping = read_yaml_mapping(path) if path is not None else {}
    source = f"config file '{path}'" if path is not None else None
    return MethodConfig.from_mapping({**mapping, **(overrides or {})}, source=source)
