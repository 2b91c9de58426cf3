"""``--shard=I/N`` (tests/conftest.py), by which ``make test`` splits the suite over two processes: the parts
are disjoint and together hold every selected test, whatever order each process collected them in."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from tests.conftest import pytest_collection_modifyitems


def _kept(shard: str, nodeids: list[str]) -> tuple[list[str], list[str]]:
    deselected: list[str] = []
    config = SimpleNamespace(
        getoption=lambda name: shard,
        hook=SimpleNamespace(pytest_deselected=lambda items: deselected.extend(i.nodeid for i in items)),
    )
    items = [SimpleNamespace(nodeid=nodeid) for nodeid in nodeids]
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


@pytest.mark.parametrize("shard", ["2/2", "1", "a/2", "-1/2"])
def test_a_malformed_shard_is_refused(shard: str) -> None:
    with pytest.raises(pytest.UsageError, match=f"--shard={shard}: expected I/N"):
        _kept(shard, ["tests/test_x.py::test_y"])
