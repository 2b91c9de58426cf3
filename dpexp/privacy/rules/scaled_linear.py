"""A linear layer whose outputs are scaled by a learned vector: Dory's ``DoryLMHead`` (Hugging Face
transformers 5.x), an LM head ``y = float(x W^T) * s`` with ``s = logit_scale * logit_scale_factor``, one
scale per vocabulary entry, in float32 whatever the model's dtype.

With ``z = x W^T`` and ``dy`` the output gradient (float32), ``dz = dy * s`` cast back to z's dtype (the
``float()`` cast's backward), so the weight's per-example gradient is the linear layer's with output
gradient ``dz``, ``dW_i = sum_t dz_{i,t} (x) x_{i,t}`` (an :class:`~dpexp.privacy.per_example.Outer`: the
ghost norm never forms the (V, d) gradient; Bu et al. 2023, eq. 2), and

    d logit_scale_i = logit_scale_factor * sum_t dy_{i,t} * float(z_{i,t}),

summed in float32 as autograd sums the batch's. ``z`` is recomputed from the captured input (one matmul,
the forward's own). Without the rule the exact fallback formed each example's (V, d) gradient: 1.5 s of a
3.3 s private step of the bench's ``dory`` entry (``scripts/engine_timers.py``, stop 57).
"""

from __future__ import annotations

import torch
from torch import nn

from dpexp.privacy.per_example import Dense, Outer, PerExampleGrad
from dpexp.privacy.rules import as_sequence, refuse, register_rule, unknown_parameters

_DORY = "transformers.models.dory.modeling_dory.DoryLMHead"


def _check(module: nn.Module) -> None:
    reason = unknown_parameters(module, {"weight", "logit_scale"})
    if reason is None and getattr(module, "bias", None) is not None:
        reason = "it has a bias, which its forward does not add before the scale as the rule assumes"
    refuse(module, "scaled-linear", "module", reason, "Freeze them, or register a rule.")


@register_rule(_DORY, check=_check, position_wise=True)
def scaled_head_grads(module: nn.Module, x: torch.Tensor, dy: torch.Tensor) -> dict[str, PerExampleGrad]:
    """``x`` (B, T, d) or (B, d), ``dy`` the float32 output gradient; see the module docstring."""
    a, g = as_sequence(x), as_sequence(dy)
    weight, factor = module.weight.detach(), module.logit_scale_factor
    scale = module.logit_scale.detach().float() * factor
    z = a.to(weight.dtype) @ weight.T  # (B, T, V): the forward's logits before the scale
    dz = (g * scale).to(z.dtype)
    grads: dict[str, PerExampleGrad] = {"weight": Outer(dz, a, module.weight.shape, dz.shape[-1])}
    scale_grad = (g * z.float()).sum(1) * factor  # float32, as the forward's product
    grads["logit_scale"] = Dense(scale_grad.to(module.logit_scale.dtype))
    return grads
