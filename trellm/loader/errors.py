"""Errors raised while locating or reading a model."""
from __future__ import annotations


class ModelLoadError(Exception):
    """A model (or its tokenizer) could not be loaded.

    The message is one line meant for the user: it names the path and the problem,
    so the CLI can print it without a traceback.
    """


def first_line(e: BaseException) -> str:
    """The first line of an exception's message (library errors can span many lines)."""
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
