"""``nn.Linear`` (and timm's ``Linear``, the same ``F.linear`` outside TorchScript; MobileNetV3's head; and
Falcon's ``FalconLinear``, ``x @ W.T + b``) and Hugging Face's GPT-2 ``Conv1D`` (a linear layer with a
transposed weight).

For ``y_t = W x_t + b`` (W of shape (d, p)) the per-example gradients are
``dW_i = sum_t dy_{i,t} (x) x_{i,t}`` and ``db_i = sum_t dy_{i,t}`` (Bu et al. 2023, eq. 2).
"""

from __future__ import annotations

import torch
from torch import nn

from dpexp.privacy.per_example import Dense, Outer, PerExampleGrad
from dpexp.privacy.rules import as_sequence, register_rule


@register_rule(
    nn.Linear,
    "timm.layers.linear.Linear",
    "transformers.models.falcon.modeling_falcon.FalconLinear",
    position_wise=True,
    private_output=True,
)
def linear_grads(module: nn.Linear, x: torch.Tensor, dy: torch.Tensor) -> dict[str, PerExampleGrad]:
    a, g = as_sequence(x), as_sequence(dy)
    grads: dict[str, PerExampleGrad] = {"weight": Outer(g, a, module.weight.shape, g.shape[-1])}
    if module.bias is not None:
        grads["bias"] = Dense(g.sum(1))
    return grads


@register_rule("transformers.pytorch_utils.Conv1D", position_wise=True, private_output=True)
def conv1d_transposed_grads(
    module: nn.Module, x: torch.Tensor, dy: torch.Tensor
) -> dict[str, PerExampleGrad]:
    """GPT-2's ``Conv1D``: ``y = x W + b``, W of shape (p, d), so ``dW_i = sum_t x_{i,t} (x) dy_{i,t}``."""
    a, g = as_sequence(x), as_sequence(dy)
    return {"weight": Outer(a, g, module.weight.shape, a.shape[-1]), "bias": Dense(g.sum(1))}
