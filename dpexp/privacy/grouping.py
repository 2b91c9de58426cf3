"""Partitions of the trainable parameters into clipping groups, and their thresholds.

One mechanism covers every clipping mode (He et al. 2023, sections 3 and 4):

* flat: one group holding every parameter (Abadi et al. 2016);
* per-layer: one group per module that owns trainable parameters (weight and bias together); modules that
  share a parameter (GPT-2's tied ``wte``/``lm_head``) are merged into one group, since a per-example
  gradient of a shared parameter is the sum over its uses;
* groups: explicit lists of parameter names, or an integer K for K contiguous stages of roughly equal
  size in parameter order (per-device clipping, He et al. section 4 / Algorithm 2).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

ClippingMode = Literal["flat", "per_layer", "groups"]


@dataclass(frozen=True)
class ParameterLayout:
    """What the partition needs to know about the model: parameters in order, with their owners."""

    names: list[str]  # trainable parameter names, in model order
    numel: dict[str, int]
    owners: dict[str, list[str]]  # parameter name -> names of the modules that use it


def partition(
    layout: ParameterLayout, clipping: ClippingMode, groups: Sequence[Sequence[str]] | int | None = None
) -> list[list[str]]:
    """Split ``layout.names`` into clipping groups; every trainable parameter lands in exactly one group."""
    if clipping == "flat":
        return [list(layout.names)]
    if clipping == "per_layer":
        return _per_module(layout)
    if clipping == "groups":
        if groups is None:
            raise ValueError(
                "clipping='groups' needs `groups`: a list of lists of parameter names, or an int K."
            )
        if isinstance(groups, int):
            return _contiguous(layout, groups)
        return _validated(layout, groups)
    raise ValueError(f"unknown clipping mode {clipping!r}; valid: 'flat', 'per_layer', 'groups'")


def _per_module(layout: ParameterLayout) -> list[list[str]]:
    parent = {name: name for name in layout.names}

    def root(x: str) -> str:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    by_module: dict[str, list[str]] = {}
    for name in layout.names:
        for module in layout.owners[name]:
            by_module.setdefault(module, []).append(name)
    for members in by_module.values():
        for other in members[1:]:
            parent[root(other)] = root(members[0])
    merged: dict[str, list[str]] = {}
    for name in layout.names:
        merged.setdefault(root(name), []).append(name)
    return list(merged.values())


def _contiguous(layout: ParameterLayout, k: int) -> list[list[str]]:
    if not 1 <= k <= len(layout.names):
        raise ValueError(f"groups={k}: need between 1 and {len(layout.names)} contiguous groups.")
    total = sum(layout.numel.values())
    n = len(layout.names)
    out: list[list[str]] = [[] for _ in range(k)]
    seen, stage = 0, 0
    for i, name in enumerate(layout.names):
        by_size = min(k - 1, seen * k // total)
        # never skip a stage, and leave at least one parameter for each later stage
        stage = max(min(by_size, stage + 1), k - (n - i), stage)
        out[stage].append(name)
        seen += layout.numel[name]
    return out


def _validated(layout: ParameterLayout, groups: Sequence[Sequence[str]]) -> list[list[str]]:
    known = set(layout.names)
    where: dict[str, int] = {}
    for k, group in enumerate(groups):
        for name in group:
            if name not in known:
                raise ValueError(
                    f"group {k} names {name!r}, which is not a trainable parameter of the model."
                )
            if name in where:
                raise ValueError(
                    f"parameter {name!r} is in groups {where[name]} and {k}; groups must not overlap."
                )
            where[name] = k
    missing = [n for n in layout.names if n not in where]
    if missing:
        raise ValueError(
            f"trainable parameters in no group: {missing[:5]}{'...' if len(missing) > 5 else ''}"
        )
    out = [list(g) for g in groups]
    if any(not g for g in out):
        raise ValueError("every group must contain at least one parameter")
    return out


def default_thresholds(max_grad_norm: float, num_groups: int) -> list[float]:
    """``C_k = C / sqrt(K)``, so that the total sensitivity ``sqrt(sum C_k^2)`` equals C."""
    return [max_grad_norm / math.sqrt(num_groups)] * num_groups


def group_label(k: int, names: Sequence[str]) -> str:
    """``"k path"``: group k's index and the module path its parameter names share (or its one name), e.g.
    ``"2 blocks.0.conv"``; the labels of the recorded adaptive thresholds and of per-layer analyses."""
    parts = [name.split(".") for name in names]
    common = itertools.takewhile(lambda column: len(set(column)) == 1, zip(*parts, strict=False))
    shared = [column[0] for column in common] if len(names) > 1 else parts[0]
    return f"{k} {'.'.join(shared) or names[0]}"
