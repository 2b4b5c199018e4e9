"""ctxext.yaml, the record of what ctxext applied to the model beside it: one schema, one writer (`write_record`),
one reader (`read_record`).

A file holds, under a comment that says what wrote it and how to use it:
- `schema`: SCHEMA. A file without it was written before this module (schema 1) and reads the same way: its keys
  were already these, and its kind is worked out from them (`_kind_of_schema_1`);
- `kind`: what the folder holds (KINDS): a patched `checkpoint` (`ctxext patch`, `ctxext.save_pretrained`, a copy
  `ctxext export --engine` wrote, which adds `exported_for`); an `adapter` (PEFT's, trained on a patched base:
  `ctxext finetune`'s adapter/, or any PEFT save of an adapter on a base patched in memory, which adds the `patch`
  call that loading it makes again); a `merged` model (`ctxext finetune`'s base + LoRA);
- `written_by`: the command or call that wrote it;
- `ctxext_version` and `source_model`;
- then the kind's own keys, as their writers build them: the method and its parameters (ctxext.config's
  `MethodConfig.to_dict`), `original_max_position_embeddings` (the L the method was given), `rope_parameters`,
  `max_position_embeddings`, `written_as`, `source_rope` (the rope the method was applied to), and a fine-tune's
  `seq_len` and `mixed_window`.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from . import __version__

RECORD_FILE = "ctxext.yaml"
SCHEMA = 2
KINDS = ("checkpoint", "adapter", "merged")
HEADER_KEYS = ("schema", "kind", "written_by", "ctxext_version")
NOTES = {
    "checkpoint": "what was applied to the source model.",
    "adapter": (
        "a PEFT adapter trained on a patched base. After `import ctxext`, PeftModel.from_pretrained,\n"
        "# AutoPeftModelForCausalLM and transformers' load_adapter make the `patch` call below (where there is one) on\n"
        "# the unpatched base before the adapter goes on (ctxext.integrations.adapters); without ctxext, patch the\n"
        "# base yourself: model = AutoModelForCausalLM.from_pretrained(source); ctxext.patch(model, method, ...)."
    ),
    "merged": "base + LoRA, merged.",
}


@dataclass(frozen=True)
class CtxextRecord:
    """One ctxext.yaml: its kind, what wrote it, and the kind's own keys (`values`)."""

    kind: str
    written_by: str
    values: dict = field(default_factory=dict)
    schema: int = SCHEMA
    ctxext_version: str = __version__

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"unknown ctxext.yaml kind '{self.kind}'; one of {', '.join(KINDS)}")

    def as_dict(self) -> dict:
        """The file's mapping: the header keys, then the kind's own."""
        header = {"schema": self.schema, "kind": self.kind, "written_by": self.written_by}
        return {**header, "ctxext_version": self.ctxext_version, **self.values}

    def with_values(self, **values) -> CtxextRecord:
        return dataclasses.replace(self, values={**self.values, **values})


def write_record(folder: str | Path, record: CtxextRecord) -> Path:
    """Write `record` as `folder`/ctxext.yaml (in a staging folder: the caller renames it into place)."""
    values = json.loads(json.dumps(record.as_dict()))  # plain data: YAML without anchors for lists used twice
    path = Path(folder) / RECORD_FILE
    path.write_text(
        f"# Written by `{record.written_by}`: {NOTES[record.kind]}\n" + yaml.safe_dump(values, sort_keys=False),
        encoding="utf-8",
    )
    return path


def read_record(where: str | Path) -> CtxextRecord | None:
    """The record in `where` (a folder, or the file itself), or None where there is none; schema-1 files too."""
    path = Path(where)
    path = path / RECORD_FILE if path.is_dir() else path
    if not path.is_file():
        return None
    text = path.read_text(encoding="utf-8")
    values = yaml.safe_load(text)
    if not isinstance(values, dict):
        return None
    header = {key: values.pop(key) for key in HEADER_KEYS if key in values}
    if "schema" not in header:
        header.update(schema=1, kind=_kind_of_schema_1(values, text), written_by=_writer_of_schema_1(text))
    header.setdefault("ctxext_version", "unknown")
    return CtxextRecord(header["kind"], header["written_by"], values, header["schema"], header["ctxext_version"])


def _kind_of_schema_1(values: dict, text: str) -> str:
    """A schema-1 file's kind: an adapter's record names its `patch` call or the fine-tune's `seq_len` without a
    rope form written; a merged model's comment says so; anything else is a checkpoint."""
    values.pop("record", None)  # schema 1's marker of an adapter record ("the patch of the base ...")
    if "base + LoRA, merged" in text.split("\n", 1)[0]:
        return "merged"
    if isinstance(values.get("patch"), dict) or ("seq_len" in values and "written_as" not in values):
        return "adapter"
    return "checkpoint"


def _writer_of_schema_1(text: str) -> str:
    first = text.split("\n", 1)[0]
    if first.startswith("# Written by `") and "`" in first[len("# Written by `") :]:
        return first[len("# Written by `") :].split("`", 1)[0]
    return "ctxext (schema 1)"
