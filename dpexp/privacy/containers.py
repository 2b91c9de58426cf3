"""Tensors inside the nested values that modules take, return and keep: lists, tuples and mappings, their
subclasses too (Hugging Face's outputs are ``OrderedDict`` subclasses, caches may be named tuples). Pure
functions, shared by check 3's watch of module attributes (:mod:`~dpexp.privacy.state`) and check 4's replay
of layer calls (:mod:`~dpexp.privacy.verification`)."""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from typing import Any

import torch


def tensors_in(value: Any, levels: int = -1) -> list[torch.Tensor]:
    """The tensors in ``value``, in order: itself, or those in its lists, tuples and mappings, opening at most
    ``levels`` levels of them (negative: all)."""
    if torch.is_tensor(value):
        return [value]
    if levels == 0:
        return []
    if isinstance(value, Mapping):
        value = list(value.values())
    if isinstance(value, list | tuple):
        return [t for v in value for t in tensors_in(v, levels - 1)]
    return []


def map_tensors(value: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """``value`` with every tensor in its nested lists, tuples and dicts replaced by ``fn(tensor)``, each
    container rebuilt as its own type (a dict subclass copied, a named tuple by its fields); anything else
    as it is."""
    if torch.is_tensor(value):
        return fn(value)
    if isinstance(value, dict):
        out = copy.copy(value)
        out.update((k, map_tensors(v, fn)) for k, v in value.items())
        return out
    if isinstance(value, list):
        out = copy.copy(value)
        out[:] = [map_tensors(v, fn) for v in value]
        return out
    if isinstance(value, tuple):
        items = [map_tensors(v, fn) for v in value]
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    return value
