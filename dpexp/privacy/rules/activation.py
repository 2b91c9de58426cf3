"""``nn.PReLU``: ``y = max(0, x) + a * min(0, x)`` with one slope ``a`` for all channels or one per channel
(dim 1). Its per-example gradient, ``da_i = sum dy_i * min(0, x_i)`` over every axis the slope is broadcast
along, has as many values as the slopes, so it is held explicitly."""

from __future__ import annotations

import torch
from torch import nn

from dpexp.privacy.per_example import Dense, PerExampleGrad
from dpexp.privacy.rules import register_rule


@register_rule(nn.PReLU)
def prelu_grads(module: nn.PReLU, x: torch.Tensor, dy: torch.Tensor) -> dict[str, PerExampleGrad]:
    product = dy * x.clamp(max=0)
    if module.num_parameters == 1:
        return {"weight": Dense(product.flatten(1).sum(1, keepdim=True))}
    reduce = tuple(range(2, x.dim()))  # a slope per channel (dim 1)
    return {"weight": Dense(product.sum(reduce) if reduce else product)}
