"""Layer scale (Touvron et al. 2021, CaiT sec. 2.1): a learned per-channel scale of a residual branch.

*Channels-last modules* (timm's ``LayerScale`` in ViT/DeiT-III/CaiT blocks, Hugging Face DINOv2/DINOv3's
``LayerScale``): ``y = x * lambda`` over the last axis, so ``dlambda_i = sum_t dy_{i,t} * x_{i,t}``, summed
over every axis between the batch and the channels (position-wise, as RMSNorm's scale). timm's in-place
variant (``inplace=True``: ``x.mul_(gamma)``) overwrites the input the rule reads, and is refused.

*ConvNeXt's block* (timm's ``ConvNeXtBlock``, Liu et al. 2022, sec. 2.6; Hugging Face's ``ConvNextLayer``,
whose scale is ``layer_scale_parameter``, applied channels-last before the permute back; torchvision's
``CNBlock``, whose ``layer_scale`` is (C, 1, 1)): the block owns ``gamma`` (C,)
and computes ``v = u * gamma`` (per channel) from its branch output ``u``, then ``drop_path(v) + shortcut``.

The rule taps ``drop_path``: it receives ``v`` (B, C, H, W) and ``dz = dL/dv`` (drop-path's per-example
mask included), and ``dgamma_i[c] = sum_hw dz_i[c] u_i[c] = (sum_hw dz_i[c] v_i[c]) / gamma[c]``. Each
term is exact to the rounding of the product ``u * gamma`` itself (relative 2^-24 in float32) while
``|gamma[c]|`` is at least ``sqrt(finfo.tiny)`` (1e-19 in float32; ConvNeXt starts at 1e-6); below that,
``u`` cannot be recovered from ``v``, and the rule refuses (naming the fix) rather than guess. That check
reads ``gamma`` once per block and step (a device synchronisation on GPU). Without the rule, the exact
``torch.func`` fallback would recompute each whole block per example. torchvision's block adds the shortcut
to ``v`` in place (``result += input``), so ``v`` is gone by the backward; its rule taps the branch's output
``u`` instead, whose gradient ``gamma dL/dv`` gives the same ``(sum_hw dz_i[c] u_i[c]) / gamma[c]``.

*BEiT's layer* (Hugging Face's ``BeitLayer``, Bao et al. 2022 sec. 2.5, the CaiT layer scale): the layer owns
``lambda_1``, ``lambda_2`` (C,) and computes, on both residual branches in turn,
``h = drop_path(lambda_k * dropout(branch_k(...))) + h`` with its one ``drop_path`` (per-example mask, or
``nn.Identity`` at rate 0). The rule taps ``drop_path`` as ConvNeXt's does; its call k (0: attention, 1: MLP,
counted by the capture within each call of the layer) gives ``v = lambda_{k+1} * u`` (B, T, C) and ``dz``, so
``dlambda_{k+1, i} = (sum_t dz_i v_i) / lambda_{k+1}``, with the same floor on ``|lambda|``; the other lambda
gets zero from that call. Without the rule, the fallback recomputed the whole layer per example (7.3x the
non-private step, and it refused drop-path, which the recomputation could not reproduce). PoolFormer's layer
(Yu et al. 2022, MetaFormer; Hugging Face's ``PoolFormerLayer``) is the same with its ``layer_scale_1``,
``layer_scale_2`` on channels-first (B, C, H, W) branches.

*NFNet's block* (timm's ``NormFreeBlock`` with ``skipinit``: ``dm_nfnet_*``, Brock et al. 2021b sec. 4.1,
the SkipInit of De & Smith 2020): the block owns a scalar gain g, started at 0, that scales its residual
branch ``b`` in place before ``f(g) = b * g * alpha + shortcut``. At g = 0 neither the branch's output
gradient (``g alpha dy``) nor the scaled branch shows ``b``; but ``f`` is affine in g, so
``df/dg = b * alpha = f(g + 1) - f(g)``: the block's own forward with the gain raised by one
(``functional_call``, no grad, its parameters as they are), minus its output (kept, or recomputed at g where
it was changed in place since). ``dg_i = sum dy_i * (f(g + 1) - f(g))_i`` over channels and positions,
exact up to the rounding of that difference (relative ``eps * |f| / |b alpha|``); one extra forward of the
block, where the fallback recomputed it per example (dm_nfnet_f0 at 0.25x non-private, stop 44). Refused:
drop-path in training (the second forward would draw other masks).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.func import functional_call

from dpexp.privacy.per_example import Dense, PerExampleGrad
from dpexp.privacy.rules import as_sequence, qualified_name, register_rule

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


_BLOCK_SCALE = {  # a ConvNeXt block's one layer scale and the drop-path module after it
    "timm.models.convnext.ConvNeXtBlock": ("gamma", "drop_path"),
    f"{_HF}.convnext.modeling_convnext.ConvNextLayer": ("layer_scale_parameter", "drop_path"),
    "torchvision.models.convnext.CNBlock": ("layer_scale", "block"),  # (C, 1, 1); its branch, tapped
}


def _check(module: nn.Module) -> None:
    scale, drop = _BLOCK_SCALE[qualified_name(type(module))]
    own = {name for name, p in module.named_parameters(recurse=False) if p.requires_grad}
    if own != {scale} or not isinstance(getattr(module, drop, None), nn.Module):
        raise ValueError(
            f"{type(module).__name__}: the privacy engine's layer-scale rule expects the block's own "
            f"trainable parameters to be just `{scale}` and a {drop} module beside it; got {sorted(own)}. "
            "Freeze these parameters or register a rule for the block."
        )


def _unscale(module: nn.Module, name: str, scaled: torch.Tensor) -> torch.Tensor:
    """``scaled`` (B, C) ``= sum dz * (scale * u)`` over positions, divided by the module's scale ``name``
    (C,): ``sum dz * u``; refuses a scale too small for ``u`` to be recovered from ``scale * u``."""
    scale = getattr(module, name).detach().reshape(-1)
    floor = torch.finfo(scaled.dtype).tiny ** 0.5
    if not bool((scale.abs() >= floor).all()):
        raise ValueError(
            f"{type(module).__name__}: a layer-scale {name} is below {floor:.1e} in magnitude, where its "
            "per-example gradient cannot be formed from the scaled branch; re-initialise it (e.g. "
            "ls_init_value / layer_scale_init_value 1e-6) or freeze it (requires_grad=False)."
        )
    return scaled / scale.to(scaled.dtype)


@register_rule("torchvision.models.convnext.CNBlock", check=_check, tap="block", tap_output=True)
@register_rule(*list(_BLOCK_SCALE)[:2], check=_check, tap="drop_path")
def layer_scale_grads(module: nn.Module, v: torch.Tensor, dz: torch.Tensor) -> dict[str, PerExampleGrad]:
    """``v``, ``dz``: (B, C, H, W) at the input of the block's drop-path module, or for torchvision's block
    ``u`` and ``dL/du = gamma dL/dv`` at its branch's output (its ``v`` is added to in place, ``result +=
    input``): ``sum dz u = gamma sum dL/dv u`` there too. Returns ``dgamma`` (B, C), or (B, C, 1, 1) for
    torchvision's (C, 1, 1) scale."""
    scale, _ = _BLOCK_SCALE[qualified_name(type(module))]
    grads = _unscale(module, scale, (dz * v).sum((2, 3)))
    return {scale: Dense(grads.reshape(grads.shape[0], *getattr(module, scale).shape))}


