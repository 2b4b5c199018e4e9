"""The validators every user-facing value goes through: method parameters, method configs, recipes, patch().

Each returns the value (normalised where it says so) or raises a one-line CtxextError naming the key. One
rule per kind of value, everywhere: a whole number may be written as 4096 or 4096.0 (YAML, `1e3` on the
command line), never as True or 2.5; a number is finite and never a bool.
"""

from __future__ import annotations

import math

from .errors import CtxextError, did_you_mean


def number(
    name: str,
    value,
    *,
    minimum: float | None = None,
    maximum: float | None = None,
    strict: bool = False,
    allow_none: bool = False,
):
    """A finite int or float (not a bool) within [minimum, maximum] ((minimum, ...] with `strict`)."""
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise CtxextError(f"'{name}' must be a number, got {value!r}")
    below = minimum is not None and (value <= minimum if strict else value < minimum)
    above = maximum is not None and value > maximum
    if (below or above) and minimum is not None and maximum is not None and not strict:
        raise CtxextError(f"'{name}' must be between {minimum:g} and {maximum:g}, got {value!r}")
    if below:
        raise CtxextError(f"'{name}' must be {'>' if strict else '>='} {minimum:g}, got {value!r}")
    if above:
        raise CtxextError(f"'{name}' must be <= {maximum:g}, got {value!r}")
    return value


def whole_number(name: str, value, minimum: int | None = 1, allow_none: bool = False) -> int | None:
    """A whole number >= minimum, returned as an int (4096.0 -> 4096)."""
    if value is None and allow_none:
        return None
    number(name, value)
    if int(value) != value:
        raise CtxextError(f"'{name}' must be a whole number, got {value!r}")
    if minimum is not None and value < minimum:
        raise CtxextError(f"'{name}' must be >= {minimum}, got {value!r}")
    return int(value)


def boolean(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise CtxextError(f"'{name}' must be true or false, got {value!r}")
    return value


def choice(name: str, value, choices) -> str:
    if value not in choices:
        raise CtxextError(f"'{name}' must be one of {', '.join(choices)}, got {value!r}{did_you_mean(value, choices)}")
    return value


def string_list(name: str, value) -> list[str]:
    """A list of strings; a single string is a list of one."""
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise CtxextError(f"'{name}' must be a list of strings, got {value!r}")
    return value
