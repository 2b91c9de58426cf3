"""Small facts about the machine a run uses, shared by training and the benchmark: which device, writing
a JSON record so that a reader never sees half of it, and which code version and machine make a run."""

from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
import re
import subprocess
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


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), or the platform's processor name where there is none."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    match = re.search(r"^model name\s*:\s*(.+)$", text, re.MULTILINE)
    return match.group(1).strip() if match else platform.machine()


def machine(device: torch.device) -> dict[str, Any]:
    """What a run computes on, beside its code version: ``cpu`` (model name), ``cpu_capability`` (the
    instruction set torch's CPU kernels were chosen for: ``AVX2``, ``AVX512``, ...), ``torch`` (version and
    build), and ``gpu`` (the device's name, None on CPU). The same code and config give the same numbers
    only on the same kind of machine: kernels for another instruction set or another torch build round
    floats differently, and a training run amplifies the difference."""
    return {
        "cpu": cpu_model(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
    }


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
# TypeError: the engine's refusal of a layer whose output it cannot capture, a pipeline stage's inputs
PROJECT_ERRORS = (ValueError, TypeError, OSError, RuntimeError, ImportError, ArithmeticError)
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


# ------------------------------------------------------------------ the code a run is made by
CODE_FILES = ("pyproject.toml",)  # beside the package's own *.py files
READ_ONLY_CODE = ("results", "reproduce.py")  # read run records and never train: not part of a code version


def code_version(package: Path | None = None) -> dict[str, Any]:
    """The version of the code that makes a run: ``source_hash`` (sha256 of the package's ``*.py`` files and
    ``pyproject.toml``, by relative path, first 16 hex digits: the identity two runs' code is compared by;
    the modules that only read run records, :data:`READ_ONLY_CODE`, are left out),
    and for people the git ``commit`` of the checkout and ``dirty`` (uncommitted changes to the package),
    both None outside a git checkout. The configs are not part of it: a run's resolved config is keyed
    separately (:mod:`dpexp.results.store`)."""
    package = Path(package or Path(__file__).resolve().parent)
    root = package.parent
    digest = hashlib.sha256()
    sources = [p for p in package.rglob("*.py") if p.relative_to(package).parts[0] not in READ_ONLY_CODE]
    files = sorted(sources) + [root / name for name in CODE_FILES if (root / name).is_file()]
    for path in files:
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    commit = _git(root, "rev-parse", "HEAD")
    status = _git(root, "status", "--porcelain", "--", package.name, *CODE_FILES)
    return {
        "source_hash": digest.hexdigest()[:16],
        "commit": commit,
        "dirty": None if commit is None or status is None else bool(status),
    }


@functools.cache
def process_code_version() -> dict[str, Any]:
    """The code version of this process: :func:`code_version` of the package when the process first asks
    (the training entry point asks as it starts, before Hydra runs any job), not when a later run asks. A
    multirun runs its jobs one after another in one process with the modules it imported at its start; a
    file changed on disk meanwhile must not be credited to its later runs."""
    return code_version()


def _git(root: Path, *args: str) -> str | None:
    """``git <args>`` in ``root`` (stripped stdout), or None when git or the checkout is missing."""
    try:
        done = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None
