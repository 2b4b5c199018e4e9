"""Everything ctxext writes goes through here: whole files, JSON, directories, plots, cached cells, provenance.

- Files and directories are written to a temporary name beside their destination and renamed into place, so a
  reader never sees half a result and an interrupted run leaves what was there before.
- A directory ctxext wrote carries a marker file (`MARKER`); `--overwrite` replaces only such a directory.
- `CellCache` keeps one JSON file per computed cell (a perplexity at one length, a task at one length, ...), named by
  a hash of everything the cell depends on, so an interrupted run resumes and never recomputes a finished cell.
- `content_fingerprint` names a checkpoint by its content; `provenance` says where a number came from.
- `new_figure`/`save_figure` give every plot the same look without touching pyplot's global state.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
import shutil
import sys
import uuid
from collections.abc import Iterator
from datetime import datetime, timezone
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import torch
from matplotlib.figure import Figure
from safetensors import safe_open

from . import __version__
from .errors import CtxextError
from .runtime import machine_description

MARKER = ".ctxext-output"  # in every directory ctxext wrote whole; what --overwrite may replace
FIGURE_DPI = 120  # every plot ctxext writes


# ----------------------------------------------------------------------------------------------- files
@contextlib.contextmanager
def atomic_file(path: str | Path) -> Iterator[Path]:
    """Yield a temporary path beside `path`; on success it is renamed onto `path`, on error removed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.with_name(f".{path.name}.{uuid.uuid4().hex[:12]}.tmp")
    try:
        yield staging
        os.replace(staging, path)
    finally:
        staging.unlink(missing_ok=True)


def atomic_write_text(path: str | Path, text: str) -> None:
    """Write `text` to `path` through a temporary file beside it, renamed into place: never half a file."""
    with atomic_file(path) as staging, open(staging, "w", encoding="utf-8") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())


def write_json(path: str | Path, payload, *, default=str, allow_nan: bool = False) -> None:
    """`payload` as indented JSON, written atomically. NaN and infinity are refused unless `allow_nan`."""
    atomic_write_text(path, json.dumps(payload, indent=2, allow_nan=allow_nan, default=default) + "\n")


def save_figure(fig, path: str | Path, dpi: int = FIGURE_DPI) -> None:
    """Save a matplotlib figure atomically (the format follows the suffix of `path`)."""
    path = Path(path)
    with atomic_file(path) as staging:
        fig.savefig(staging, dpi=dpi, format=path.suffix.lstrip(".") or "png")


def new_figure(**kwargs):
    """A figure that needs no GUI and leaves pyplot's backend alone (it may be a notebook's inline one)."""
    return Figure(**kwargs)


# ----------------------------------------------------------------------------------------- directories
def _inside(path: Path, other: Path) -> bool:
    return path == other or other in path.parents


def check_overlap(output: str | Path, protected: list[str | Path] = ()) -> Path:
    """The resolved `output`, or a CtxextError if it is (or is inside, or holds) an input, or is a file."""
    output = Path(output).expanduser().resolve()
    for source in protected:
        source = Path(source).expanduser().resolve()
        if source.exists() and (_inside(output, source) or _inside(source, output)):
            raise CtxextError(f"output directory '{output}' overlaps the input '{source}'; choose another -o/--output")
    if output.exists() and not output.is_dir():
        raise CtxextError(f"output '{output}' exists and is not a directory")
    return output


def written_by_ctxext(directory: Path) -> bool:
    return (directory / MARKER).is_file()


def check_output_dir(output: str | Path, protected: list[str | Path] = (), overwrite: bool = False) -> Path:
    """Reject an output directory that overlaps an input, or holds something that --overwrite may not replace."""
    output = check_overlap(output, protected)
    if output.is_dir() and any(output.iterdir()):
        if not overwrite:
            raise CtxextError(
                f"output directory '{output}' already exists and is not empty; use --overwrite to replace it"
            )
        if not written_by_ctxext(output):
            raise CtxextError(
                f"--overwrite: '{output}' was not written by ctxext (it has no {MARKER} file), so it is left alone; "
                "remove it yourself or choose another -o/--output"
            )
    return output


