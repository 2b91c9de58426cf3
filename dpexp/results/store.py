"""The result store: one index of every run record, keyed by resolved config and code version.

Every ``<run dir>/metrics.json`` under a runs folder (``results/runs``) becomes one line of a JSONL index
(``results/index.jsonl``), rebuilt from the records alone. A run is identified by

- ``run_key``: sha256 of its resolved config without the run-local keys (:data:`RUN_LOCAL_KEYS`: where it
  writes, how it reports, how it resumes: nothing that changes what it computes), 16 hex digits; except
  ``checkpoint.at_epochs`` when set (:data:`KEPT_CHECKPOINTS`): such a run leaves the checkpoints an analysis
  reads after training (``he2023_figure2``), so it must never be taken for a run of the same computation
  that did not keep them;
- ``setting_key``: the same without ``seed``: the runs that differ only by seed, averaged into mean +- std;
- ``source_hash``: the code version that made it (:func:`dpexp.runtime.code_version`).

The ``machine`` a run started on (:func:`dpexp.runtime.machine`) is kept beside, not in its identity: the same
config and code on another kind of machine is the same experiment, whose numbers may differ at float rounding
(and more after a long training run); a summary counts its runs' machines (:func:`machine_label`).

:func:`summarize` averages a setting's completed runs made by one code version, one run per seed (a rerun
of the same config and code counts once); runs by other code versions are summarized apart, one summary per
version (``Summary.older``), never mixed in nor with one another; failed, diverged, interrupted, killed (a
record still saying ``running`` whose lock no process holds) or running ones are counted by status, never
averaged.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import math
import os
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from dpexp.training.record import COMPLETED, LOCK_FILE, METRICS_FILE, RUNNING
from dpexp.training.resume import RUNTIME_KEYS

KILLED = "killed"  # an index status: a record saying running whose run directory no process holds

# Keys that do not change what a run computes: the runtime keys a resume may set, plus where the run writes
# and reads its files and how often the progress bar reports.
RUN_LOCAL_KEYS = (*RUNTIME_KEYS, "output", "data.root", "log_every")
KEPT_CHECKPOINTS = ("checkpoint", "at_epochs")  # a run-local key that, when set, is part of the run key
# (dotted) keys added after records existed, left out of the run key while they hold these values (what a
# record without them did), so older records keep their key
LATER_DEFAULTS: dict[str, Any] = {
    "parameters": {"train": None, "freeze": []},
    "task.model_metrics": None,
    "model.head_init": "random",  # text encoders' head start (stop 76): a record without it started at random
    "model.head_scale": 5.0,
}
INDEX_FILE = "index.jsonl"
UNKNOWN_CODE = "unknown"  # source_hash of a record written before records stored their code version


def strip_keys(config: Mapping[str, Any], keys: Iterable[str]) -> dict[str, Any]:
    """A copy of the nested ``config`` without the dotted ``keys`` (absent ones are ignored)."""
    out = json.loads(json.dumps(dict(config)))
    for key in keys:
        *parents, leaf = key.split(".")
        node = out
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict):
            node.pop(leaf, None)
    return out


def config_key(config: Mapping[str, Any], *, with_seed: bool = True) -> str:
    """sha256 (16 hex digits) of the resolved ``config`` without :data:`RUN_LOCAL_KEYS` (and ``seed`` unless
    ``with_seed``) but with ``checkpoint.at_epochs`` if set, and without the :data:`LATER_DEFAULTS` keys at
    their defaults, serialised with sorted keys: equal for configs that compute the same run and keep the
    same checkpoints."""
    dropped = RUN_LOCAL_KEYS if with_seed else (*RUN_LOCAL_KEYS, "seed")
    kept = strip_keys(config, dropped)
    group, key = KEPT_CHECKPOINTS
    at_epochs = (config.get(group) or {}).get(key)
    if at_epochs:  # null or [] (no kept checkpoints) leaves the key as it was before the option existed
        kept[group] = {key: at_epochs}
    for later, default in LATER_DEFAULTS.items():
        *parents, leaf = later.split(".")
        node: Any = kept
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict) and leaf in node and node[leaf] == default:
            del node[leaf]
    text = json.dumps(kept, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def run_config(run_dir: Path, record: Mapping[str, Any]) -> dict[str, Any] | None:
    """The resolved config of a run: the record's ``config``, else Hydra's ``.hydra/config.yaml``."""
    if isinstance(record.get("config"), Mapping):
        return dict(record["config"])
    saved = run_dir / ".hydra" / "config.yaml"
    return yaml.safe_load(saved.read_text()) if saved.is_file() else None


def is_locked(run_dir: Path) -> bool:
    """Whether a process holds the run directory's lock now (it is running that run)."""
    path = Path(run_dir) / LOCK_FILE
    if not path.is_file():
        return False
    descriptor = os.open(path, os.O_RDWR)
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(descriptor)  # closing releases a lock this call took
    return False


