"""What a search explores: one range per parameter, declared next to the parameter's help or given in a YAML.

A parameters dataclass declares a range with `param(default, help, search=(low, high, *words))`:

    beta_fast: float = param(32.0, "...", search=(4.0, 128.0, "log"))
    window: int = param(512, "...", search=(1 / 32, 1.0, "log", "int", "*L"))

The words are `"log"` (sample on a log scale), `"int"` (whole numbers), `"pow2"` (the powers of two from low to
high, as choices), `"each"` (the parameter is a list: one range per element, named `name[i]`; the element count
is the list given on the command line, else the field's `elements`) and any of `"*factor"`, `"*L"`, `"*base"`
(low and high are multiples of the scale s, the original length L, or the RoPE base b; the words multiply, so
`"*L", "*factor"` makes them shares of the target length s L), so that one declaration fits a 2k model at s=2 and
a 128k target alike. A `--space` YAML overrides them for the parameters it names:

    beta_fast: {low: 8, high: 64, log: true}
    beta_slow: [0.5, 2]                 # [low, high], linear
    window: {low: 256, high: 4096, log: true, int: true}
    ramp: {choices: [index, ratio]}

Importing this module is cheap (no torch): the CLI checks a space before it loads anything.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from typing import Any

from ..errors import CtxextError, did_you_mean

WORDS = ("log", "int", "pow2", "each")
ELEMENT = re.compile(r"^(\w+)\[(\d+)\]$")  # name[i]: element i of a list parameter
SCALES = {"*factor": "factor", "*L": "L", "*base": "base"}


def optuna_module():
    """Optuna, the search extra's library, imported here only: this module, and `--help`, load without it."""
    import optuna  # noqa: PLC0415 -- optional: search
    import optuna.storages.journal  # noqa: PLC0415 -- optional: search

    return optuna


@dataclass(frozen=True)
class Range:
    """One searched parameter: [low, high] (log scale and/or whole numbers), or a list of choices."""

    name: str
    low: float | None = None
    high: float | None = None
    log: bool = False
    integer: bool = False
    choices: tuple | None = None

    def __post_init__(self):
        if self.choices is not None:
            if not self.choices:
                raise CtxextError(f"search range of '{self.name}': 'choices' is empty")
            return
        for bound in ("low", "high"):
            value = getattr(self, bound)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise CtxextError(f"search range of '{self.name}': '{bound}' must be a number, got {value!r}")
        if not self.low < self.high:
            raise CtxextError(
                f"search range of '{self.name}' is empty: low {self.low:g} is not below high {self.high:g}"
            )
        if self.log and self.low <= 0:
            raise CtxextError(f"search range of '{self.name}': a log range needs low > 0, got {self.low:g}")
        if self.integer and math.ceil(self.low) > math.floor(self.high):
            raise CtxextError(f"search range of '{self.name}' holds no whole number ({self.low:g} to {self.high:g})")

    def distribution(self):
        """The Optuna distribution of this range."""
        optuna = optuna_module()

        if self.choices is not None:
            return optuna.distributions.CategoricalDistribution(list(self.choices))
        if self.integer:
            return optuna.distributions.IntDistribution(math.ceil(self.low), math.floor(self.high), log=self.log)
        return optuna.distributions.FloatDistribution(float(self.low), float(self.high), log=self.log)

    def contains(self, value) -> bool:
        if self.choices is not None:
            return value in self.choices
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return False
        if self.integer and int(value) != value:
            return False
        return self.low <= value <= self.high

    def to_dict(self) -> dict[str, Any]:
        if self.choices is not None:
            return {"choices": list(self.choices)}
        low, high = (math.ceil(self.low), math.floor(self.high)) if self.integer else (self.low, self.high)
        return {"low": low, "high": high, "log": self.log, "int": self.integer}

    def describe(self) -> str:
        if self.choices is not None:
            return "{" + ", ".join(map(str, self.choices)) + "}"
        low, high = (self.to_dict()[k] for k in ("low", "high"))
        return f"[{low:g}, {high:g}]" + (" log" if self.log else "") + (" int" if self.integer else "")


def declared_range(field: dataclasses.Field, scales: dict[str, float]) -> Range | None:
    """The range a parameter declares (`search=` in its `param(...)`), resolved for s, L and b; None without one."""
    spec = field.metadata.get("search")
    if spec is None:
        return None
    if not isinstance(spec, tuple) or len(spec) < 2:
        raise CtxextError(f"parameter '{field.name}' declares search={spec!r}; expected (low, high, *words)")
    low, high, *words = spec
    unknown = [w for w in words if w not in WORDS and w not in SCALES]
    if unknown:
        raise CtxextError(
            f"parameter '{field.name}' declares unknown search words {unknown}; use {', '.join(WORDS + tuple(SCALES))}"
        )
    multiplier = 1.0
    for word in words:
        if word in SCALES:
            multiplier *= scales[SCALES[word]]
    low, high = low * multiplier, high * multiplier
    if "pow2" in words:
        return Range(
            field.name, choices=tuple(2**k for k in range(math.ceil(math.log2(low)), math.floor(math.log2(high)) + 1))
        )
    return Range(field.name, low, high, log="log" in words, integer="int" in words)


