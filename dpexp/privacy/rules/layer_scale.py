"""Layer scale (Touvron et al. 2021, CaiT sec. 2.1): a learned per-channel scale of a residual branch.

*Channels-last modules* (timm's ``LayerScale`` in ViT/DeiT-III/CaiT blocks, Hugging Face DINOv2/DINOv3's
``LayerScale``): ``y = x * lambda`` over the last axis, so ``dlambda_i = sum_t dy_{i,t} * x_{i,t}``, summed
over every axis between the batch and the channels (position-wise, as RMSNorm's scale). timm's in-place
variant (``inplace=True``: ``x.mul_(gamma)``) overwrites the input the rule reads, and is refused.

*ConvNeXt's block* (timm's ``ConvNeXtBlock``, Liu et al. 2022): the block
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
from dpexp.privacy.rules import as_sequence, register_rule

_HF = "transformers.models"
CHANNELS_LAST = [
    "timm.layers.layer_scale.LayerScale",
    f"{_HF}.dinov2.modeling_dinov2.Dinov2LayerScale",
    f"{_HF}.dinov2_with_registers.modeling_dinov2_with_registers.Dinov2WithRegistersLayerScale",
    f"{_HF}.dinov3_vit.modeling_dinov3_vit.DINOv3ViTLayerScale",
]


def _scale_parameter(module: nn.Module) -> str:
    """The module's one parameter: ``gamma`` (timm) or ``lambda1`` (Hugging Face)."""
    (name,) = [name for name, _ in module.named_parameters(recurse=False)]
    return name


def _check_channels_last(module: nn.Module) -> None:
    if getattr(module, "inplace", False):
        raise ValueError(
            f"{type(module).__name__}(inplace=True) scales its input in place, so the per-example gradient "
            "of its scale cannot be read from that input; build the model with inplace=False."
        )


@register_rule(*CHANNELS_LAST, check=_check_channels_last, position_wise=True)
def channels_last_scale_grads(
    module: nn.Module, x: torch.Tensor, dy: torch.Tensor
) -> dict[str, PerExampleGrad]:
    """``x``, ``dy``: (B, ..., C); returns ``dlambda`` (B, C)."""
    return {_scale_parameter(module): Dense(as_sequence(dy * x).sum(1))}


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
