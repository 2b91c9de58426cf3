"""Activations with parameters. ``nn.PReLU``: ``y = max(0, x) + a * min(0, x)`` with one slope ``a`` for all
channels or one per channel (dim 1). Its per-example gradient, ``da_i = sum dy_i * min(0, x_i)`` over every
axis the slope is broadcast along, has as many values as the slopes, so it is held explicitly. Hugging Face's
``XIELUActivation`` (xIELU, Huang et al. 2024; Apertus' MLPs), with its two scalar parameters, likewise.

Also which activations act on each value alone (:func:`activation_refusal`): the rules of modules that apply
one inside (experts' gates, BiT's norm) take its derivative elementwise, and refuse another; and softplus's
derivative (:func:`softplus_backward`) for the rules that carry a gradient through one (decay rates)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dpexp.privacy.per_example import Dense, PerExampleGrad
from dpexp.privacy.rules import qualified_name, refuse, register_rule

ELEMENTWISE = {  # activations acting on each value alone (their derivative is taken by autograd)
    f"transformers.activations.{name}"
    for name in (
        "SiLUActivation",
        "GELUActivation",
        "GELUTanh",
        "NewGELUActivation",
        "FastGELUActivation",
        "QuickGELUActivation",
        "AccurateGELUActivation",
        "ClippedGELUActivation",
        "ReLUSquaredActivation",
        "LaplaceActivation",
        "LinearActivation",
        "MishActivation",
        "SqrtSoftplusActivation",
    )
} | {
    f"torch.nn.modules.activation.{name}"
    for name in ("SiLU", "GELU", "ReLU", "ReLU6", "LeakyReLU", "Tanh", "Sigmoid", "Hardswish", "Mish")
}
ELEMENTWISE_FUNCTIONS = (F.silu, F.gelu, F.relu, F.mish, torch.tanh, torch.sigmoid)  # LFM2-MoE: F.silu


def activation_refusal(act: Any, whose: str, otherwise: str) -> tuple[str, str] | None:
    """(reason, fix) if ``act`` (a module or a function) is not an activation known to act elementwise
    (:data:`ELEMENTWISE`, :data:`ELEMENTWISE_FUNCTIONS`), else None; ``otherwise``: the fix besides a known
    activation (what to freeze)."""
    if isinstance(act, nn.Module):
        known = qualified_name(type(act)) in ELEMENTWISE and not any(True for _ in act.parameters())
    else:  # a function: known by identity
        known = any(act is function for function in ELEMENTWISE_FUNCTIONS)
    if known:
        return None
    name = type(act).__name__ if isinstance(act, nn.Module) else getattr(act, "__name__", repr(act))
    known_names = [n.rsplit(".", 1)[1] for n in ELEMENTWISE] + [f.__name__ for f in ELEMENTWISE_FUNCTIONS]
    return (
        f"{whose} activation {name} is not one it knows to act elementwise",
        f"Use one of {sorted(known_names)}, or {otherwise}.",
    )


def softplus_backward(grad: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``grad * softplus'(x)`` for ``F.softplus`` at its defaults (beta 1, threshold 20: above it softplus is
    the identity, derivative 1), as autograd takes it: ``grad`` and ``x`` of one shape."""
    return torch.ops.aten.softplus_backward(grad, x, 1.0, 20.0)


@register_rule(nn.PReLU)
def prelu_grads(module: nn.PReLU, x: torch.Tensor, dy: torch.Tensor) -> dict[str, PerExampleGrad]:
    product = dy * x.clamp(max=0)
    if module.num_parameters == 1:
        return {"weight": Dense(product.flatten(1).sum(1, keepdim=True))}
    reduce = tuple(range(2, x.dim()))  # a slope per channel (dim 1)
    return {"weight": Dense(product.sum(reduce) if reduce else product)}


def _check_xielu(module: nn.Module) -> None:
    refuse(
        module,
        "xIELU",
        "activation",
        "it runs the fused xIELU CUDA kernel" if module._xielu_cuda_obj is not None else None,
        "Uninstall the xielu package (the Python form is the one the rule reproduces), or freeze it.",
    )


@register_rule("transformers.activations.XIELUActivation", check=_check_xielu, position_wise=True)
def xielu_grads(module: nn.Module, x: torch.Tensor, dy: torch.Tensor) -> dict[str, PerExampleGrad]:
    """xIELU: ``y = a_p x^2 + beta x`` where ``x > 0``, ``a_n (expm1(min(x, eps)) - x) + beta x`` elsewhere,
    with ``a_p = softplus(alpha_p)`` and ``a_n = beta + softplus(alpha_n)``; so ``d alpha_p_i = sum dy * x^2 *
    sigmoid(alpha_p)`` over example i's positive values and ``d alpha_n_i = sum dy * (expm1(min(x, eps)) -
    x) * sigmoid(alpha_n)`` over the others, each (1,) per example."""
    positive = x > 0
    zero = x.new_zeros(())
    for_p = torch.where(positive, x * x, zero) * torch.sigmoid(module.alpha_p.detach())
    for_n = torch.where(positive, zero, torch.expm1(torch.min(x, module.eps)) - x)
    for_n = for_n * torch.sigmoid(module.alpha_n.detach())
    return {
        "alpha_p": Dense((dy * for_p).flatten(1).sum(1, keepdim=True)),
        "alpha_n": Dense((dy * for_n).flatten(1).sum(1, keepdim=True)),
    }
