"""Writing results safely: everything goes to a temporary directory first and is renamed into place."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path

from .errors import CtxextError


def _inside(path: Path, other: Path) -> bool:
    return path == other or other in path.parents


def check_output_dir(output: str | Path, protected: list[str | Path] = (), overwrite: bool = False) -> Path:
    """Reject an output directory that is (or is inside) an input, or that already holds something."""
    output = Path(output).expanduser().resolve()
    for source in protected:
        source = Path(source).expanduser().resolve()
        if source.exists() and (_inside(output, source) or _inside(source, output)):
            raise CtxextError(f"output directory '{output}' overlaps the input '{source}'; choose another -o/--output")
    if output.exists() and not output.is_dir():
        raise CtxextError(f"output '{output}' exists and is not a directory")
    if output.is_dir() and any(output.iterdir()) and not overwrite:
        raise CtxextError(f"output directory '{output}' already exists and is not empty; use --overwrite to replace it")
    return output


@contextlib.contextmanager
def atomic_output_dir(output: str | Path, protected: list[str | Path] = (), overwrite: bool = False):
    """Yield a temporary directory next to `output`; on success it replaces `output` in one rename.

    On any error the temporary directory is removed and `output` is left as it was.
    """
    output = check_output_dir(output, protected, overwrite)
    output.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{output.name}.tmp-", dir=output.parent))
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(staging, 0o777 & ~umask)  # mkdtemp makes it private; the result should look like any new directory
    try:
        yield staging
        if output.exists():
            retired = Path(tempfile.mkdtemp(prefix=f".{output.name}.old-", dir=output.parent))
            os.rename(output, retired / output.name)
            os.rename(staging, output)
            shutil.rmtree(retired, ignore_errors=True)
        else:
            os.rename(staging, output)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def atomic_write_text(path: Path, text: str) -> None:
    """Write `text` to `path` through a temporary file beside it, renamed into place: never half a file."""
    path = Path(path)
    with tempfile.NamedTemporaryFile(
        "w", dir=path.parent, prefix=f".{path.name}.", suffix=".tmp", delete=False, encoding="utf-8"
    ) as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.chmod(handle.name, 0o644)
    os.replace(handle.name, path)
