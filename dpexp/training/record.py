"""metrics.json: the record every run leaves in its run directory, whatever happens to the run.

The file is created exclusively and whole (a run never overwrites another run's record, and no record is ever
seen empty), then rewritten atomically (temporary file + rename) after every evaluation, checkpoint and at the
end, so a run that dies keeps everything measured so far. Its ``status``:

- ``running``: under way, or killed without a chance to say so (SIGKILL, power loss); ``resume=<run dir>``
  continues it from its last checkpoint;
- ``completed``: every planned step ran;
- ``failed``: an error stopped it (``error`` says which);
- ``diverged``: the training loss or the parameters became non-finite (NaN or infinity);
- ``interrupted``: stopped by SIGTERM or SIGINT, after writing a checkpoint.

``started_at`` is when the run first started (UTC, ISO 8601; a resumed run keeps it). Whatever the status,
``steps_done`` says how many steps ran and ``epsilon`` what they spent; ``config`` is the
resolved config and ``code_version`` the code that started the run (:func:`dpexp.runtime.code_version`),
which the result store (:mod:`dpexp.results.store`) keys runs by; ``machine`` the CPU, its instruction set,
the torch build and GPU it started on (:func:`dpexp.runtime.machine`: the same code gives the same numbers
only on the same kind of machine). Non-finite
numbers are stored as the strings ``"NaN"``, ``"Infinity"`` and ``"-Infinity"`` (``float()`` reads them back),
so the file is always strict JSON. Optional wandb mirroring (``logger=wandb``) logs the same evaluation
entries; wandb is imported only when selected and runs offline unless configured otherwise.
"""

from __future__ import annotations

import fcntl
import json
import math
import os
import resource
import sys
from collections.abc import Mapping
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dpexp.runtime import write_json_atomic

METRICS_FILE = "metrics.json"
LOCK_FILE = ".lock"  # held (flock) by the process running the run; the kernel releases it when that one ends
RUNNING, COMPLETED, FAILED = "running", "completed", "failed"
DIVERGED, INTERRUPTED = "diverged", "interrupted"
NON_FINITE = {"nan": "NaN", "inf": "Infinity", "-inf": "-Infinity"}


class RunDirectoryError(ValueError):
    """A run directory that cannot take this run's record (another run's is there, or none to resume)."""