_BEIT = "transformers.models.beit.modeling_beit.BeitLayer"
_DATA2VEC = "transformers.models.data2vec.modeling_data2vec_vision.Data2VecVisionLayer"
_POOLFORMER = "transformers.models.poolformer.modeling_poolformer.PoolFormerLayer"
_TIMM_BEIT = "timm.models.beit.Block"
_SCALES = {  # the layer's two scales in the order of its drop-path calls, the axes of the positions, and
    # its drop-path modules: one called twice, or one for each branch
    _BEIT: (("lambda_1", "lambda_2"), "channels_last", ("drop_path",)),  # (B, T, C)
    _DATA2VEC: (("lambda_1", "lambda_2"), "channels_last", ("drop_path",)),
    _POOLFORMER: (("layer_scale_1", "layer_scale_2"), "channels_first", ("drop_path",)),  # (B, C, H, W)
    _TIMM_BEIT: (("gamma_1", "gamma_2"), "channels_last", ("drop_path1", "drop_path2")),
}


def _scales_of(module: nn.Module) -> tuple[tuple[str, str], str, tuple[str, ...]]:
    return _SCALES[qualified_name(type(module))]


def _check_two_scales(module: nn.Module) -> None:
    names, _, taps = _scales_of(module)
    own = {name for name, p in module.named_parameters(recurse=False) if p.requires_grad}
    if not own <= set(names) or not all(isinstance(getattr(module, tap, None), nn.Module) for tap in taps):
        raise ValueError(
            f"{type(module).__name__}: the privacy engine's layer-scale rule expects the layer's own "
            f"trainable parameters to be {', '.join(names)} and a {' or '.join(taps)} module after each; got "
            f"{sorted(own)}. Freeze these parameters or register a rule for the layer."
        )


