"""metrics.json: the record every run leaves in its Hydra run directory (also when it fails).

The file is rewritten atomically (temporary file + rename) after every evaluation and at the end, so an
interrupted run keeps everything measured so far. Optional wandb mirroring (``logger=wandb``) logs the same
evaluation entries; wandb is imported only when selected and runs offline unless configured otherwise.
"""

from __future__ import annotations

import json
import os
import resource
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

METRICS_FILE = "metrics.json"


class RunRecord:
    """JSON-serialisable run fields plus the evaluation ``history``, written to ``<dir>/metrics.json``.

    ``status`` is ``running`` until :meth:`complete` or :meth:`fail`; task metrics of the final evaluation are
    stored at the top level (e.g. ``accuracy``) and every evaluation is appended to ``history``.
    """

    def __init__(self, output_dir: str | os.PathLike, fields: Mapping[str, Any]) -> None:
        self.path = Path(output_dir) / METRICS_FILE
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.data: dict[str, Any] = {"status": "running", "error": None, **fields, "history": []}
        self._sinks: list[Any] = []

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

    def complete(self, **fields: Any) -> None:
        self.data.update(fields, status="completed", error=None)
        self._finish()

    def fail(self, error: BaseException, **fields: Any) -> None:
        self.data.update(fields, status="failed", error=f"{type(error).__name__}: {error}")
        self._finish()

    def _finish(self) -> None:
        self.write()
        for sink in self._sinks:
            sink.finish(self.data)

    def write(self) -> None:
        bulky = ("history", "config")  # written last, after the scalar fields
        ordered = {k: v for k, v in self.data.items() if k not in bulky}
        ordered.update((k, self.data[k]) for k in bulky if k in self.data)
        tmp = self.path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(ordered, indent=2, allow_nan=False, default=_jsonable) + "\n")
        tmp.replace(self.path)


def _jsonable(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"metrics.json cannot store {type(value).__name__}: {value!r}")


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
        self, project: str, entity: str | None, mode: str, config: Mapping[str, Any], run_dir: Path
    ) -> None:
        try:
            import wandb
        except ImportError as error:
            raise ImportError("logger=wandb needs the wandb extra: pip install -e '.[wandb]'") from error
        self._run = wandb.init(
            project=project, entity=entity, mode=mode, config=dict(config), dir=str(run_dir)
        )

    def log(self, entry: Mapping[str, Any]) -> None:
        self._run.log({k: v for k, v in entry.items() if isinstance(v, int | float)}, step=entry.get("step"))

    def finish(self, record: Mapping[str, Any]) -> None:
        scalars = {k: v for k, v in record.items() if isinstance(v, int | float | str) and k != "error"}
        self._run.summary.update(scalars)
        self._run.finish(exit_code=0 if record.get("status") == "completed" else 1)
