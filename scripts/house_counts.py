"""How many sources each fact has: the figures of the "one source for each fact" rule (CONTRIBUTING.md).

Traced on a real CLI run over a random 2-layer LLaMA (L = 64) written to a temporary folder:
- rope record builds (`rope_record` calls) per `ctxext eval` of two rows (the baseline and yarn x2);
- plans (`plan_patch`), rope-parameter computations (`rope_parameters_to_write`, the serving form's
  `model_rope_form`) and method look-ups (`get_method`) per `ctxext patch --method yarn --factor 2`;

and read from the source tree:
- functions that write ctxext.yaml (that call `record_file.write_record`);
- top-level names defined in more than one ctxext module; public and private top-level names per package;
- function-local imports outside ctxext/cli/; BENCHMARKS.md's lines.

    .venv/bin/python scripts/house_counts.py            # a table
    .venv/bin/python scripts/house_counts.py --json     # the same as JSON
"""

from __future__ import annotations

import argparse
import ast
import collections
import contextlib
import importlib
import io
import json
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast  # noqa: E402

from ctxext.cli import main as ctxext_main  # noqa: E402
from ctxext.methods import get_method  # noqa: E402

patch_module = importlib.import_module("ctxext.patching.patch")  # the package's `patch` is the function
record_module = importlib.import_module("ctxext.patching.record")
forms_module = importlib.import_module("ctxext.patching.forms")
rope_types_module = importlib.import_module("ctxext.patching.rope_types")

TRACED = {
    "rope record builds": record_module.rope_record,
    "plans": patch_module.plan_patch,
    "rope parameters written (patch)": patch_module.rope_parameters_to_write,
    "rope form (serving)": forms_module.model_rope_form,
    "rope parameters computed (rope_parameters_for)": rope_types_module.rope_parameters_for,
    "method look-ups": get_method,
}


def tiny_checkpoint(folder: Path) -> Path:
    """A random 2-layer LLaMA (L = 64) with a 256-word word-level tokenizer, saved to `folder`."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, rope_theta=10000.0, tie_word_embeddings=False,
    )  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(folder)
    backend = Tokenizer(models.WordLevel({f"w{i}": i for i in range(256)}, unk_token="w0"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="w0").save_pretrained(folder)
    return folder


def calls_during(argv: list[str]) -> dict[str, int]:
    """{name in TRACED: calls} while `ctxext argv` runs (a profile hook counts each traced function's code object)."""
    codes = {function.__code__: name for name, function in TRACED.items()}
    counts = collections.Counter()

    def hook(frame, event, arg):
        if event == "call" and frame.f_code in codes:
            counts[codes[frame.f_code]] += 1

    sys.setprofile(hook)
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            code = ctxext_main(argv)
    finally:
        sys.setprofile(None)
    if code != 0:
        raise SystemExit(f"ctxext {' '.join(argv)} exited {code}")
    return {name: counts[name] for name in TRACED}


def traced_figures() -> dict:
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        checkpoint = tiny_checkpoint(root / "tiny")
        ids = torch.randint(0, 256, (300,), generator=torch.Generator().manual_seed(0))
        (root / "a.txt").write_text(" ".join(f"w{int(i)}" for i in ids))
        evaluated = calls_during(
            ["eval", str(checkpoint), "--method", "yarn", "--factor", "2", "--lengths", "64", "--stride", "32",
             "--text-file", str(root / "a.txt"), "--dtype", "fp32", "--no-cache", "--no-progress", "-o",
             str(root / "eval")]
        )  # fmt: skip
        patched = calls_during(
            ["patch", str(checkpoint), "--method", "yarn", "--factor", "2", "-o", str(root / "patched")]
        )
    return {"ctxext eval (2 rows)": evaluated, "ctxext patch": patched}


def ctxext_modules() -> dict[str, ast.Module]:
    return {
        ".".join(path.relative_to(REPO).with_suffix("").parts): ast.parse(path.read_text())
        for path in sorted((REPO / "ctxext").rglob("*.py"))
    }


def top_level_names(tree: ast.Module) -> list[str]:
    """Functions, classes and assigned names at a module's top level."""
    names = []
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.append(node.name)
        elif isinstance(node, ast.Assign):
            names += [t.id for t in node.targets if isinstance(t, ast.Name)]
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.append(node.target.id)
    return [n for n in names if not (n.startswith("__") and n.endswith("__"))]


def local_imports(tree: ast.Module) -> int:
    """Imports inside a function's body (one per line), as tests/test_house.py counts them."""
    return len(
        {
            sub.lineno
            for node in ast.walk(tree)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            for sub in ast.walk(node)
            if isinstance(sub, (ast.Import, ast.ImportFrom))
        }
    )


def yaml_writers(trees: dict[str, ast.Module]) -> list[str]:
    """module.function for every function that calls record_file's writer."""
    found = []
    for module, tree in trees.items():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                called = {
                    getattr(c.func, "attr", getattr(c.func, "id", None))
                    for c in ast.walk(node)
                    if isinstance(c, ast.Call)
                }
                if "write_record" in called and not module.endswith("record_file"):
                    found.append(f"{module}.{node.name}")
    return found


def source_figures() -> dict:
    trees = ctxext_modules()
    defined = collections.defaultdict(set)
    per_package = collections.defaultdict(lambda: [0, 0])
    for module, tree in trees.items():
        package = ".".join(module.split(".")[:2]) if module.count(".") > 1 else "ctxext"
        for name in top_level_names(tree):
            defined[name].add(module)
            per_package[package][name.startswith("_")] += 1
    duplicated = sorted(name for name, where in defined.items() if len(where) > 1 and not name.startswith("_"))
    outside_cli = {m: t for m, t in trees.items() if not m.startswith("ctxext.cli")}
    return {
        "ctxext.yaml writers": yaml_writers(trees),
        "public names defined in more than one module": len(duplicated),
        "public / private top-level names per package": {p: f"{a} / {b}" for p, (a, b) in sorted(per_package.items())},
        "function-local imports outside ctxext/cli/": sum(local_imports(t) for t in outside_cli.values()),
        "BENCHMARKS.md lines": len((REPO / "BENCHMARKS.md").read_text().splitlines()),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args()
    figures = {**traced_figures(), **source_figures()}
    if args.json:
        print(json.dumps(figures, indent=2))
        return 0
    for name, value in figures.items():
        if isinstance(value, dict):
            print(f"{name}:")
            for key, inner in value.items():
                print(f"  {key}: {inner}")
        elif isinstance(value, list):
            print(f"{name}: {len(value)} ({', '.join(value)})")
        else:
            print(f"{name}: {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
