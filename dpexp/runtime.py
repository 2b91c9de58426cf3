"""Small facts about the machine a run uses, shared by training and the benchmark: which device, and writing
a JSON record so that a reader never sees half of it."""

from __future__ import annotations

import json
import os
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
