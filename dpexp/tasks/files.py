"""Reading the original release files of the tasks' data sets: errors that name the file and the fix."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TextIO


@contextmanager
def text_file(path: Path) -> Iterator[TextIO]:
    """``path`` open as UTF-8 text (newlines untranslated, for csv); bytes that are not UTF-8, wherever the
    reading inside the block meets them, raise a ValueError naming the file."""
    with path.open(encoding="utf-8", newline="") as handle:
        try:
            yield handle
        except UnicodeDecodeError as error:
            byte = error.object[error.start : error.start + 1].hex()
            raise ValueError(
                f"{path}: not UTF-8 text ({error.reason}: byte 0x{byte}); the release files are UTF-8, so "
                "this one is damaged or was re-encoded: restore it, or convert it (e.g. iconv -f latin1 "
                "-t utf-8)."
            ) from error


def read_text(path: Path) -> str:
    """The whole of ``path`` as UTF-8 text (see :func:`text_file`)."""
    with text_file(path) as handle:
        return handle.read()
