"""What a rule reads from its module's submodules: kept by the capture during the module's training call
(:class:`~dpexp.privacy.rules.CallLayout`'s ``keeps``: the scan mixers' rules), or read in a second run of
the module (:func:`rerun`: the attention-sinks rule, which needs the probabilities the module returns)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def once(
    module: nn.Module, values: dict[str, list[Any]], taps: dict[str, tuple[str, str]], fix: str
) -> dict[str, Any]:
    """``{key: value}`` of ``values`` (key -> what the submodule ``taps[key]`` names received or returned in
    one call of ``module``), each submodule called exactly once, else refused with ``fix`` (what the user can
    do about it)."""
    counts = {taps[key][0]: len(found) for key, found in values.items()}
    if any(count != 1 for count in counts.values()):
        raise RuntimeError(
            f"{type(module).__name__}: its call called its submodules {counts} times, where the rule needs "
            f"each once; {fix}"
        )
    return {key: found[0] for key, found in values.items()}


def rerun(
    module: nn.Module, args: tuple, kwargs: dict[str, Any], taps: dict[str, tuple[str, str]], fix: str
) -> tuple[Any, dict[str, Any]]:
    """``(output, values)``: the module's output for the call ``(args, kwargs)``, run again under no_grad,
    and the values ``taps`` names (key -> (submodule, "input" or "output"); an input is the submodule's
    argument tuple), each submodule called once (:func:`once`)."""
    seen: dict[str, list[Any]] = {key: [] for key in taps}
    hooks = [
        module.get_submodule(name).register_forward_pre_hook(
            lambda _, inputs, key=key: seen[key].append(inputs)
        )
        if where == "input"
        else module.get_submodule(name).register_forward_hook(
            lambda _, __, out, key=key: seen[key].append(out)
        )
        for key, (name, where) in taps.items()
    ]
    try:
        with torch.no_grad():
            output = module(*args, **kwargs)
    finally:
        for hook in hooks:
            hook.remove()
    return output, once(module, seen, taps, fix)
