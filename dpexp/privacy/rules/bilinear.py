"""``nn.Bilinear``: ``y_t = x1_t^T A x2_t + b``, A of shape (d, p, q), over any positions between the batch
and feature axes.

Example i's gradients are sums over its positions of outer products (Bu et al. 2023, eq. 2, with the pair
``x1_t (x) x2_t`` as the layer's input):

    dA_i = sum_t dy_{i,t} (x) (x1_{i,t} (x) x2_{i,t}),   db_i = sum_t dy_{i,t},

in the factored :class:`~dpexp.privacy.per_example.Outer` form, the right factor the (p*q)-vector of the
pair (as large as the layer's own per-position product). Refused at the call: an unbatched (1-D) input.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from dpexp.privacy.per_example import Dense, Outer, PerExampleGrad
from dpexp.privacy.rules import CallLayout, register_rule


def bilinear_inputs(module: nn.Bilinear, args: tuple, kwargs: dict[str, Any]) -> tuple:
    """``(x1 (B, ..., p), x2 (B, ..., q))``."""
    x1 = args[0] if args else kwargs["input1"]
    x2 = args[1] if len(args) > 1 else kwargs["input2"]
    if x1.dim() < 2:
        raise ValueError(
            f"got unbatched inputs of shapes {tuple(x1.shape)} and {tuple(x2.shape)}; the privacy engine "
            "needs the batch in dim 0: pass (B, ..., in1_features) and (B, ..., in2_features)"
        )
    return x1, x2


def bilinear_output_grad(module: nn.Bilinear, grads: list[torch.Tensor | None]) -> torch.Tensor:
    """The output's gradient (B, ..., d) as (B, T*d)."""
    return grads[0].reshape(grads[0].shape[0], -1)


@register_rule(nn.Bilinear, call=CallLayout(bilinear_inputs, bilinear_output_grad))
def bilinear_grads(
    module: nn.Bilinear, x: tuple[torch.Tensor, torch.Tensor], dy: torch.Tensor
) -> dict[str, PerExampleGrad]:
    x1, x2 = x
    batch = x1.shape[0]
    a1, a2 = x1.reshape(batch, -1, x1.shape[-1]), x2.reshape(batch, -1, x2.shape[-1])
    pair = (a1.unsqueeze(-1) * a2.unsqueeze(-2)).flatten(2)  # (B, T, p*q)
    g = dy.reshape(batch, -1, module.out_features)
    grads: dict[str, PerExampleGrad] = {"weight": Outer(g, pair, module.weight.shape, g.shape[-1])}
    if module.bias is not None:
        grads["bias"] = Dense(g.sum(1))
    return grads
