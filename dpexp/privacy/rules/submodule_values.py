"""What a rule that follows its module's forward reads from its submodules: kept by the capture during the
module's training call (:class:`~dpexp.privacy.rules.CallLayout`'s ``keeps``: the scan mixers' rules), or
read in a second run of the module (:func:`rerun`: the attention-sinks rule, which needs the probabilities
the module returns); and the checks such a rule makes: that it knows the module's parameters and reads
plain submodules (:func:`unfollowed`), and that its recomputation reproduces the module (:func:`reproduced`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from dpexp.privacy.rules.functional import reproduces


def unfollowed(module: nn.Module, own: set[str], plain: dict[str, type]) -> str | None:
    """Why a rule that recomputes ``module`` with its submodules' weights cannot follow it: trainable
    parameters of its own other than ``own``, or a submodule of ``plain`` (name -> type) wrapped or replaced;
    None if it can."""
    unknown = sorted(
        name for name, p in module.named_parameters(recurse=False) if p.requires_grad and name not in own
    )
    wrapped = [
        f"{name} is a {type(getattr(module, name, None)).__name__}"
        for name, kind in plain.items()
        if type(getattr(module, name, None)) is not kind
    ]
    if unknown:
        return f"it owns parameters {unknown} the rule does not know"
    if wrapped:
        return (
            f"{', '.join(wrapped)}, not the plain module whose weights the rule reads; leave them unwrapped "
            "(adapters on the layers it calls are fine)"
        )
    return None


def reproduced(
    module: nn.Module, what: str, recorded: torch.Tensor, recomputed: torch.Tensor, fix: str
) -> None:
    """Refuse a module whose ``what`` (``recorded`` in its call) the rule's ``recomputed`` does not
    reproduce (:func:`~dpexp.privacy.rules.functional.reproduces`): its forward is not the one the rule
    follows."""
    if not reproduces(recorded, recomputed.detach()):
        raise RuntimeError(
            f"{type(module).__name__}: the rule's recomputation of {what} does not reproduce the module's "
            "(its forward differs from the one the rule follows); register a rule for its type "
            f"(dpexp.privacy.rules.register_rule). {fix}"
        )


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
