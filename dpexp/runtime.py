"""Small facts about the machine a run uses, shared by training and the benchmark: which device, and writing
a JSON record so that a reader never sees half of it."""

from __future__ import annotations

import json
import os
import traceback
from pathlib import Path
from typing import Any

import torch


def resolve_device(name: str) -> torch.device:
    """``auto`` -> cuda if available, else cpu; otherwise the named torch device, refused clearly when it asks
    for CUDA on a machine without it."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={name} but CUDA is not available; use device=cpu or device=auto")
    return device


def write_json_atomic(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file and a rename (atomic on POSIX)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def dump_json(payload: Any, **kwargs: Any) -> str:
    """``json.dumps`` with a trailing newline."""
    return json.dumps(payload, **kwargs) + "\n"


# ------------------------------------------------------------------ errors at the entry points
PROJECT_ERRORS = (ValueError, OSError, RuntimeError, ImportError, ArithmeticError)
DEBUG_VARIABLE = "DPEXP_DEBUG"


def is_project_error(error: BaseException) -> bool:
    """Whether ``error`` is one of the project's own refusals: an error of :data:`PROJECT_ERRORS` raised in
    dpexp's code (not in a library it called)."""
    frames = traceback.extract_tb(error.__traceback__)
    package = Path(__file__).resolve().parent
    return isinstance(error, PROJECT_ERRORS) and bool(frames) and package in Path(frames[-1].filename).parents


def debug_requested(debug: bool) -> bool:
    """``debug=true`` or the environment variable :data:`DEBUG_VARIABLE`: show tracebacks."""
    return bool(debug) or os.environ.get(DEBUG_VARIABLE, "") not in ("", "0")


def one_line(error: BaseException) -> str:
    """The message an entry point prints for a project error, with how to see its traceback."""
    return f"{type(error).__name__}: {error} (for the traceback: debug=true or {DEBUG_VARIABLE}=1)"