def per_element(ranges: list[Range], fields: dict, counts: dict[str, int]) -> list[Range]:
    """A list parameter's range ("each") as one range per element, `name[i]`."""
    out = []
    for r in ranges:
        field_ = fields.get(r.name)
        if field_ is None or "each" not in (field_.metadata.get("search") or ()):
            out.append(r)
            continue
        count = counts.get(r.name, field_.metadata.get("elements"))
        out += [dataclasses.replace(r, name=f"{r.name}[{i}]") for i in range(count)]
    return out


def element_default(method, name: str):
    """The default of `name`, or of element i of a list parameter for `name[i]` (the field's element_default)."""
    found = ELEMENT.match(name)
    fields = {f.name: f for f in dataclasses.fields(method.params_cls)}
    if found is None:
        return fields[name].default
    return fields[found[1]].metadata.get("element_default")


def collapse_elements(params: dict) -> dict:
    """{'g[0]': 2, 'g[1]': 8, 'w': 5, 'k': None} -> {'g': [2, 8], 'w': 5}: a trial's element values back into
    lists, leaving out the parameters it keeps at the method's default (None)."""
    out, lists = {}, {}
    for key, value in params.items():
        if value is None:
            continue
        found = ELEMENT.match(key)
        if found is None:
            out[key] = value
        else:
            lists.setdefault(found[1], {})[int(found[2])] = value
    for name, items in lists.items():
        out[name] = [items[i] for i in sorted(items)]
    return out


def searchable_fields(method) -> dict[str, dataclasses.Field]:
    """The parameters of a method a search may vary: all but `factor` (given) and the method's forced values."""
    return {
        f.name: f for f in dataclasses.fields(method.params_cls) if f.name != "factor" and f.name not in method.forced
    }


def build_space(
    method,
    scales: dict[str, float],
    names: list[str] | None = None,
    space: dict[str, Any] | None = None,
    source: str = "--space",
    counts: dict[str, int] | None = None,
) -> list[Range]:
    """The ranges to search: `space` (a --space mapping) if given, else the declared ranges of `names` (default:
    every parameter that declares one); a list parameter becomes one range per element (`counts` of them where
    given). A one-line CtxextError for an unknown name, an undeclared or empty range."""
    fields = searchable_fields(method)
    if space is not None:
        if not isinstance(space, dict) or not space:
            raise CtxextError(f"{source} must be a non-empty mapping of parameter names to ranges")
        ranges = [parse_range(name, spec, fields, method.name, source) for name, spec in space.items()]
    else:
        if names is None:
            names = [name for name, f in fields.items() if "search" in f.metadata]
            if not names:
                raise CtxextError(
                    f"method '{method.name}' has no parameter to search (its parameters: "
                    f"{', '.join(fields) or 'none besides factor'})"
                )
        ranges = []
        for name in names:
            _check_known(name, fields, method.name, "--params")
            declared = declared_range(fields[name], scales)
            if declared is None:
                raise CtxextError(
                    f"parameter '{name}' of '{method.name}' declares no search range; give one in a "
                    f"--space YAML, e.g. '{name}: {{low: 1, high: 10}}'"
                )
            ranges.append(declared)
    if len({r.name for r in ranges}) != len(ranges):
        raise CtxextError("each parameter may be searched once; --params names one twice")
    return per_element(ranges, fields, counts or {})


def _check_known(name: str, fields: dict, method_name: str, source: str) -> None:
    if name not in fields:
        raise CtxextError(
            f"{source}: method '{method_name}' has no searchable parameter '{name}'"
            f"{did_you_mean(name, fields)}; its parameters are: {', '.join(fields) or 'none'}"
        )


def parse_range(name: str, spec: Any, fields: dict, method_name: str, source: str = "--space") -> Range:
    """One entry of a --space mapping: [low, high], {low, high, log, int} or {choices: [...]}."""
    _check_known(name, fields, method_name, source)
    if isinstance(spec, (list, tuple)):
        if len(spec) != 2:
            raise CtxextError(f"{source}: '{name}' must be [low, high] or a mapping with low/high, got {spec!r}")
        return Range(name, spec[0], spec[1])
    if not isinstance(spec, dict):
        raise CtxextError(f"{source}: '{name}' must be [low, high] or a mapping with low/high, got {spec!r}")
    allowed = ("low", "high", "log", "int", "choices")
    for key in spec:
        if key not in allowed:
            raise CtxextError(f"{source}: '{name}' has an unknown key '{key}'{did_you_mean(key, allowed)}")
    if "choices" in spec:
        if set(spec) != {"choices"} or not isinstance(spec["choices"], list):
            raise CtxextError(f"{source}: '{name}': 'choices' must be a list and stand alone")
        return Range(name, choices=tuple(spec["choices"]))
    if "low" not in spec or "high" not in spec:
        raise CtxextError(f"{source}: '{name}' needs both 'low' and 'high'")
    for flag in ("log", "int"):
        if not isinstance(spec.get(flag, False), bool):
            raise CtxextError(f"{source}: '{name}': '{flag}' must be true or false")
    return Range(name, spec["low"], spec["high"], log=spec.get("log", False), integer=spec.get("int", False))


def parse_param_names(text: str) -> list[str]:
    names = [n.strip() for n in str(text).split(",") if n.strip()]
    if not names:
        raise CtxextError(f"--params must be a comma-separated list of parameter names, got '{text}'")
    return names
