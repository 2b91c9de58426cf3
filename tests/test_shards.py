"""``--shard=I/N`` (tests/sharding.py), by which ``make test`` splits the suite over two processes: the parts
are disjoint and together hold every selected test, whatever order each process collected them in; the tests
recorded as heavy are balanced over the parts, and ``--record-durations`` merges what a part measured."""

from __future__ import annotations

import json
import random
import zlib
from types import SimpleNamespace

import pytest

from tests import sharding
from tests.conftest import pytest_collection_modifyitems


def _item(nodeid: str, together: str | None = None) -> SimpleNamespace:
    """A collected test as the hook sees it: its node id and its ``shard_together`` marker, if any."""
    marker = SimpleNamespace(args=(together,)) if together else None
    return SimpleNamespace(
        nodeid=nodeid, get_closest_marker=lambda name: marker if name == "shard_together" else None
    )


def _kept(
    shard: str, nodeids: list[str], together: dict[str, str] | None = None
) -> tuple[list[str], list[str]]:
    deselected: list[str] = []
    config = SimpleNamespace(
        getoption=lambda name: shard,
        hook=SimpleNamespace(pytest_deselected=lambda items: deselected.extend(i.nodeid for i in items)),
    )
    items = [_item(nodeid, (together or {}).get(nodeid)) for nodeid in nodeids]
    pytest_collection_modifyitems(config, items)
    return [item.nodeid for item in items], deselected


def test_the_shards_partition_the_tests_whatever_the_collection_order() -> None:
    nodeids = [f"tests/test_{m}.py::test_{k}[{p}]" for m in range(12) for k in range(30) for p in "ab"]
    for count in (2, 3):
        parts = []
        for index in range(count):
            shuffled = random.Random(index).sample(nodeids, len(nodeids))  # each process's own order
            kept, deselected = _kept(f"{index}/{count}", shuffled)
            assert sorted(kept + deselected) == sorted(nodeids)
            assert len(kept) > len(nodeids) / count * 0.8  # none of them nearly empty
            parts.append(set(kept))
        assert set().union(*parts) == set(nodeids) and sum(map(len, parts)) == len(nodeids)
    assert _kept(None, nodeids) == (nodeids, [])  # no --shard: everything, untouched


def test_tests_marked_shard_together_run_in_one_shard() -> None:
    """Tests sharing a costly module fixture (``shard_together(name)``) land in one part, so it is made once;
    the others still spread over every part."""
    nodeids = [f"tests/test_{m}.py::test_{k}" for m in range(6) for k in range(20)]
    together = dict.fromkeys(nodeids[:15], "fixture_a") | dict.fromkeys(nodeids[15:30], "fixture_b")
    for count in (2, 3):
        parts = [set(_kept(f"{index}/{count}", nodeids, together)[0]) for index in range(count)]
        assert set().union(*parts) == set(nodeids) and sum(map(len, parts)) == len(nodeids)
        for name in ("fixture_a", "fixture_b"):
            marked = {nodeid for nodeid, group in together.items() if group == name}
            assert sum(1 for part in parts if part & marked) == 1, (count, name)
        assert all(part - set(together) for part in parts)  # the unmarked tests reach every part


@pytest.mark.parametrize("shard", ["2/2", "1", "a/2", "-1/2"])
def test_a_malformed_shard_is_refused(shard: str) -> None:
    with pytest.raises(pytest.UsageError, match=f"--shard={shard}: expected I/N"):
        _kept(shard, ["tests/test_x.py::test_y"])


def test_heavy_tests_are_balanced_over_the_parts_and_the_split_ignores_the_order() -> None:
    """Keys recorded at or over HEAVY_S go longest first to the least-loaded part (LPT): the parts' heavy
    times end within 2 s of each other here, where hashing leaves them 20 s apart; light keys hash; any order
    of the keys gives the same split."""
    light = [f"tests/test_light.py::test_{k}" for k in range(200)]
    durations = {
        f"tests/test_heavy.py::test_{k}": float(seconds) for k, seconds in enumerate(range(30, 1, -1))
    }
    durations["shard_together:fixture"] = 12.5
    durations[light[0]] = 0.5  # under HEAVY_S: hashed like the others
    keys = [*light, *durations]
    for count in (2, 3):
        parts = sharding.assign(keys, count, durations)
        assert parts == sharding.assign(random.Random(count).sample(keys, len(keys)), count, durations)
        heavy = [
            sum(v for k, v in durations.items() if v >= sharding.HEAVY_S and parts[k] == i)
            for i in range(count)
        ]
        assert max(heavy) - min(heavy) <= 2.0, heavy
        assert all(parts[k] == zlib.crc32(k.encode()) % count for k in light)
    # hashing alone leaves them apart: the same keys without durations
    hashed = sharding.assign(keys, 2, {})
    apart = [sum(v for k, v in durations.items() if v >= 1 and hashed[k] == i) for i in range(2)]
    assert abs(apart[0] - apart[1]) > 20.0, apart


def test_recorded_durations_merge_into_the_file(tmp_path) -> None:
    """A part's measurements set its heavy keys, drop its light ones, keep the other parts' keys and forget
    the keys of test files that no longer exist."""
    (tmp_path / "tests").mkdir()
    for name in ("test_a.py", "test_b.py"):
        (tmp_path / "tests" / name).write_text("")
    path = tmp_path / "durations.json"
    before = {"tests/test_a.py::test_old": 3.0, "tests/test_gone.py::test_x": 9.0}
    path.write_text(json.dumps(before | {"tests/test_b.py::test_other_part": 4.0, "shard_together:f": 2.0}))
    measured = {"tests/test_a.py::test_old": 0.2, "tests/test_a.py::test_new": 5.04, "shard_together:f": 6.0}
    sharding.merge_durations(measured, tmp_path, path)
    assert json.loads(path.read_text()) == {
        "shard_together:f": 6.0,
        "tests/test_a.py::test_new": 5.0,
        "tests/test_b.py::test_other_part": 4.0,
    }
    assert not list(tmp_path.glob("*.tmp"))


def test_the_committed_durations_name_existing_tests() -> None:
    """tests/durations.json is what ``make test-durations`` wrote: every key a test file of this suite, every
    value at least HEAVY_S (``make test-durations`` refreshes it when tests move)."""
    durations = sharding.read_durations()
    assert durations, "tests/durations.json is missing: run make test-durations"
    root = sharding.DURATIONS_FILE.parent.parent
    for key, seconds in durations.items():
        assert seconds >= sharding.HEAVY_S
        assert key.startswith("shard_together:") or (root / key.split("::")[0]).is_file(), key