def _number(value: Any) -> float | None:
    """A metric as a float (records store non-finite values as strings), None if it is not a number."""
    if isinstance(value, bool) or value is None:
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def index_entry(run_dir: Path, record: Mapping[str, Any], root: Path | None = None) -> dict[str, Any]:
    """One index line: where the run is, its keys, code version, status, and its numbers."""
    config = run_config(run_dir, record)
    code = record.get("code_version") or {}
    status = record.get("status", RUNNING)
    if status == RUNNING and not is_locked(run_dir):
        status = KILLED  # the record cannot tell; the lock can: no process is running it
    epsilon = record.get("epsilon") or {}
    return {
        "run_dir": str(run_dir.relative_to(root) if root else run_dir),
        "status": status,
        "error": record.get("error"),
        "run_key": config_key(config) if config else None,
        "setting_key": config_key(config, with_seed=False) if config else None,
        "seed": record.get("seed", (config or {}).get("seed")),
        "source_hash": code.get("source_hash", UNKNOWN_CODE),
        "commit": code.get("commit"),
        "dirty": code.get("dirty"),
        "machine": record.get("machine"),  # None for a record written before records kept it (stop 54)
        "started_at": record.get("started_at"),
        "task": record.get("task"),
        "model": record.get("model"),
        "clip": record.get("clip"),
        "target_epsilon": record.get("target_epsilon"),
        "epsilon_rdp": epsilon.get("rdp"),
        "steps": record.get("steps"),
        "steps_done": record.get("steps_done"),
        "epochs": record.get("epochs"),
        "metrics": {  # the task's metrics, and the run's epsilon under each accountant (epsilon_rdp, ...)
            **{name: _number(record.get(name)) for name in record.get("metric_names", [])},
            **{f"epsilon_{kind}": _number(value) for kind, value in epsilon.items()},
        },
        "wall_time_s": record.get("wall_time_s"),
        "throughput_examples_per_s": record.get("throughput_examples_per_s"),
    }


def scan(runs_root: Path, relative_to: Path | None = None) -> list[dict[str, Any]]:
    """Index entries of every run record under ``runs_root``, sorted by run directory."""
    entries = []
    for path in sorted(Path(runs_root).rglob(METRICS_FILE)):
        try:
            record = json.loads(path.read_text())
        except json.JSONDecodeError:  # a record being replaced right now cannot be half-written (atomic
            continue  # rename), but a foreign file may be: not a run record
        entries.append(index_entry(path.parent, record, relative_to))
    return entries


def write_index(entries: Sequence[Mapping[str, Any]], path: Path) -> None:
    """The index as JSONL, one run per line, sorted by run directory (a stable, diffable file)."""
    lines = [json.dumps(entry, sort_keys=True) for entry in sorted(entries, key=lambda e: e["run_dir"])]
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text("".join(line + "\n" for line in lines))


def read_index(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def find_runs(entries: Iterable[Mapping[str, Any]], run_key: str) -> list[Mapping[str, Any]]:
    """The entries of one run config (any code version, any status)."""
    return [entry for entry in entries if entry["run_key"] == run_key]


@dataclass
class Summary:
    """A setting's runs under one code version: mean and sample std of ``metric`` over the seeds of its
    completed runs (``values``), the other runs counted by status; on the current version's summary, ``older``
    holds each other code version's summary apart (never mixed in, nor mixed with one another)."""

    values: list[float] = field(default_factory=list)
    seeds: list[Any] = field(default_factory=list)
    statuses: Counter = field(default_factory=Counter)  # runs not completed, by status
    started: str = ""  # the latest ``started_at`` (UTC, ISO 8601) of the completed runs; "" for older records
    older: dict[str, Summary] = field(default_factory=dict)  # other code versions with a completed run
    lacking: int = 0  # completed runs of any code version whose records lack the metric (offline, older code)
    machines: Counter = field(default_factory=Counter)  # the completed runs' machines (:func:`machine_label`)

    @property
    def n(self) -> int:
        return len(self.values)

    @property
    def mean(self) -> float | None:
        return sum(self.values) / self.n if self.values else None

    @property
    def std(self) -> float | None:
        """Sample standard deviation (n - 1), as the papers' "over 3 seeds"; None below two seeds."""
        if self.n < 2:
            return None
        mean = self.mean
        return math.sqrt(sum((v - mean) ** 2 for v in self.values) / (self.n - 1))

    @property
    def latest_older(self) -> Summary | None:
        """The older code version a table shows where the current code has no run: the one with the most
        seeds, then the latest started (records without ``started_at`` count as oldest; a full tie: the
        version whose first run directory sorts first); None if none."""
        return max(self.older.values(), key=lambda s: (s.n, s.started), default=None)


def _finite(value: float | None) -> bool:
    return value is not None and math.isfinite(value)


def machine_label(machine: Mapping[str, Any] | None) -> str:
    """A run's machine in a few words: ``<cpu> (<instruction set>), torch <version>[, <gpu>]``."""
    if not machine:
        return "machine not recorded"
    gpu = f", {machine['gpu']}" if machine.get("gpu") else ""
    return f"{machine.get('cpu')} ({machine.get('cpu_capability')}), torch {machine.get('torch')}{gpu}"


def summarize(
    entries: Iterable[Mapping[str, Any]], setting_key: str, metric: str, source_hash: str
) -> Summary:
    """The :class:`Summary` of the runs of ``setting_key`` (all seeds) for ``metric`` under code version
    ``source_hash``: one completed run per seed (the first by run directory; a rerun of the same config and
    code is the same run), other statuses counted; each other code version summarized the same way, apart."""
    versions: dict[str, Summary] = {}
    taken: set[tuple[str, str]] = set()
    lacking: set[tuple[str, str]] = set()
    for entry in sorted(entries, key=lambda e: e["run_dir"]):
        if entry["setting_key"] != setting_key:
            continue
        version = versions.setdefault(entry["source_hash"], Summary())
        value = entry["metrics"].get(metric)
        run = (entry["source_hash"], entry["run_key"])
        if entry["status"] != COMPLETED:
            version.statuses[entry["status"]] += 1
        elif value is None:
            lacking.add(run)
        elif run not in taken and _finite(value):
            taken.add(run)
            version.values.append(value)
            version.seeds.append(entry["seed"])
            version.started = max(version.started, entry.get("started_at") or "")
            version.machines[machine_label(entry.get("machine"))] += 1
    summary = versions.pop(source_hash, Summary())
    summary.older = {code: older for code, older in versions.items() if older.n}
    summary.lacking = len(lacking)
    return summary
