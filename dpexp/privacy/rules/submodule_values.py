"""What a rule that follows its module's forward reads from its submodules: kept by the capture during the
module's training call (:class:`~dpexp.privacy.rules.CallLayout`'s ``keeps``: the scan mixers' rules), or
differentiated in a second run of the module (:func:`tangents`: the attention-sinks rule, which needs how
each head's output moves with its sink), with the gradients at kept values read off the call's graph
(:func:`gradients_at`: the nGPT and RWKV rules), handed to the rule with the kept values by
:func:`read_call`; and the checks such a rule makes: that it knows the module's parameters and reads plain
submodules (:func:`unfollowed`), and that its recomputation reproduces the module (:func:`reproduced`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn
from torch.autograd import forward_ad
from torch.func import functional_call
from torch.utils._pytree import tree_map

from dpexp.privacy.rules.functional import reproduces
from dpexp.privacy.rules.graph import GraphReads, produced_by


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
    module: nn.Module,
    what: str,
    recorded: torch.Tensor | Sequence[torch.Tensor],
    recomputed: torch.Tensor,
    fix: str,
) -> None:
    """Refuse a module whose ``what`` (``recorded`` in its call, or one of several candidates the call
    recorded, such as the values each of its sigmoid nodes kept) the rule's ``recomputed`` does not
    reproduce (:func:`~dpexp.privacy.rules.functional.reproduces`, in the recorded value's dtype): its
    forward is not the one the rule follows."""
    candidates = [recorded] if torch.is_tensor(recorded) else list(recorded)
    recomputed = recomputed.detach()
    if not any(reproduces(value, recomputed.to(value.dtype)) for value in candidates):
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


def tangents(
    module: nn.Module,
    args: tuple,
    kwargs: dict[str, Any],
    directions: dict[str, torch.Tensor],
    taps: dict[str, tuple[str, str]],
    fix: str,
) -> tuple[Any, dict[str, Any]]:
    """``(output, values)``: the tangents (forward-mode derivatives) of the module's output for the call
    ``(args, kwargs)`` and of the values ``taps`` names (key -> (submodule, "input" or "output"); an input
    is the submodule's argument tuple), each submodule called once (:func:`once`), when the module's own
    parameters move along ``directions`` (name -> tangent, shaped like the parameter). The call runs once
    more under no_grad, in forward mode: every tensor in the results that does not depend on the
    parameters is None. Raises what torch raises for an operation without a forward-mode derivative."""
    seen: dict[str, list[Any]] = {key: [] for key in taps}
    hooks = [
        module.get_submodule(name).register_forward_pre_hook(
            lambda _, inputs, key=key: seen[key].append(_tangent(inputs))
        )
        if where == "input"
        else module.get_submodule(name).register_forward_hook(
            lambda _, __, out, key=key: seen[key].append(_tangent(out))
        )
        for key, (name, where) in taps.items()
    ]
    try:
        with torch.no_grad(), forward_ad.dual_level():
            moved = {
                name: forward_ad.make_dual(getattr(module, name).detach(), tangent)
                for name, tangent in directions.items()
            }
            output = _tangent(functional_call(module, moved, args, kwargs))
    finally:
        for hook in hooks:
            hook.remove()
    return output, once(module, seen, taps, fix)


def _tangent(value: Any) -> Any:
    """``value`` with every tensor replaced by its forward-mode tangent (None where it has none)."""
    return tree_map(lambda x: forward_ad.unpack_dual(x).tangent if torch.is_tensor(x) else None, value)


def kept_tensor(value: Any) -> torch.Tensor:
    """A kept value as a tensor: an input's (argument tuple's) first argument, or an output."""
    return value[0] if isinstance(value, tuple) else value


def called_once(values: dict[str, list[Any]], keys: Iterable[str]) -> bool:
    """Whether each submodule that ``keys`` names gave exactly one kept value in the call."""
    return all(len(values[key]) == 1 for key in keys)


def gradients_at(values: dict[str, list[Any]], keys: tuple[str, ...]) -> GraphReads | None:
    """Graph reads of the gradients at the kept values ``keys`` (``d_<key>``), at the nodes that produced
    them (:func:`~dpexp.privacy.rules.graph.produced_by`); None where a submodule was not called once or a
    value has no such node (no gradient reaches it, or it is another output of its node)."""
    if not called_once(values, keys):
        return None
    nodes = {f"d_{key}": produced_by(kept_tensor(values[key][0])) for key in keys}
    return None if any(node is None for node in nodes.values()) else GraphReads({}, nodes)


def read_call(
    module: nn.Module,
    call: tuple,
    keeps: dict[str, tuple[str, str]] | None,
    rule: str,
    fix: str,
    inputs: int = 1,
) -> tuple[tuple, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """``(inputs, kept values, graph reads)`` of a call that the capture recorded as its first ``inputs``
    entries, the kept values ``keeps`` names if the layout keeps any (each submodule called once,
    :func:`once`; detached tensors; ``{}`` without keeps) and the graph's reads; refused (the ``rule``
    named, ``fix`` appended) where the graph gave none."""
    entries = inputs + (1 if keeps is None else 2)
    if len(call) < entries:
        raise ValueError(
            f"{type(module).__name__}: the {rule} rule reads gradients inside the call off its autograd "
            "graph, which lacks them here (no gradient reaches the values it reads, autocast's copies of "
            "the parameters, hooks on saved tensors such as activation checkpointing's, or a submodule "
            f"called other than once). {fix}"
        )
    if keeps is None:
        return call[:inputs], {}, call[inputs]
    seen = once(module, call[inputs], keeps, f"register a rule for its type. {fix}")
    kept = {key: kept_tensor(value).detach() for key, value in seen.items()}
    return call[:inputs], kept, call[inputs + 1]
