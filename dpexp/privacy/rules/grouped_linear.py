"""A block-diagonal grouped linear layer: DeepSeek-V4's ``DeepseekV4GroupedLinear``, its attention's grouped
low-rank output projection (the heads' outputs split into G groups, each projected on its own before one
mixing ``nn.Linear``).

The input's last two axes (G, n) are G groups of n features, and group g is projected by its own block
``W_g`` (m, n) of the weight (G m, n): ``y_g = W_g x_g`` (no bias: the forward adds none). Example i's
gradient of block g is ``sum_t dy_{t,g} (x) x_{t,g}`` over its positions, the mixture-of-experts
factorisation (:class:`~dpexp.privacy.per_example.Routed`, after Bu et al. 2023, eq. 2) with every
(position, group) row routed to the expert g: its norm is taken pair by pair (example, group), ghost or
instantiated, and its clipped sum is one product per group, what the non-private weight gradient costs.
Without the rule the layer took the exact fallback, which recomputed it per example.
"""

from __future__ import annotations

import torch
from torch import nn

from dpexp.privacy.per_example import PerExampleGrad, Routed
from dpexp.privacy.rules import refuse, register_rule

_DEEPSEEK_V4 = "transformers.models.deepseek_v4.modeling_deepseek_v4.DeepseekV4GroupedLinear"


def _check(module: nn.Module) -> None:
    bias = module.bias is not None and module.bias.requires_grad
    reason = "it has a trainable bias, which its forward never adds" if bias else None
    refuse(module, "grouped-linear", "layer", reason, "Freeze the bias, or remove it (bias=False).")


@register_rule(_DEEPSEEK_V4, check=_check, position_wise=True)
def grouped_linear_grads(module: nn.Module, x: torch.Tensor, dy: torch.Tensor) -> dict[str, PerExampleGrad]:
    """``x`` (B, ..., G, n) and ``dy`` (B, ..., G, m): the weight's per-example gradient (B, G m, n) as
    :class:`Routed` rows, one per example, position and group (group g's rows its expert g's)."""
    groups, batch = module.n_groups, x.shape[0]
    rows = x.detach().reshape(-1, x.shape[-1])  # (B T G, n), example-major, the group fastest
    grads = dy.reshape(rows.shape[0], -1).to(rows.dtype)  # (B T G, m)
    expert = torch.arange(groups, device=x.device).repeat(rows.shape[0] // groups)
    example = torch.arange(batch, device=x.device).repeat_interleave(rows.shape[0] // batch)
    return {"weight": Routed(grads, rows, expert, example, batch, module.weight.shape, groups)}
