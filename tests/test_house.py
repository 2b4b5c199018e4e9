"""The house rules a maintainer relies on, checked on the source: no function over 60 lines, no import cycle among
ctxext's modules (module-level imports, as Python runs them), and the code map in CONTRIBUTING.md names every
package that exists and nothing that does not. (Imports at the top are ruff's PLC0415, in `make test`'s lint.)"""

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "ctxext"
MAX_FUNCTION_LINES = 60


def modules() -> dict[str, Path]:
    """Dotted name -> file, for every module of the ctxext package."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(REPO).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def function_lengths() -> dict[tuple[str, str], int]:
    return {
        (str(path.relative_to(REPO)), node.name): node.end_lineno - node.lineno + 1
        for path in modules().values()
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
    }


def test_no_function_is_longer_than_60_lines():
    long = sorted(
        f"{path} {name} ({n} lines)" for (path, name), n in function_lengths().items() if n > MAX_FUNCTION_LINES
    )
    assert not long, "functions over 60 lines (def to last line, docstring included): " + "; ".join(long)


def _resolved(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The absolute module an ImportFrom names (`from . import x` in ctxext.a.b -> ctxext.a)."""
    if node.level == 0:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, node.module] if node.module else base)


def _imports(module: str, path: Path, known: set[str], type_checking: bool = False) -> set[str]:
    """ctxext modules `module` depends on: every import in it, at module level or inside a function (a local
    import hides a dependency, it does not remove it), and under `if TYPE_CHECKING:` only if `type_checking`."""
    tree = ast.parse(path.read_text())
    imported = set()
    for node in tree.body:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test) and not type_checking:
            continue
        for sub in ast.walk(node):
            if isinstance(sub, ast.Import):
                imported |= {alias.name for alias in sub.names}
            elif isinstance(sub, ast.ImportFrom):
                target = _resolved(module, path.name == "__init__.py", sub)
                imported.add(target)
                imported |= {f"{target}.{alias.name}" for alias in sub.names}
    return {name for name in imported if name in known and name != module}


def import_graph(type_checking: bool = False) -> dict[str, set[str]]:
    found = modules()
    return {name: _imports(name, path, set(found), type_checking) for name, path in found.items()}


def _cycle_from(start: str, graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle through `start`, as the list of modules along it, or None."""
    stack, seen = [(start, [start])], set()
    while stack:
        node, trail = stack.pop()
        for nxt in graph[node]:
            if nxt == start:
                return [*trail, start]
            if nxt not in seen:
                seen.add(nxt)
                stack.append((nxt, [*trail, nxt]))
    return None


def test_no_import_cycle_among_ctxext_modules():
    graph = import_graph()
    # Left out: a package's edges to its own submodules (Python resolves `from .x import y` in a package's
    # __init__ by the submodule, which may import its siblings through the package), and the root package
    # `ctxext`, a lazy facade whose names load their modules on first use.
    graph = {
        name: {n for n in targets if not n.startswith(name + ".") and n != "ctxext"}
        for name, targets in graph.items()
        if name != "ctxext"
    }
    cycles = {frozenset(cycle) for name in graph if (cycle := _cycle_from(name, graph))}
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(sorted(c)) for c in cycles)


def test_no_circle_among_the_training_modules_even_for_the_type_checker():
    """ctxext.train's modules read the run's state from train/state.py, never from the module that builds it
    (train/setup.py): no circle, even counting the imports under `if TYPE_CHECKING:` a reader sees."""
    graph = {
        name: targets for name, targets in import_graph(type_checking=True).items() if name.startswith("ctxext.train.")
    }
    graph = {name: {n for n in targets if n in graph} for name, targets in graph.items()}
    assert not {frozenset(cycle) for name in graph if (cycle := _cycle_from(name, graph))}


MAX_LOCAL_IMPORTS = 40  # outside ctxext/cli/ (whose modules import what a command runs in its run())


def test_function_local_imports_stay_few():
    """A function-local import is for an optional extra or a module kept out of `--help`; at most 40 outside the
    command modules, counted as the AST holds them."""
    local = [
        f"{path.relative_to(REPO)}:{sub.lineno}"
        for path in modules().values()
        if "cli" not in path.relative_to(PACKAGE).parts
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        for sub in node.body
        for sub in ast.walk(sub)
        if isinstance(sub, (ast.Import, ast.ImportFrom))
    ]
    assert len(set(local)) <= MAX_LOCAL_IMPORTS, f"{len(set(local))} function-local imports: " + ", ".join(
        sorted(set(local))
    )


def test_the_code_map_names_every_package_and_only_existing_paths():
    text = (REPO / "CONTRIBUTING.md").read_text()
    named = set(re.findall(r"`(ctxext/[\w/]*?)/?`", text)) | set(re.findall(r"`(ctxext/[\w/]+\.py)`", text))
    missing = sorted(path for path in named if not (REPO / path).exists())
    assert not missing, f"CONTRIBUTING.md names paths that do not exist: {missing}"
    packages = {str(p.parent.relative_to(REPO)) for p in PACKAGE.rglob("__init__.py")} - {"ctxext"}
    unnamed = sorted(packages - {p.rstrip("/") for p in named})
    assert not unnamed, f"packages the code map in CONTRIBUTING.md does not name: {unnamed}"


def parameters() -> list[tuple[str, str, str, str, ast.expr | None]]:
    """(file:line, function, parameter, its annotation as written, its default) for every parameter of every
    function in ctxext/."""
    found = []
    for path in modules().values():
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            args = node.args
            positional = args.posonlyargs + args.args
            defaults = [None] * (len(positional) - len(args.defaults)) + args.defaults + args.kw_defaults
            for arg, default in zip(positional + args.kwonlyargs, defaults):
                annotation = ast.unparse(arg.annotation) if arg.annotation else ""
                found.append((f"{path.relative_to(REPO)}:{node.lineno}", node.name, arg.arg, annotation, default))
    return found


def test_one_name_for_a_progress_text_callback():
    """The callable that receives a line of progress text is `log` everywhere. No parameter is named `report` (its
    old name, beside `log` and `progress`); one named `progress` is a flag or a tqdm bar, never annotated as a
    Callable nor defaulting to a lambda or `print`; and one annotated `Callable[[str], None]` (or `... | None`) or
    defaulting to `print` is named `log`."""
    wrong = []
    for where, function, name, annotation, default in parameters():
        callable_default = isinstance(default, ast.Lambda) or (isinstance(default, ast.Name) and default.id == "print")
        text_line = annotation.startswith("Callable[[str], None]") or (
            isinstance(default, ast.Name) and default.id == "print"
        )
        if (
            name == "report"
            or (name == "progress" and ("Callable" in annotation or callable_default))
            or (text_line and name != "log")
        ):
            wrong.append(f"{where} {function}({name})")
    assert not wrong, "text-line callbacks not named log: " + ", ".join(wrong)