class RunRecord:
    """JSON-serialisable run fields plus the evaluation ``history``, written to ``<dir>/metrics.json``.

    :meth:`create` claims a fresh directory, :meth:`reopen` takes up the record of a run to resume; either
    holds the directory's lock until :meth:`close`, so no two processes run one run. ``status`` is ``running``
    until :meth:`complete` or :meth:`fail`; task metrics of the latest evaluation are stored at the top level
    (e.g. ``accuracy``) and every evaluation is appended to ``history``.

    ``writer=False``: the record of a run that another process writes (the ranks > 0 of a data-parallel job:
    :mod:`dpexp.training.distributed`); it keeps the fields in memory, never writes and holds no lock.
    """

    def __init__(self, path: Path, data: dict[str, Any], *, writer: bool = True) -> None:
        self.path = path
        self.data = data
        self.writer = writer
        self._sinks: list[Any] = []
        self._lock: int | None = _lock(path.parent) if writer else None

    def close(self) -> None:
        """Release the directory's lock (the record can still be read)."""
        if self._lock is not None:
            os.close(self._lock)
            self._lock = None

    @classmethod
    def create(
        cls, output_dir: str | os.PathLike, fields: Mapping[str, Any], *, writer: bool = True
    ) -> RunRecord:
        """A new record in ``output_dir``; RunDirectoryError if a run already keeps its record there."""
        path = Path(output_dir) / METRICS_FILE
        started = datetime.now(timezone.utc).isoformat(timespec="seconds")
        data = {"status": RUNNING, "error": None, "started_at": started, **fields, "history": []}
        record = cls(path, data, writer=writer)
        if not writer:
            return record
        try:
            _create_with(path, record._text(strict=True))
        except FileExistsError:
            record.close()
            raise RunDirectoryError(
                f"{path.parent} already holds another run's record ({METRICS_FILE}), which is never "
                f"overwritten: choose another directory (hydra.run.dir), or continue that run with "
                f"resume={path.parent}."
            ) from None
        except BaseException:
            record.close()  # e.g. a field JSON cannot hold: nothing was created, the directory stays free
            raise
        return record

    @classmethod
    def reopen(cls, output_dir: str | os.PathLike, *, writer: bool = True) -> RunRecord:
        """The record of the run in ``output_dir``, to resume it (refused for a completed or diverged run)."""
        path = Path(output_dir) / METRICS_FILE
        if not path.is_file():
            raise RunDirectoryError(f"resume={output_dir}: no {METRICS_FILE} there, so no run to continue.")
        record = cls(path, {}, writer=writer)
        try:
            record.data = json.loads(path.read_text())
        except json.JSONDecodeError as error:
            record.close()
            raise RunDirectoryError(
                f"resume={output_dir}: its {METRICS_FILE} is not a run record ({error}); start the run in "
                "a new directory instead."
            ) from None
        status = record.data.get("status")
        if status in (COMPLETED, DIVERGED):
            record.close()
            raise RunDirectoryError(
                f"resume={output_dir}: that run is {status}; only a running, interrupted or failed "
                "run can be continued (a diverged one would diverge again: start a new run with other "
                "settings)."
            )
        return record

    def add_sink(self, sink: Any) -> None:
        """Send each evaluation entry to ``sink.log(entry)``, and the record to ``sink.finish`` at the end."""
        self._sinks.append(sink)

    def update(self, **fields: Any) -> None:
        """Set top-level fields (not written until the next :meth:`write`)."""
        self.data.update(fields)

    def log_eval(self, entry: Mapping[str, Any], task_metrics: Mapping[str, float]) -> None:
        """Append one evaluation (``entry`` holds step, epoch, epsilon, ...) and write the file."""
        clash = set(task_metrics) & (set(self.data) - set(self.data.get("metric_names", [])))
        if clash:
            raise ValueError(
                f"Task metric names {sorted(clash)} clash with run fields of metrics.json; rename them."
            )
        self.data.update(task_metrics)
        self.data["metric_names"] = sorted(task_metrics)
        full = {**entry, **task_metrics}
        self.data["history"].append(full)
        for sink in self._sinks:
            sink.log(full)
        self.write()

    def evaluations(self) -> dict[str, Any]:
        """The history and the latest task metrics: what a checkpoint keeps to restore with :meth:`rewind`."""
        names = self.data.get("metric_names", [])
        return {"history": list(self.data["history"]), "metrics": {name: self.data[name] for name in names}}

    def rewind(self, evaluations: Mapping[str, Any]) -> None:
        """Back to the evaluations of :meth:`evaluations` (those logged since are dropped)."""
        for name in self.data.pop("metric_names", []):
            self.data.pop(name, None)
        self.data["history"] = list(evaluations["history"])
        if evaluations["metrics"]:
            self.data.update(evaluations["metrics"])
            self.data["metric_names"] = sorted(evaluations["metrics"])

    def complete(self, **fields: Any) -> None:
        self.data.update(fields, status=COMPLETED, error=None)
        self._finish()

    def fail(self, error: BaseException, status: str = FAILED, **fields: Any) -> None:
        """End with ``status`` (failed, diverged or interrupted) and the error's type and message."""
        self.data.update(fields, status=status, error=f"{type(error).__name__}: {error}")
        self._finish()

    def _finish(self) -> None:
        self.write(strict=self.data["status"] == COMPLETED)
        for sink in self._sinks:
            sink.finish(self.data)

    def write(self, strict: bool = True) -> None:
        """Rewrite the file atomically. ``strict``: a value JSON cannot hold raises TypeError; otherwise (the
        record of a failed run) it is stored as its ``repr``, so that the failure is still recorded. A record
        with ``writer=False`` writes nothing."""
        if self.writer:
            write_json_atomic(self.path, self._text(strict))

    def _text(self, strict: bool) -> str:
        bulky = ("history", "config")  # written last, after the scalar fields
        ordered = {k: v for k, v in self.data.items() if k not in bulky}
        ordered.update((k, self.data[k]) for k in bulky if k in self.data)
        default = _jsonable if strict else _jsonable_or_repr
        return json.dumps(finite_json(ordered), indent=2, allow_nan=False, default=default) + "\n"


