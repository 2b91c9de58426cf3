"""timm's fused GroupNorm + activation layers ``GroupNormAct`` and ``GroupNorm1Act`` (the norm of timm CNNs
built with a GroupNorm ``norm_layer``, e.g. EfficientNet / MobileNetV2 without BatchNorm):

    y = act(z),   z = x_hat * w + b,   x_hat = GroupNorm(x) without affine (Wu & He 2018, eq. 1)

The output gradient ``dy`` arrives after the activation, so ``dz = act'(z) * dy`` is formed first, by a
vector-Jacobian product of the module's own (elementwise, parameter-free) activation at the recomputed ``z``;
then, as for ``nn.GroupNorm``, ``dw_i = sum_hw dz_i * x_hat_i`` and ``db_i = sum_hw dz_i`` (small: held
explicitly). Recomputing ``z`` is one group norm; the forward pass is left untouched.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dpexp.privacy.per_example import Dense, PerExampleGrad
from dpexp.privacy.rules import refuse, register_rule

_TIMM = "timm.layers.norm_act"


def _check(module: nn.Module) -> None:
    reason = None
    if not isinstance(module.drop, nn.Identity):
        reason = f"its drop layer {type(module.drop).__name__} is random, so z cannot be recomputed"
    elif any(True for _ in module.act.parameters()):
        reason = f"its activation {type(module.act).__name__} has parameters of its own"
    elif not module.affine:
        reason = "it has no affine parameters"
    refuse(
        module,
        "norm + activation",
        "layer",
        reason,
        "Build it with drop_layer=None and a parameter-free activation, or register a rule.",
    )


def _broadcast(p: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return p.view(1, -1, *([1] * (x.dim() - 2)))


@register_rule(f"{_TIMM}.GroupNormAct", f"{_TIMM}.GroupNorm1Act", check=_check)
def group_norm_act_grads(
    module: nn.GroupNorm, x: torch.Tensor, dy: torch.Tensor
) -> dict[str, PerExampleGrad]:
    """``x``, ``dy``: (B, C, *spatial). The activation's vector-Jacobian product is exact for any
    elementwise activation (ReLU, SiLU, hard-swish, GELU, identity)."""
    x_hat = F.group_norm(x.detach(), module.num_groups, eps=module.eps)
    with torch.enable_grad():
        z = (
            x_hat * _broadcast(module.weight.detach(), x) + _broadcast(module.bias.detach(), x)
        ).requires_grad_()
        (dz,) = torch.autograd.grad(module.act(z.clone()), z, dy)  # clone: timm's activations are in place
    reduce = tuple(range(2, x.dim()))
    return {"weight": Dense((dz * x_hat).sum(reduce)), "bias": Dense(dz.sum(reduce))}
