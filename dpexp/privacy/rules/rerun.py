"""The second run some rules take of their module: its own forward once more, without recording, with hooks
that read what enters and leaves its submodules (the attention-sinks rule, the scan mixers' rules)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def rerun(
    module: nn.Module, args: tuple, kwargs: dict[str, Any], taps: dict[str, tuple[str, str]], fix: str
) -> tuple[Any, dict[str, Any]]:
    """``(output, values)``: the module's output for the call ``(args, kwargs)``, run again under no_grad,
    and the values ``taps`` names (key -> (submodule, "input" or "output"); an input is the submodule's
    argument tuple). Each tapped submodule must be called exactly once, else the run is refused with
    ``fix`` (what the user can do about it)."""
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
    counts = {taps[key][0]: len(values) for key, values in seen.items()}
    if any(count != 1 for count in counts.values()):
        raise RuntimeError(
            f"{type(module).__name__}: its second run called its submodules {counts} times, where the rule "
            f"needs each once; {fix}"
        )
    return output, {key: values[0] for key, values in seen.items()}