def _create_with(path: Path, text: str) -> None:
    """Create ``path`` holding ``text`` in one step: FileExistsError if it exists. The text goes to a
    temporary file first, which is then hard-linked to ``path`` (the link fails if ``path`` exists), so the
    record never exists empty or half-written, even if the process dies while writing."""
    temporary = path.with_name(f".{path.name}.{os.getpid()}.new")
    try:
        temporary.write_text(text)
        os.link(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)


def _lock(folder: Path) -> int:
    """An exclusive lock on the run directory ``folder`` (its file descriptor); RunDirectoryError if another
    process holds it."""
    folder.mkdir(parents=True, exist_ok=True)
    descriptor = os.open(folder / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(descriptor)
        raise RunDirectoryError(
            f"{folder}: another process is running this run now; wait for it to end (or stop it) first."
        ) from None
    return descriptor


def finite_json(value: Any) -> Any:
    """``value`` with every non-finite float (at any depth) replaced by ``"NaN"``, ``"Infinity"`` or
    ``"-Infinity"``."""
    if isinstance(value, float) and not math.isfinite(value):
        return NON_FINITE[str(value)]
    if isinstance(value, Mapping):
        return {key: finite_json(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [finite_json(item) for item in value]
    return value


def _jsonable(value: Any) -> Any:
    if isinstance(value, np.generic) or (isinstance(value, torch.Tensor) and value.numel() == 1):
        return finite_json(value.item())
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"metrics.json cannot store {type(value).__name__}: {value!r}")


def _jsonable_or_repr(value: Any) -> Any:
    try:
        return _jsonable(value)
    except TypeError:
        return repr(value)


def reset_peak_memory(device: torch.device) -> None:
    """Start a fresh CUDA peak-memory window (CPU peak RSS cannot be reset; it covers the whole process)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory(device: torch.device) -> tuple[int, str]:
    """(bytes, kind): CUDA max allocated on GPU, else the process's peak resident set size."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device), "cuda_max_allocated"
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return (peak if sys.platform == "darwin" else peak * 1024), "cpu_peak_rss"


class WandbSink:
    """Mirror evaluation entries and the final summary to Weights & Biases (offline unless configured)."""

    def __init__(
        self,
        project: str,
        entity: str | None,
        mode: str,
        group: str | None,
        config: Mapping[str, Any],
        run_dir: Path,
    ) -> None:
        try:
            import wandb
        except ImportError as error:
            raise ImportError("logger=wandb needs the wandb extra: pip install -e '.[wandb]'") from error
        self._run = wandb.init(
            project=project, entity=entity, mode=mode, group=group, config=dict(config), dir=str(run_dir)
        )

    def log(self, entry: Mapping[str, Any]) -> None:
        self._run.log({k: v for k, v in entry.items() if isinstance(v, int | float)}, step=entry.get("step"))

    def finish(self, record: Mapping[str, Any]) -> None:
        scalars = {k: v for k, v in record.items() if isinstance(v, int | float | str) and k != "error"}
        self._run.summary.update(scalars)
        self._run.finish(exit_code=0 if record.get("status") == "completed" else 1)
