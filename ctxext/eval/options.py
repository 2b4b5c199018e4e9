"""The evaluation options as text (command line, YAML) -> values: lengths, stride, depths. No torch here: the
command line reads them before anything heavy is imported."""

from __future__ import annotations

from ..errors import CtxextError

DEFAULT_LENGTHS = "2048,4096,8192,16384"
BOS_CHOICES = ("auto", "yes", "no")


def parse_length(text: str | int, flag: str = "--length") -> int:
    """'16384' or '16k' -> 16384 (k = 1024 tokens), at least 2."""
    part = str(text).strip().lower()
    try:
        value = int(part[:-1]) * 1024 if part.endswith("k") else int(part)
    except ValueError:
        raise CtxextError(f"{flag} must be a token count like 16384 or 16k; got '{text}'") from None
    if value < 2:
        raise CtxextError(f"{flag} must be at least 2 tokens, got {value}")
    return value


def parse_lengths(text: str) -> list[int]:
    """'2048,4096' or '2k,4k,16k' -> sorted distinct ints >= 2."""
    if not all(part.strip() for part in str(text).split(",")):
        raise CtxextError(
            f"--lengths must be a comma-separated list of token counts like 2048,4096 or 2k,4k; got '{text}'"
        )
    lengths = []
    for part in str(text).split(","):
        try:
            lengths.append(parse_length(part, "--lengths values"))
        except CtxextError as error:
            if "at least" in str(error):
                raise
            raise CtxextError(
                f"--lengths must be a comma-separated list of token counts like 2048,4096 or 2k,4k; got '{text}'"
            ) from None
    return sorted(set(lengths))


def parse_stride(text: str | int | None) -> int | None:
    """An integer, or 'window' for one pass per document at every length (None)."""
    if text is None or str(text).strip().lower() in ("window", "w", "truncate"):
        return None
    try:
        stride = int(text)
    except ValueError:
        raise CtxextError(f"--stride must be a positive integer or 'window', got '{text}'") from None
    if stride <= 0:
        raise CtxextError(f"--stride must be a positive integer or 'window', got {stride}")
    return stride


def parse_depths(text: str) -> list[float]:
    try:
        depths = [float(p) for p in str(text).split(",")]
    except ValueError:
        raise CtxextError(f"--passkey-depths must be comma-separated fractions between 0 and 1, got '{text}'") from None
    if any(not 0 <= d <= 1 for d in depths):
        raise CtxextError(f"--passkey-depths must be fractions between 0 and 1, got '{text}'")
    return sorted(set(depths))


def check_bos(bos: str) -> str:
    if bos not in BOS_CHOICES:
        raise CtxextError(f"bos must be one of {', '.join(BOS_CHOICES)}, got {bos!r}")
    return bos