def new_directory_beside(output: Path, tag: str) -> Path:
    """An empty directory next to `output`, with the permissions of any new directory (the umask applies)."""
    path = output.parent / f".{output.name}.{tag}-{uuid.uuid4().hex[:12]}"
    path.mkdir(mode=0o777)
    return path


@contextlib.contextmanager
def atomic_output_dir(output: str | Path, protected: list[str | Path] = (), overwrite: bool = False):
    """Yield a temporary directory next to `output`; on success it replaces `output` in one rename.

    The directory gets the `MARKER` file. On any error the temporary directory is removed and `output` is left as
    it was. Under `overwrite` only a directory that ctxext wrote is replaced (`check_output_dir`).
    """
    output = check_output_dir(output, protected, overwrite)
    output.parent.mkdir(parents=True, exist_ok=True)
    staging = new_directory_beside(output, "tmp")
    try:
        yield staging
        (staging / MARKER).write_text("written by ctxext; `--overwrite` may replace this directory\n")
        if output.exists():
            retired = new_directory_beside(output, "old")
            os.rename(output, retired / output.name)
            os.rename(staging, output)
            shutil.rmtree(retired, ignore_errors=True)
        else:
            os.rename(staging, output)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


# ----------------------------------------------------------------------------------------------- cells
class CellCache:
    """One JSON file per computed cell, named by a hash of `context` and the cell's key, written atomically.

    A file holds {"key": <context + key>, **value}; `get` returns it only when its stored key is the one asked for
    (a damaged or foreign file is computed again). `folder=None` caches nothing.
    """

    def __init__(self, folder: str | Path | None, context: dict | None = None, digits: int = 24, default=str):
        self.folder = Path(folder).expanduser() if folder is not None else None
        self.context = dict(context or {})
        self.digits = digits
        self.default = default  # how values JSON cannot hold are written

    def canonical(self, key: dict) -> dict:
        """The full key as JSON would give it back (tuples as lists, paths and dtypes as text)."""
        return json.loads(json.dumps({**self.context, **key}, sort_keys=True, default=str))

    def digest(self, key: dict) -> str:
        text = json.dumps(self.canonical(key), sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[: self.digits]

    def path(self, key: dict) -> Path | None:
        return None if self.folder is None else self.folder / f"{self.digest(key)}.json"

    def get(self, key: dict) -> dict | None:
        path = self.path(key)
        if path is None or not path.is_file():
            return None
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            return None  # a damaged entry is computed again
        return record if isinstance(record, dict) and record.get("key") == self.canonical(key) else None

    def put(self, key: dict, value: dict) -> dict:
        record = {"key": self.canonical(key), **value}
        path = self.path(key)
        if path is not None:
            write_json(path, record, default=self.default, allow_nan=True)
        return record


# ------------------------------------------------------------------------------------------ provenance
WRITER_KEYS = ("transformers_version",)  # config.json keys that record the writer, not the model


def content_fingerprint(checkpoint: str | Path) -> str:
    """A local checkpoint named by what it computes: its config (less the keys that name the transformers release
    that wrote it) and every tensor's name, dtype, shape and bytes. The same model converted by another release,
    on another machine or at another path has the same fingerprint; file sizes and times play no part."""
    path = Path(checkpoint)
    config = {k: v for k, v in json.loads((path / "config.json").read_text()).items() if k not in WRITER_KEYS}
    digest = hashlib.sha256(json.dumps(config, sort_keys=True).encode())
    for weights in sorted(path.glob("*.safetensors")):
        with safe_open(weights, framework="pt") as tensors:
            for name in sorted(tensors.keys()):
                tensor = tensors.get_tensor(name)
                digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)}".encode())
                digest.update(tensor.reshape(-1).view(torch.uint8).numpy())
    return digest.hexdigest()[:16]


def provenance() -> dict:
    """Library versions, machine, device and time: enough to tell where a number came from."""
    info = {"ctxext": __version__, "torch": torch.__version__}
    for package in ("transformers", "accelerate", "datasets"):
        with contextlib.suppress(PackageNotFoundError):
            info[package] = version(package)
    info |= {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "machine": machine_description(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "time_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
    if torch.cuda.is_available():
        info["cuda"] = torch.version.cuda
        info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return info
