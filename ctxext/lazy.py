"""Packages whose public names are imported on first use, so that importing the package stays cheap."""

from __future__ import annotations

import importlib


def lazy_exports(package: str, exports: dict[str, str]):
    """`__getattr__` and `__dir__` for `package` whose names live in the modules `exports` maps them to (absolute,
    or relative to `package` when they start with a dot), imported when first asked for."""
    namespace = importlib.import_module(package).__dict__  # the package being initialised

    def __getattr__(name: str):
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(exports[name], package), name)

    def __dir__():
        return sorted(set(namespace) | set(exports))

    return __getattr__, __dir__
