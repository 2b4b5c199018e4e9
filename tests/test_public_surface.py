"""The public surface by intent: each package's `__all__` names what users are meant to import from it, the
documentation imports only from there, and code that imports a name from a package (not from one of its modules)
finds it in that package's `__all__`."""

import ast
import importlib
import re
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "ctxext"
FENCE = re.compile(r"^(?P<indent>\s*)```(?P<lang>[A-Za-z0-9_-]*)\s*$")


def package_names() -> list[str]:
    return sorted(".".join(p.parent.relative_to(REPO).parts) for p in PACKAGE.rglob("__init__.py"))


def documentation_files() -> list[Path]:
    top = [REPO / name for name in ("README.md", "CONTRIBUTING.md", "BENCHMARKS.md")]
    return [path for path in top if path.exists()] + sorted((REPO / "docs").rglob("*.md"))


def python_blocks(text: str) -> list[tuple[int, str]]:
    """(first line, code) of each fenced ```python block, indented ones (in a list item) too."""
    blocks, lines, start, body = [], text.splitlines(), None, []
    for number, line in enumerate(lines, 1):
        fence = FENCE.match(line)
        if start is None and fence and fence["lang"] in ("python", "py"):
            start, body = number + 1, []
        elif start is not None and line.strip() == "```":
            blocks.append((start, textwrap.dedent("\n".join(body))))
            start = None
        elif start is not None:
            body.append(line)
    return blocks


def imported_names(source: str, module: str = "", is_package: bool = False) -> list[tuple[int, str, str]]:
    """(line, ctxext module, name) of every `from ctxext... import name` in `source`, relative imports resolved
    against `module` (the importing module's dotted name)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.ImportFrom):
            continue
        if node.level:
            parts = module.split(".")
            parts = parts[: len(parts) - node.level + (1 if is_package else 0)]
            target = ".".join([*parts, *([node.module] if node.module else [])])
        else:
            target = node.module or ""
        if target == "ctxext" or target.startswith("ctxext."):
            found += [(node.lineno, target, alias.name) for alias in node.names]
    return found


def is_package(module: str) -> bool:
    return (REPO.joinpath(*module.split(".")) / "__init__.py").is_file()


def is_submodule(package: str, name: str) -> bool:
    folder = REPO.joinpath(*package.split("."))
    return (folder / f"{name}.py").is_file() or (folder / name / "__init__.py").is_file()


def exported(module: str) -> list[str]:
    return list(importlib.import_module(module).__all__)


def refusals(imports) -> list[str]:
    """Why each (where, module, name) import reaches past the surface; empty when none does."""
    wrong = []
    for where, module, name in imports:
        if not is_package(module):
            wrong.append(f"{where}: from {module} import {name}: {module} is a module, import from its package")
        elif name not in exported(module) and not is_submodule(module, name):
            wrong.append(f"{where}: from {module} import {name}: {name} is not in {module}.__all__")
    return wrong


def documented_imports(path: Path) -> list[tuple[str, str, str]]:
    where = path.relative_to(REPO)
    return [
        (f"{where}:{start + line - 1}", module, name)
        for start, code in python_blocks(path.read_text(encoding="utf-8"))
        for line, module, name in imported_names(code)
    ]


def test_the_documentation_imports_only_what_a_package_exports():
    imports = [found for path in documentation_files() for found in documented_imports(path)]
    assert imports, "no `from ctxext... import` found in the documentation's Python blocks"
    assert refusals(imports) == []


def test_a_documented_import_past_the_surface_is_refused(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "Text.\n\n  ```python\n  from ctxext.patching.rotary import original_rotary_within\n"
        "  from ctxext.patching.attention import ForwardPlan\n  from ctxext.eval import perplexity\n  ```\n"
    )
    found = [
        (f"page.md:{start + line - 1}", module, name)
        for start, code in python_blocks(page.read_text())
        for line, module, name in imported_names(code)
    ]
    assert [where for where, _, _ in found] == ["page.md:4", "page.md:5", "page.md:6"]
    assert refusals(found) == [
        "page.md:4: from ctxext.patching.rotary import original_rotary_within: ctxext.patching.rotary is a module,"
        " import from its package",
        "page.md:5: from ctxext.patching.attention import ForwardPlan: ForwardPlan is not in"
        " ctxext.patching.attention.__all__",
    ]


def test_code_that_imports_from_a_package_finds_the_name_in_its_all():
    """ctxext's own modules, scripts, benchmarks and tests: `from ctxext.pkg import name` is a submodule of pkg
    or in pkg.__all__ (deeper imports, `from ctxext.pkg.module import name`, are not checked)."""
    imports = []
    for folder in ("ctxext", "scripts", "benchmarks", "tests"):
        for path in sorted((REPO / folder).rglob("*.py")):
            parts = path.relative_to(REPO).with_suffix("").parts
            package = parts[-1] == "__init__"
            module = ".".join(parts[:-1] if package else parts)
            where = path.relative_to(REPO)
            imports += [
                (f"{where}:{line}", target, name)
                for line, target, name in imported_names(path.read_text(encoding="utf-8"), module, package)
                if is_package(target)
            ]
    assert refusals(imports) == []


@pytest.mark.parametrize("package", package_names())
def test_each_package_declares_its_all_without_duplicates_and_every_name_exists(package):
    module = importlib.import_module(package)
    assert hasattr(module, "__all__"), f"{package} has no __all__"
    names = list(module.__all__)
    assert len(names) == len(set(names)), (
        f"{package}.__all__ repeats {sorted({n for n in names if names.count(n) > 1})}"
    )
    missing = [name for name in names if not hasattr(module, name)]
    assert missing == [], f"{package}.__all__ names what it does not have"
