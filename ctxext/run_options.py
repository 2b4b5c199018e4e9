"""The options a run is given that eval, passkey, tasks, search and compare share: where and how the model runs
(`RuntimeOptions`), the documents it reads (`DataOptions`), and how the run was asked for (`Invocation`, recorded at
the top of results.json)."""

from __future__ import annotations

import shlex
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .dispatch import Placement
from .eval.data import load_documents


@dataclass
class RuntimeOptions:
    """device, dtype and attention implementation ('auto': ctxext.runtime picks), BOS in front of each window
    ('auto': when the tokenizer adds one), whether to show a progress bar, and whether attention-level methods
    keep their rotated keys between decode steps (False: less memory, slower decoding, the same results).
    `placement` (--device-map/--max-memory, ctxext.dispatch): accelerate spreads the model over devices, CPU and
    disk instead of putting it on `device`. `tp` > 1 (`--tp N`, under a launcher of N processes): transformers'
    tensor parallelism splits every layer over the processes, which all run the same work (ctxext.runtime.Processes).
    """

    device: str = "auto"
    dtype: str = "auto"
    attn_implementation: str = "auto"
    bos: str = "auto"
    progress: bool = True
    kept_keys: bool = True
    placement: Placement | None = None
    tp: int = 1


@dataclass
class DataOptions:
    """The documents: text files/folders or a dataset (exactly one), as `ctxext.eval.data.load_documents` reads."""

    text_files: list[str] | None = None
    dataset: str | None = None
    split: str | None = None
    dataset_config: str | None = None
    text_field: str | None = None
    max_docs: int | None = None
    min_doc_tokens: int = 0

    def load(self, tokenizer):
        return load_documents(tokenizer, **asdict(self))

    def local_paths(self) -> list[str]:
        """The inputs on disk, which an output directory must not overlap."""
        paths = [p for p in (self.text_files or []) if Path(p).exists()]
        return paths + ([self.dataset] if self.dataset and Path(self.dataset).exists() else [])


@dataclass
class Invocation:
    """How a workflow was asked for, recorded at the top of results.json (the command line, its arguments)."""

    command: str = field(default_factory=lambda: " ".join(shlex.quote(a) for a in sys.argv))
    arguments: dict = field(default_factory=dict)
