"""Errors that carry a one-line message meant for the user.

The CLI turns any `CtxextError` into `ctxext: error: <message>` and exit code 2, so every message
should say what was wrong and how to fix it, on one line.
"""

import difflib


class CtxextError(ValueError):
    """Bad input: an unknown method, an invalid parameter, a missing file, an unsupported model."""


def did_you_mean(word: str, choices) -> str:
    """' (did you mean 'x'?)' when a close match exists, else ''."""
    close = difflib.get_close_matches(str(word), [str(c) for c in choices], n=1, cutoff=0.6)
    return f" (did you mean '{close[0]}'?)" if close else ""


def first_line(error: BaseException) -> str:
    """The first line of an exception's message (its type name if empty), for one-line CLI errors."""
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
