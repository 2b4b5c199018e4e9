"""Registering ctxext with transformers without importing transformers at `import ctxext`.

`import ctxext.patching` registers ctxext's rope types (so configs that name them validate and models build)
and the load hook that re-installs log-n/ReRoPE on models built from a ctxext config; `import
ctxext.integrations.hooks`, right after it, wraps PEFT's and transformers' adapter save and load so that an
adapter of a model patched in memory carries the patch (it imports peft, a dependency of ctxext). `import ctxext` must
stay cheap (the CLI's --help imports it), so it calls `install()`, which imports `ctxext.patching` at once
if transformers' configuration module is already imported, and otherwise puts a finder on `sys.meta_path`
that does it right after transformers imports it. That keeps the contract that after `import ctxext`, plain
`AutoModelForCausalLM.from_pretrained` loads a ctxext checkpoint.

The import waits until no transformers, PEFT or ctxext module is half-imported (the finder sees each of them
finish): importing `ctxext.patching` in the middle of, say, `transformers.modeling_utils` importing its
config module would find names that are not defined yet.
"""

from __future__ import annotations

import sys
from importlib.abc import Loader, MetaPathFinder

from .compat import module_is_initializing

TRIGGER = "transformers.configuration_utils"  # every config and model class imports it
# imported in this order: the rope types and load hook, then the PEFT/transformers adapter hooks (an adapter
# saved from a patched model carries the patch, and loading it applies it: ctxext.integrations.adapters)
TARGETS = ("ctxext.patching", "ctxext.integrations.hooks")
WATCHED = ("transformers", "peft", "ctxext")  # peft: the adapter hooks import it, so never while it is half-imported


def _watched(name: str) -> bool:
    return name.partition(".")[0] in WATCHED


def _ready(just_loaded: str | None) -> bool:
    """transformers' config module is loaded and no transformers/ctxext module is still being imported."""
    if TRIGGER not in sys.modules:
        return False
    return not any(
        _watched(name) and name not in (just_loaded, "ctxext") and module_is_initializing(module)
        for name, module in list(sys.modules.items())
    )


class _Registrar(MetaPathFinder):
    """Watches transformers and ctxext modules being imported; imports ctxext.patching once it is safe."""

    def __init__(self):
        self.busy = False

    def find_spec(self, name, path, target=None):
        if not _watched(name) or self.busy:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _ThenRegister(spec.loader, name, self)
        return spec

    def after(self, name: str | None) -> None:
        if self.busy or not _ready(name):
            return
        self.busy = True
        try:
            for target in TARGETS:
                __import__(target)  # registers the rope types and the load hook, then the adapter hooks
        finally:
            self.busy = False
        uninstall()


class _ThenRegister(Loader):
    """The module's own loader, then `registrar.after(name)`; the module keeps its own loader."""

    def __init__(self, loader, name: str, registrar: _Registrar):
        self.loader, self.name, self.registrar = loader, name, registrar

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        module.__loader__ = module.__spec__.loader = self.loader
        self.loader.exec_module(module)
        if not registered():
            self.registrar.after(self.name)
        else:
            uninstall()  # each target registers itself when imported

    def __getattr__(self, attribute):
        return getattr(self.loader, attribute)


def install() -> None:
    """Register now if transformers is ready, else once it is (idempotent)."""
    if registered() or any(isinstance(f, _Registrar) for f in sys.meta_path):
        return
    registrar = _Registrar()
    sys.meta_path.insert(0, registrar)
    registrar.after(None)


def registered() -> bool:
    return all(target in sys.modules for target in TARGETS)


def uninstall() -> None:
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _Registrar)]
