"""``--shard=I/N``: the selected tests split over N pytest processes (``make test`` runs N = 2 at once, one
per core), and ``--record-durations``, which keeps the split even.

Every process collects every selected test and keeps its part. The split depends only on the set of selected
tests and on ``tests/durations.json``, never on the order of collection, so the N parts are disjoint and
together hold every test exactly once:

* a test that took at least ``HEAVY_S`` seconds when last measured goes, longest first, to the part with the
  least such time so far (ties: the lower index): a few hundred tests hold most of the suite's time, and
  hashing them left the two parts a minute and a half apart;
* every other test goes to the part its node id hashes to (crc32 modulo N): thousands of short tests, which
  hashing spreads evenly, new tests included.

Tests marked ``shard_together(name)`` move as one, under the key ``shard_together:<name>``, so that the
costly module fixture they share is made once. ``--record-durations`` merges what this process measured
(setup, call and teardown, by key) into ``tests/durations.json`` under a lock: each part records its own
tests (``make test-durations``); keys measured under ``HEAVY_S`` are dropped, as are those of deleted files.
"""

from __future__ import annotations

import collections
import fcntl
import json
import os
import zlib
from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest

DURATIONS_FILE = Path(__file__).with_name("durations.json")
HEAVY_S = 1.0


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--shard",
        default=None,
        metavar="I/N",
        help="run only part I of N (make test: N = 2 processes at once); tests/sharding.py says how",
    )
    parser.addoption(
        "--record-durations",
        action="store_true",
        help=f"merge the durations measured here into {DURATIONS_FILE.name}, by which --shard balances",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "shard_together(name): the tests of this name run in one --shard, so that the costly module fixture "
        "they share is made once (not once in every process)",
    )
    if config.getoption("--record-durations"):
        config.pluginmanager.register(_Recorder(), "dpexp_durations")


def shard_key(item: pytest.Item) -> str:
    """The unit the split moves: the test's node id, or its ``shard_together`` name."""
    marker = item.get_closest_marker("shard_together")
    return f"shard_together:{marker.args[0]}" if marker else item.nodeid


def assign(keys: Sequence[str], count: int, durations: Mapping[str, float]) -> dict[str, int]:
    """The part (0..count-1) of each key: heavy keys (``durations[key] >= HEAVY_S``) greedily, longest first,
    to the part with the least heavy time; the others by crc32 of the key modulo ``count``."""
    parts: dict[str, int] = {}
    load = [0.0] * count
    heavy = sorted(
        (k for k in set(keys) if durations.get(k, 0.0) >= HEAVY_S), key=lambda k: (-durations[k], k)
    )
    for key in heavy:
        parts[key] = min(range(count), key=lambda i: (load[i], i))
        load[parts[key]] += durations[key]
    for key in keys:
        if key not in parts:
            parts[key] = zlib.crc32(key.encode()) % count
    return parts


def read_durations(path: Path = DURATIONS_FILE) -> dict[str, float]:
    """The recorded durations by key; none when the file does not exist."""
    return json.loads(path.read_text()) if path.is_file() else {}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    shard = config.getoption("--shard")
    if shard is None:
        return
    index, _, count = shard.partition("/")
    if not (index.isdigit() and count.isdigit() and int(index) < int(count)):
        raise pytest.UsageError(f"--shard={shard}: expected I/N with 0 <= I < N, e.g. --shard=0/2")
    keys = [shard_key(item) for item in items]
    parts = assign(keys, int(count), read_durations())
    kept = [item for item, key in zip(items, keys, strict=True) if parts[key] == int(index)]
    deselected = [item for item, key in zip(items, keys, strict=True) if parts[key] != int(index)]
    config.hook.pytest_deselected(items=deselected)
    items[:] = kept


def merge_durations(measured: Mapping[str, float], root: Path, path: Path = DURATIONS_FILE) -> None:
    """``measured`` (seconds by key) merged into ``path`` under an exclusive lock, written atomically: a key
    at or over ``HEAVY_S`` is set (to 0.1 s), one under it removed, others kept unless their test file is gone
    from ``root``."""
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        durations = read_durations(path)
        for key, seconds in measured.items():
            if seconds >= HEAVY_S:
                durations[key] = round(seconds, 1)
            else:
                durations.pop(key, None)
        durations = {
            key: value
            for key, value in sorted(durations.items())
            if key.startswith("shard_together:") or (root / key.split("::")[0]).is_file()
        }
        temporary = path.with_suffix(f".{os.getpid()}.tmp")
        temporary.write_text(json.dumps(durations, indent=0, sort_keys=True) + "\n")
        os.replace(temporary, path)


class _Recorder:
    """Sums each test's setup, call and teardown time by shard key; merges them at the end of the session."""

    def __init__(self) -> None:
        self.keys: dict[str, str] = {}
        self.seconds: collections.Counter[str] = collections.Counter()

    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        self.keys.update((item.nodeid, shard_key(item)) for item in items)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.seconds[self.keys.get(report.nodeid, report.nodeid)] += report.duration

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        if self.seconds:
            merge_durations(self.seconds, Path(session.config.rootpath))
