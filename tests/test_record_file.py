"""ctxext.yaml has one schema, one writer and one reader (ctxext/record_file.py): every writer's file reads back as
its kind with the same header, a patch made by the CLI and one saved from memory record the same keys, an export
copy adds `exported_for` through the writer, files written before the schema (schema 1) read the same way, and no
other module writes or parses the file itself."""

import ast
from pathlib import Path

import pytest
import yaml

import ctxext
from ctxext.integrations.adapters import write_adapter_record
from ctxext.record_file import HEADER_KEYS, SCHEMA, CtxextRecord, read_record, write_record
from tests.helpers import run_cli, save_tiny_checkpoint, tiny_model

PACKAGE = Path(ctxext.__file__).parent


def test_a_record_reads_back_as_written(tmp_path):
    record = CtxextRecord("checkpoint", "ctxext patch", {"method": "yarn", "factor": 2.0, "layers": [1, 2]})
    write_record(tmp_path, record)
    assert read_record(tmp_path) == record
    raw = yaml.safe_load((tmp_path / "ctxext.yaml").read_text())
    assert list(raw)[: len(HEADER_KEYS)] == list(HEADER_KEYS) and raw["schema"] == SCHEMA
    assert (tmp_path / "ctxext.yaml").read_text().startswith("# Written by `ctxext patch`: ")
    with pytest.raises(ValueError, match="unknown ctxext.yaml kind"):
        CtxextRecord("weights", "x")


@pytest.mark.parametrize(
    "text,kind,written_by",
    [
        (
            "# Written by `ctxext patch`: what was applied to the source model.\n"
            "source_model: m\nctxext_version: 0.9.0\nmethod: yarn\nfactor: 2.0\nwritten_as: {format: native}\n",
            "checkpoint",
            "ctxext patch",
        ),
        (
            "# Written by `ctxext finetune`. After `import ctxext`, PeftModel.from_pretrained(base, this_folder) and\n"
            "source_model: m\nmethod: linear\nfactor: 2.0\nseq_len: 128\n",
            "adapter",
            "ctxext finetune",
        ),
        (
            "# Written by ctxext beside a PEFT adapter trained on a base patched in memory (`ctxext.patch`). After\n"
            "record: the patch of the base this adapter was trained on\nctxext_version: 0.9.0\n"
            "patch: {method: yarn, factor: 2}\nsource_rope: {rope_parameters: {rope_type: default}}\n",
            "adapter",
            "ctxext (schema 1)",
        ),
        (
            "# Written by `ctxext finetune`: base + LoRA, merged.\nmethod: linear\nseq_len: 128\n"
            "written_as: {format: native}\n",
            "merged",
            "ctxext finetune",
        ),
    ],
)
def test_a_file_written_before_the_schema_reads_through_the_reader(tmp_path, text, kind, written_by):
    (tmp_path / "ctxext.yaml").write_text(text)
    record = read_record(tmp_path)
    assert (record.schema, record.kind, record.written_by) == (1, kind, written_by)
    assert "record" not in record.values and "ctxext_version" not in record.values
    assert record.values["method" if "method" in record.values else "patch"]


def test_every_writer_writes_the_one_schema(tmp_path, capsys):
    """ctxext patch, ctxext.save_pretrained, an export copy and an adapter's save: each file is schema 2 of its
    kind; the two checkpoints' keys are the same set (the CLI adds only what it was asked beyond the method)."""
    source = save_tiny_checkpoint(tmp_path / "in", tiny_model("llama"))
    assert run_cli(capsys, "patch", source, "--method", "yarn", "--factor", 2, "-o", tmp_path / "cli")[0] == 0
    model = ctxext.patch(tiny_model("llama"), "yarn", factor=2)
    ctxext.save_pretrained(model, tmp_path / "memory")
    assert run_cli(capsys, "export", tmp_path / "cli", "--engine", "vllm", "-o", tmp_path / "vllm")[0] == 0
    write_adapter_record(model, tmp_path)
    cli, memory, copy, adapter = (read_record(tmp_path / n) for n in ("cli", "memory", "vllm", "ctxext.yaml"))
    assert {r.schema for r in (cli, memory, copy, adapter)} == {SCHEMA}
    assert (cli.kind, memory.kind, copy.kind, adapter.kind) == ("checkpoint", "checkpoint", "checkpoint", "adapter")
    assert (cli.written_by, memory.written_by) == ("ctxext patch", "ctxext.save_pretrained")
    assert copy.values == {**cli.values, "exported_for": "vllm"}
    assert set(memory.values) == set(cli.values) - {"tokenizer"}
    assert {key: memory.values[key] for key in ("factor", "beta_fast", "rope_parameters")} == {
        key: cli.values[key] for key in ("factor", "beta_fast", "rope_parameters")
    }
    assert adapter.values["patch"]["method"] == "yarn"


def test_no_other_module_writes_or_parses_ctxext_yaml():
    """The file's name and its YAML are record_file's alone: no other module names 'ctxext.yaml' in code (its
    docstrings and comments may) or dumps a record with yaml."""
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        if path.name == "record_file.py":
            continue
        tree = ast.parse(path.read_text())
        docstrings = {
            id(node.body[0].value)
            for node in ast.walk(tree)
            if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
            and node.body
            and isinstance(node.body[0], ast.Expr)
        }
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and node.value == "ctxext.yaml" and id(node) not in docstrings:
                offenders.append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
    assert offenders == []
