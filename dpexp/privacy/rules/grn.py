"""Global Response Normalization (ConvNeXt-V2, Woo et al. 2023, sec. 3; timm's
``GlobalResponseNorm``), channels-last (B, H, W, C) or channels-first (B, C, H, W):

    G_i[c] = ||x_i[c]||_2 over the spatial axes,   N_i[c] = G_i[c] / (mean_c G_i[c] + eps),
    y_i = x_i + beta + gamma * (x_i * N_i)

Both statistics are example i's own, so ``dgamma_i[c] = sum_hw dy_i[c] x_i[c] N_i[c]`` and
``dbeta_i[c] = sum_hw dy_i[c]``, recomputing ``N_i`` from the captured input. Without the rule the exact
``torch.func`` fallback recomputes the layer per example.
"""

from __future__ import annotations

import torch
from torch import nn

from dpexp.privacy.per_example import Dense, PerExampleGrad
from dpexp.privacy.rules import register_rule


@register_rule("timm.layers.grn.GlobalResponseNorm")
def grn_grads(module: nn.Module, x: torch.Tensor, dy: torch.Tensor) -> dict[str, PerExampleGrad]:
    """``x``, ``dy``: (B, H, W, C) or (B, C, H, W) as the module's layout; returns (B, C) for both."""
    spatial = module.spatial_dim
    x_g = x.norm(p=2, dim=spatial, keepdim=True)
    x_n = x_g / (x_g.mean(dim=module.channel_dim, keepdim=True) + module.eps)
    return {
        "weight": Dense((dy * x * x_n).sum(spatial)),
        "bias": Dense(dy.sum(spatial)),
    }
