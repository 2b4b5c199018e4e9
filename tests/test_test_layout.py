"""The layout of tests/: test files share code through tests/helpers.py (and tests/family_models.py), never by
importing one another; pytest fixtures come from conftest.py by name; the modules they share skip nothing on
import, so a missing optional dependency skips only the tests that need it."""

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent
SHARED = ("helpers.py", "family_models.py", "conftest.py")


def the_test_files() -> list[Path]:
    return sorted(TESTS.glob("test_*.py"))


def imported_modules(tree: ast.Module) -> list[tuple[int, str]]:
    """(line, dotted module) of every import in `tree`, at any depth; a relative import spelled as from tests."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            module = ("tests." if node.level else "") + (node.module or "")
            if module in ("tests", "tests."):  # from tests import test_x
                found += [(node.lineno, f"tests.{alias.name}") for alias in node.names]
            else:
                found.append((node.lineno, module))
    return found


def is_test_module(module: str) -> bool:
    return module.startswith("tests.test_") or module == "tests.conftest"


def test_no_test_file_imports_another_or_conftest():
    wrong = [
        f"{path.name}:{line} imports {module}"
        for path in the_test_files()
        for line, module in imported_modules(ast.parse(path.read_text()))
        if is_test_module(module)
    ]
    assert wrong == [], "import shared helpers from tests.helpers instead:\n" + "\n".join(wrong)


def test_run_cli_is_defined_once_in_the_helpers():
    defined = [
        f"{path.name}:{node.lineno}"
        for path in sorted(TESTS.glob("*.py"))
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.FunctionDef) and node.name == "run_cli"
    ]
    assert len(defined) == 1 and defined[0].startswith("helpers.py:"), defined


def module_level_skips(tree: ast.Module) -> list[int]:
    """Lines of the pytest.importorskip calls made when the module is imported (not inside a function)."""
    calls = []
    for statement in tree.body:
        if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        for node in ast.walk(statement):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "importorskip":
                calls.append(node.lineno)
    return calls


def test_the_shared_modules_skip_nothing_on_import():
    skips = {name: module_level_skips(ast.parse((TESTS / name).read_text())) for name in SHARED}
    assert skips == {name: [] for name in SHARED}


def test_the_checks_see_what_they_look_for():
    search, finetune, tasks = "test_search", "test_finetune", "test_tasks"  # spelled apart: no real import to grep
    tree = ast.parse(f"from tests.{search} import x\nfrom .{finetune} import y\nfrom tests import {tasks}\n")
    assert [module for _, module in imported_modules(tree)] == [
        f"tests.{search}",
        f"tests.{finetune}",
        f"tests.{tasks}",
    ]
    assert module_level_skips(ast.parse("import pytest\nx = pytest.importorskip('optuna')\n")) == [2]
    assert module_level_skips(ast.parse("def f():\n    pytest.importorskip('optuna')\n")) == []
