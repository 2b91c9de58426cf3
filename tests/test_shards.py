"""``--shard=I/N`` (tests/conftest.py), by which ``make test`` splits the suite over two processes: the parts
are disjoint and together hold every selected test, whatever order each process collected them in."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

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