@register_rule(_TIMM_BEIT, check=_check_two_scales, tap=_SCALES[_TIMM_BEIT][2])
@register_rule(_BEIT, _DATA2VEC, _POOLFORMER, check=_check_two_scales, tap="drop_path", numbered_tap=True)
def two_scales_grads(
    module: nn.Module, call: tuple[torch.Tensor, int], dz: torch.Tensor
) -> dict[str, PerExampleGrad]:
    """``call = (v, k)``: ``v``, ``dz`` (B, T, C), or (B, C, H, W) for PoolFormer's, at the input of
    ``module.drop_path`` in its call ``k`` of the layer's call (timm's BEiT block: of its k-th drop-path
    module); returns the gradient of the k-th scale (B, C) and zero for the other (the engine keeps the
    trainable ones: a parameter's ``requires_grad`` is off while the engine holds it)."""
    v, k = call
    names, layout, _ = _scales_of(module)
    if k >= len(names):
        raise RuntimeError(
            f"{type(module).__name__}: its drop_path was called {k + 1} times in one call of the layer; the "
            f"layer-scale rule knows two ({', '.join(names)}). Register a rule for this layer."
        )
    name = names[k]
    product = dz * v
    summed = as_sequence(product).sum(1) if layout == "channels_last" else product.flatten(2).sum(2)
    grad = _unscale(module, name, summed)
    others = [other for other in names if other != name and isinstance(getattr(module, other), nn.Parameter)]
    return {name: Dense(grad), **{other: Dense(torch.zeros_like(grad)) for other in others}}


def _check_skipinit(module: nn.Module) -> None:
    own = {name for name, p in module.named_parameters(recurse=False) if p.requires_grad}
    if own != {"skipinit_gain"}:
        raise ValueError(
            f"{type(module).__name__}: the privacy engine's skipinit rule expects the block's own trainable "
            f"parameter to be just `skipinit_gain`; got {sorted(own)}. Freeze them or register a rule."
        )


def _keep_output(module: nn.Module, x: torch.Tensor, output: torch.Tensor) -> bool:
    return True  # f(g), which the rule would otherwise recompute


@register_rule("timm.models.nfnet.NormFreeBlock", check=_check_skipinit, keep_output=_keep_output)
def skipinit_gain_grads(
    module: nn.Module, x: torch.Tensor, dy: torch.Tensor, output: torch.Tensor | None = None
) -> dict[str, PerExampleGrad]:
    """``x``, ``dy``: the block's input and output gradient (B, C, H, W); returns ``dg`` (B,) for the 0-dim
    ``skipinit_gain`` (see the module docstring)."""
    drop_path = getattr(module, "drop_path", None)
    if module.training and getattr(drop_path, "drop_prob", 0.0) > 0:
        raise ValueError(
            f"{type(module).__name__}: drop-path in training draws its masks anew in every forward, and the "
            "privacy engine's skipinit rule reruns the block; set drop_path_rate=0 or freeze skipinit_gain."
        )
    gain = module.skipinit_gain.detach()
    with torch.no_grad():
        raised = functional_call(module, {"skipinit_gain": gain + 1}, (x,))
        if output is None:
            output = functional_call(module, {"skipinit_gain": gain}, (x,))
    return {"skipinit_gain": Dense((dy * (raised - output)).flatten(1).sum(1))}
