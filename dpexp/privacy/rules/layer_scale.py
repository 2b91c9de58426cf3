"""Layer scale (Touvron et al. 2021, CaiT sec. 2.1) of timm's ``ConvNeXtBlock`` (Liu et al. 2022): the block
owns ``gamma`` (C,) and computes ``v = u * gamma`` (per channel) from its branch output ``u``, then
``drop_path(v) + shortcut``.

The rule taps ``drop_path``: it receives ``v`` (B, C, H, W) and ``dz = dL/dv`` (drop-path's per-example
mask included), and ``dgamma_i[c] = sum_hw dz_i[c] u_i[c] = (sum_hw dz_i[c] v_i[c]) / gamma[c]``. Each
term is exact to the rounding of the product ``u * gamma`` itself (relative 2^-24 in float32) while
``|gamma[c]|`` is at least ``sqrt(finfo.tiny)`` (1e-19 in float32; ConvNeXt starts at 1e-6); below that,
``u`` cannot be recovered from ``v``, and the rule refuses (naming the fix) rather than guess. That check
reads ``gamma`` once per block and step (a device synchronisation on GPU). Without the rule, the exact
``torch.func`` fallback would recompute each whole block per example.
"""

from __future__ import annotations

import torch
from torch import nn

from dpexp.privacy.per_example import Dense, PerExampleGrad
from dpexp.privacy.rules import register_rule


def _check(module: nn.Module) -> None:
    own = {name for name, p in module.named_parameters(recurse=False) if p.requires_grad}
    if own != {"gamma"} or not isinstance(getattr(module, "drop_path", None), nn.Module):
        raise ValueError(
            f"{type(module).__name__}: the privacy engine's layer-scale rule expects the block's own "
            f"trainable parameters to be just `gamma` and a drop_path module after it; got {sorted(own)}. "
            "Freeze these parameters or register a rule for the block."
        )


@register_rule("timm.models.convnext.ConvNeXtBlock", check=_check, tap="drop_path")
def layer_scale_grads(module: nn.Module, v: torch.Tensor, dz: torch.Tensor) -> dict[str, PerExampleGrad]:
    """``v``, ``dz``: (B, C, H, W) at the input of ``module.drop_path``; returns ``dgamma`` (B, C)."""
    gamma = module.gamma.detach()
    floor = torch.finfo(v.dtype).tiny ** 0.5
    if not bool((gamma.abs() >= floor).all()):
        raise ValueError(
            f"{type(module).__name__}: a layer-scale gamma is below {floor:.1e} in magnitude, where its "
            "per-example gradient cannot be formed from the scaled branch; re-initialise it (e.g. "
            "ls_init_value=1e-6) or freeze it (requires_grad=False)."
        )
    scaled = (dz * v).sum((2, 3))
    return {"gamma": Dense(scaled / gamma.to(scaled.dtype))}
