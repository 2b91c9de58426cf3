"""Activations with parameters. ``nn.PReLU``: ``y = max(0, x) + a * min(0, x)`` with one slope ``a`` for all
channels or one per channel (dim 1). Its per-example gradient, ``da_i = sum dy_i * min(0, x_i)`` over every
axis the slope is broadcast along, has as many values as the slopes, so it is held explicitly. Hugging Face's
``XIELUActivation`` (xIELU, Huang et al. 2024; Apertus' MLPs), with its two scalar parameters, likewise."""

from __future__ import annotations

import torch
from torch import nn

from dpexp.privacy.per_example import Dense, PerExampleGrad
from dpexp.privacy.rules import refuse, register_rule


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
