"""The nested-container walkers that checks 3 and 4 share (``dpexp/privacy/containers.py``)."""

from __future__ import annotations

from collections import OrderedDict, namedtuple

import torch

from dpexp.privacy.containers import map_tensors, tensors_in
from dpexp.privacy.verification import replaced_example

Pair = namedtuple("Pair", ["first", "second"])


class Output(OrderedDict):
    """A mapping subclass, as Hugging Face's model outputs are."""


def test_tensors_in_order_and_levels():
    a, b, c, d = (torch.full((1,), float(i)) for i in range(4))
    value = [a, {"x": (b, [c])}, Pair(d, None), "text"]
    assert [t.item() for t in tensors_in(value)] == [0, 1, 2, 3]
    assert [t.item() for t in tensors_in(value, levels=3)] == [0, 1, 3]  # c sits in a fourth level
    assert [t.item() for t in tensors_in(value, levels=1)] == [0]
    assert tensors_in(a, levels=0) == [a] and tensors_in(7) == []


def test_map_tensors_rebuilds_each_container_as_its_type():
    a, b = torch.ones(2), torch.zeros(3)
    value = Output(first=Pair(a, 5), rest=[b, "s"])
    out = map_tensors(value, lambda t: t + 1)
    assert type(out) is Output and type(out["first"]) is Pair and out["first"].second == 5
    assert torch.equal(out["first"].first, a + 1) and torch.equal(out["rest"][0], b + 1)
    assert out["rest"][1] == "s"
    assert torch.equal(value["first"].first, a)  # the input is left as it was


def test_replaced_example_through_a_named_tuple_argument():
    """Check 4's replacement of example 0 reaches tensors inside a named tuple (it used to fail rebuilding
    one) and keeps its type."""
    x = torch.arange(6.0).view(3, 2)
    args, kwargs = replaced_example((Pair(x, x.clone()),), {"mask": Output(m=x.clone())}, batch_size=3)
    assert type(args[0]) is Pair and type(kwargs["mask"]) is Output
    for t in (args[0].first, args[0].second, kwargs["mask"]["m"]):
        assert torch.equal(t[0], x[1]) and torch.equal(t[1:], x[1:])
