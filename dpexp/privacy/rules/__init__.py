"""Per-layer gradient rules, registered by module type.

A rule maps one call of a layer, given its input activation ``x`` (captured in the forward pass) and the
gradient ``dy`` of the loss with respect to its output (captured in the backward pass), to the per-example
gradients of the layer's own parameters, in factored form (:mod:`dpexp.privacy.per_example`). Norms, cross
terms of shared parameters and clipped sums are then the same code for every layer type.

Lookup is by exact type: a subclass that changes ``forward`` (such as a weight-standardised convolution)
must never silently inherit its parent's rule. Users register rules for their own layers with
:func:`register_rule`. Third-party layer types (transformers' ``Conv1D``, timm's ``LayerNorm``) are
registered by their qualified name, so that importing dpexp does not import those libraries.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from dpexp.privacy.per_example import PerExampleGrad

GradFn = Callable[[nn.Module, torch.Tensor, torch.Tensor], dict[str, PerExampleGrad]]
CheckFn = Callable[[nn.Module], None]


@dataclass(frozen=True)
class LayerRule:
    """``per_example_grads(module, x, dy) -> {param_name: PerExampleGrad}`` plus a construction-time check.

    ``x`` is the module's input and ``dy`` the gradient of the loss with respect to its output. A rule with a
    ``tap`` instead reads the input of the submodule of that name and the gradient with respect to that input:
    for parameters that enter the computation inside a larger module's forward (a Vision Transformer's class
    token and position embedding are added just before its ``pos_drop``).
    """

    per_example_grads: GradFn
    check: CheckFn | None = None
    expand_broadcast_input: bool = False  # inputs of batch size 1 are expanded to the batch (position ids)
    tap: str | None = None


_RULES: dict[str, LayerRule] = {}


def _qualified_name(module_type: type) -> str:
    return f"{module_type.__module__}.{module_type.__qualname__}"


def register_rule(
    *module_types: type[nn.Module] | str,
    check: CheckFn | None = None,
    expand_broadcast_input: bool = False,
    tap: str | None = None,
) -> Callable[[GradFn], GradFn]:
    """Decorator registering ``fn`` as the per-example gradient rule of ``module_types`` (classes, or
    qualified class names such as ``"transformers.pytorch_utils.Conv1D"``); see :class:`LayerRule`."""

    def decorate(fn: GradFn) -> GradFn:
        for module_type in module_types:
            key = module_type if isinstance(module_type, str) else _qualified_name(module_type)
            _RULES[key] = LayerRule(fn, check, expand_broadcast_input, tap)
        return fn

    return decorate


def rule_for(module: nn.Module) -> LayerRule | None:
    """The rule registered for exactly ``type(module)``, or None."""
    return _RULES.get(_qualified_name(type(module)))


def supported_types() -> list[str]:
    return sorted(name.rsplit(".", 1)[-1] for name in _RULES)


def as_sequence(x: torch.Tensor) -> torch.Tensor:
    """(B, ..., F) -> (B, T, F): every position between the batch and feature axes is a 'time step'."""
    return x.reshape(x.shape[0], -1, x.shape[-1])


# Importing the rule modules registers them.
from dpexp.privacy.rules import (  # noqa: E402,F401
    activation,
    conv,
    embedding,
    layer_scale,
    linear,
    norm,
    norm_act,
    rms_norm,
    vision_tokens,
    ws_conv,
)
