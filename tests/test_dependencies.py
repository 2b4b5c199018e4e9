"""pyproject.toml declares what ctxext needs: every distribution its code, tests and notebook import (found by
reading their import statements), what it needs without an import, and versions new enough for what it uses."""

import ast
import json
import re
import sys
from importlib.metadata import packages_distributions
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

REPO = Path(__file__).resolve().parents[1]
# Modules of optional features, and the extra that installs them.
OPTIONAL_IMPORTS = {
    "lm_eval": "tasks",
    "evaluate": "tasks",
    "optuna": "search",
    "cma": "search",
    "sqlalchemy": "search",
    "llama_cpp": "llamacpp",
    "deepspeed": "deepspeed",
    "fastapi": "serve",  # ctxext/request_checks.py: the OpenAI-shaped error response of `ctxext serve`
}
# Optional modules the test extra does not install (llama-cpp-python compiles llama.cpp): module -> distribution.
NOT_INSTALLED_BY_TESTS = {"llama_cpp": "llama-cpp-python"}
# Serving engines whose own rotary code `ctxext export --check` runs where the user has them installed: what is
# judged, never a dependency (GPU builds of several GB; benchmarks/engine_parity.py fetches their wheels).
JUDGED_ENGINES = {"vllm", "sglang"}
# Trainers ctxext has a plugin for, installed in their own environment where used (axolotl 0.19 pins transformers
# 5.16.1): never a dependency; ctxext.integrations.axolotl imports without it and its tests skip. File -> the
# modules it takes from that environment (pydantic: axolotl's own dependency, for its config schema).
HOST_TRAINERS = {"ctxext/integrations/axolotl.py": {"axolotl", "pydantic"}, "tests/test_axolotl.py": {"axolotl"}}
# Needed with no import statement in ctxext: distribution -> why.
NEEDED_WITHOUT_IMPORT = {"gguf": "ctxext.assets converts SmolLM2's GGUF file with transformers, which needs gguf"}
# (distribution, what ctxext uses, the first version that has it)
MINIMUM_VERSIONS = [("peft", "ensure_weight_tying", "0.18")]


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def declared() -> tuple[dict[str, Requirement], dict[str, dict[str, Requirement]]]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    as_map = lambda items: {normalize(r.name): r for r in map(Requirement, items)}  # noqa: E731
    return as_map(project["dependencies"]), {k: as_map(v) for k, v in project["optional-dependencies"].items()}


def imported_distributions(paths) -> dict[str, set[str]]:
    """distribution -> top-level modules imported from it by the files (stdlib and ctxext left out)."""
    owners = packages_distributions()
    found: dict[str, set[str]] = {}
    for path in paths:
        if path.suffix == ".ipynb":
            cells = [c["source"] for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code"]
            sources = [
                "\n".join(line for line in "".join(cell).splitlines() if not line.lstrip().startswith("%"))
                for cell in cells
            ]
        else:
            sources = [path.read_text()]
        for source in sources:
            for node in ast.walk(ast.parse(source)):
                if isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0:
                    names = [node.module]
                else:
                    continue
                for top in {name.split(".")[0] for name in names}:
                    if top in sys.stdlib_module_names or top in ("ctxext", "tests", "benchmarks", "__future__"):
                        continue
                    if top in JUDGED_ENGINES or top in HOST_TRAINERS.get(path.relative_to(REPO).as_posix(), ()):
                        continue
                    if top not in owners and top in NOT_INSTALLED_BY_TESTS:
                        found.setdefault(normalize(NOT_INSTALLED_BY_TESTS[top]), set()).add(top)
                        continue
                    assert top in owners, f"{path}: no installed distribution provides '{top}'"
                    for dist in owners[top]:
                        found.setdefault(normalize(dist), set()).add(top)
    return found


def test_everything_ctxext_imports_is_a_dependency():
    core, extras = declared()
    for dist, modules in imported_distributions(sorted((REPO / "ctxext").rglob("*.py"))).items():
        extra = {OPTIONAL_IMPORTS.get(m) for m in modules} - {None}
        if extra:
            assert all(dist in extras[name] for name in extra), (dist, extra)
        else:
            assert dist in core, f"ctxext imports {sorted(modules)} ('{dist}'), which pyproject does not declare"
    for dist, why in NEEDED_WITHOUT_IMPORT.items():
        assert dist in core, why


def test_everything_the_tests_and_notebook_import_is_installed_by_the_test_extra():
    core, extras = declared()
    files = sorted((REPO / "tests").rglob("*.py")) + sorted((REPO / "notebooks").rglob("*.ipynb"))
    for dist, modules in imported_distributions(files).items():
        assert dist in core or dist in extras["test"], f"the tests import {sorted(modules)} ('{dist}')"


def test_declared_versions_have_what_ctxext_uses():
    core, _ = declared()
    source = "\n".join(p.read_text() for p in (REPO / "ctxext").rglob("*.py"))
    for dist, feature, first in MINIMUM_VERSIONS:
        assert feature in source, f"ctxext no longer uses {feature}: drop it from MINIMUM_VERSIONS"
        lower = [Version(s.version) for s in core[dist].specifier if s.operator in (">=", "==", "~=", ">")]
        assert lower and max(lower) >= Version(first), f"{feature} needs {dist} >= {first}; pyproject says {core[dist]}"
