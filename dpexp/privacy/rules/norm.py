"""``nn.LayerNorm``, ``nn.GroupNorm``, ``nn.InstanceNorm1d/2d/3d``, timm's ``LayerNorm`` and ``LayerNorm2d``
(ConvNeXt), Hugging Face ConvNeXt's LayerNorm of either data format, BiT's GroupNorm with its activation,
ConvNeXt V2's global response normalisation, MobileBERT's ``NoNorm`` (no normalisation), Cohere's bias-free
float32 LayerNorm, DeBERTa's, and xLSTM's RMSNorm and multi-head LayerNorm: ``y = x_hat * w + b`` with
``x_hat`` the normalised input.

The per-example gradients ``dw_i = sum (dy_i * x_hat_i)`` and ``db_i = sum dy_i`` (summed over all axes
that the affine parameters are broadcast along) are small, so they are held explicitly. ``x_hat`` is
recomputed from the captured input, which keeps the forward pass untouched.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dpexp.privacy.per_example import Dense, PerExampleGrad
from dpexp.privacy.rules import refuse, register_rule
from dpexp.privacy.rules.activation import activation_refusal


def _affine_grads(module: nn.Module, x_hat: torch.Tensor, dy: torch.Tensor, reduce: tuple[int, ...]):
    def total(t: torch.Tensor) -> torch.Tensor:
        return t.sum(reduce) if reduce else t  # sum(()) would reduce every axis

    grads: dict[str, PerExampleGrad] = {}
    if module.weight is not None:
        grads["weight"] = Dense(total(dy * x_hat))
    if module.bias is not None:
        grads["bias"] = Dense(total(dy))
    return grads


# timm's LayerNorm subclass computes the same F.layer_norm (optionally with a fused kernel); ESM C's casts
# the result back to its input's dtype (under autocast, that of its output gradient).
@register_rule(
    nn.LayerNorm,
    "timm.layers.norm.LayerNorm",
    "transformers.models.esmc.modeling_esmc.EsmcLayerNorm",
    position_wise=True,
)
def layer_norm_grads(module: nn.LayerNorm, x: torch.Tensor, dy: torch.Tensor) -> dict[str, PerExampleGrad]:
    x_hat = F.layer_norm(x, module.normalized_shape, eps=module.eps)
    reduce = tuple(range(1, x.dim() - len(module.normalized_shape)))
    return _affine_grads(module, x_hat, dy, reduce)


_HF = "transformers.models"


@register_rule(
    "timm.layers.norm.LayerNorm2d",
    "torchvision.models.convnext.LayerNorm2d",
    f"{_HF}.squeezebert.modeling_squeezebert.SqueezeBertLayerNorm",
)
def channels_first_layer_norm_grads(
    module: nn.LayerNorm, x: torch.Tensor, dy: torch.Tensor
) -> dict[str, PerExampleGrad]:
    """timm's and torchvision's ``LayerNorm2d`` (ConvNeXt, Liu et al. 2022: ``x`` (B, C, H, W)) and
    SqueezeBERT's LayerNorm
    (Iandola et al. 2020, its NCW layout: ``x`` (B, C, T)): normalised over C at every position
    (``F.layer_norm`` on the channels-last view), so ``dw_i = sum_positions dy_i * x_hat_i``."""
    x_hat = F.layer_norm(x.movedim(1, -1), module.normalized_shape, eps=module.eps).movedim(-1, 1)
    return _affine_grads(module, x_hat, dy, tuple(range(2, x.dim())))


@register_rule(
    f"{_HF}.convnext.modeling_convnext.ConvNextLayerNorm",
    f"{_HF}.convnextv2.modeling_convnextv2.ConvNextV2LayerNorm",
    copies=True,
)
def data_format_layer_norm_grads(
    module: nn.LayerNorm, x: torch.Tensor, dy: torch.Tensor
) -> dict[str, PerExampleGrad]:
    """Hugging Face ConvNeXt's LayerNorm (Liu et al. 2022, sec. 2.6; and its copies): ``nn.LayerNorm``'s
    forward over the channels, the last axis (``data_format="channels_last"``: ``x`` (B, H, W, C)) or the
    second (``"channels_first"``: (B, C, H, W), which it permutes to channels-last and back, as timm's
    ``LayerNorm2d``)."""
    if module.data_format == "channels_first":
        return channels_first_layer_norm_grads(module, x, dy)
    return layer_norm_grads(module, x, dy)


@register_rule(f"{_HF}.mobilebert.modeling_mobilebert.NoNorm", position_wise=True, copies=True)
def no_norm_grads(module: nn.Module, x: torch.Tensor, dy: torch.Tensor) -> dict[str, PerExampleGrad]:
    """MobileBERT's ``NoNorm`` (Sun et al. 2020, sec. 4.1: LayerNorm replaced by an elementwise affine map),
    ``y = x * w + b``: the affine gradients with ``x_hat = x``."""
    return _affine_grads(module, x, dy, tuple(range(1, x.dim() - 1)))


@register_rule("transformers.models.cohere.modeling_cohere.CohereLayerNorm", position_wise=True, copies=True)
def float32_layer_norm_grads(
    module: nn.Module, x: torch.Tensor, dy: torch.Tensor
) -> dict[str, PerExampleGrad]:
    """Cohere's LayerNorm: centred and normalised over the last axis in float32, scaled by ``w`` (one row, or
    one per head for its query/key norms, ``w`` of shape (heads, d)), no bias, cast back after."""
    x_hat = F.layer_norm(x.float(), x.shape[-1:], eps=module.variance_epsilon)
    reduce = tuple(range(1, x.dim() - module.weight.dim()))
    return {"weight": Dense((dy.float() * x_hat).sum(reduce))}


@register_rule(
    "transformers.models.deberta.modeling_deberta.DebertaLayerNorm", position_wise=True, copies=True
)
def deberta_layer_norm_grads(
    module: nn.Module, x: torch.Tensor, dy: torch.Tensor
) -> dict[str, PerExampleGrad]:
    """DeBERTa's LayerNorm (He et al. 2021; and its copies): ``x_hat`` centred and normalised over the last
    axis in float32 by the module's own operations, cast back to the input's dtype; ``y = w * x_hat + b``."""
    h = x.float()
    centred = h - h.mean(-1, keepdim=True)
    variance = centred.pow(2).mean(-1, keepdim=True)
    x_hat = (centred / torch.sqrt(variance + module.variance_epsilon)).to(x.dtype)
    return _affine_grads(module, x_hat, dy, tuple(range(1, x.dim() - 1)))


@register_rule("transformers.models.nemotron.modeling_nemotron.NemotronLayerNorm1P", position_wise=True)
def layer_norm_1p_grads(module: nn.LayerNorm, x: torch.Tensor, dy: torch.Tensor) -> dict[str, PerExampleGrad]:
    """Nemotron's LayerNorm with scale ``1 + w``, run in autocast's dtype where autocast is on (its output's,
    and so ``dy``'s, dtype): ``dw_i = sum dy_i * x_hat_i`` as for LayerNorm."""
    x_hat = F.layer_norm(x.to(dy.dtype), module.normalized_shape, eps=module.eps)
    return _affine_grads(module, x_hat, dy, tuple(range(1, x.dim() - len(module.normalized_shape))))


_XLSTM = "transformers.models.xlstm.modeling_xlstm"


def _xlstm_float(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return x.float() if module.force_float32_reductions else x


@register_rule(f"{_XLSTM}.xLSTMRMSNorm", position_wise=True)
def xlstm_rms_norm_grads(module: nn.Module, x: torch.Tensor, dy: torch.Tensor) -> dict[str, PerExampleGrad]:
    """xLSTM's RMSNorm (Beck et al. 2024, "xLSTM"; its Hugging Face form): ``x_hat = x / sqrt(mean(x^2) +
    eps)`` over the last axis, in float32 where ``force_float32_reductions``, cast back to the input's
    dtype, then ``y = x_hat * w + b``, either optional."""
    h = _xlstm_float(module, x)
    x_hat = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + module.eps)).to(x.dtype)
    return _affine_grads(module, x_hat, dy, tuple(range(1, x.dim() - 1)))


@register_rule(f"{_XLSTM}.xLSTMMultiHeadLayerNorm")
def xlstm_multi_head_layer_norm_grads(
    module: nn.Module, x: torch.Tensor, dy: torch.Tensor
) -> dict[str, PerExampleGrad]:
    """xLSTM's multi-head LayerNorm: ``x`` (B, T, heads, head_dim) centred and normalised over each head's
    features (float32 where ``force_float32_reductions``), cast back, flattened to (B, T, heads * head_dim),
    then ``y = x_hat * w + b`` over the flattened features; ``dy`` (B, T, heads * head_dim)."""
    h = _xlstm_float(module, x)
    centred = h - h.mean(-1, keepdim=True)
    x_hat = centred * torch.rsqrt(h.var(-1, keepdim=True, unbiased=False) + module.eps)
    return _affine_grads(module, x_hat.to(x.dtype).flatten(2), dy, (1,))


@register_rule(nn.GroupNorm)
def group_norm_grads(module: nn.GroupNorm, x: torch.Tensor, dy: torch.Tensor) -> dict[str, PerExampleGrad]:
    """The batch as one example of B*C channels in B*G groups (each group one example's group, normalised
    alone as before): the native group-norm backward's affine gradients of that view are then the
    per-example ones, (B*C,) each, without forming ``x_hat`` or ``dy * x_hat``."""
    b, c, positions, groups = x.shape[0], x.shape[1], x[0, 0].numel(), x.shape[0] * module.num_groups
    dtype = torch.promote_types(torch.promote_types(x.dtype, dy.dtype), torch.float32)
    x, dy = x.to(dtype).reshape(1, b * c, positions), dy.to(dtype).reshape(1, b * c, positions)
    _, mean, rstd = torch.ops.aten.native_group_norm(x, None, None, 1, b * c, positions, groups, module.eps)
    ones = x.new_ones(b * c)  # the weight does not enter dw and db; torch 2.11's backward needs a tensor
    _, dw, db = torch.ops.aten.native_group_norm_backward(
        dy, x, mean, rstd, ones, 1, b * c, positions, groups, [False, True, True]
    )
    grads: dict[str, PerExampleGrad] = {}
    if module.weight is not None:
        grads["weight"] = Dense(dw.view(b, c))
    if module.bias is not None:
        grads["bias"] = Dense(db.view(b, c))
    return grads


def _check_activation(module: nn.Module) -> None:
    reason, fix = activation_refusal(module.activation, "its", "freeze the norm") or (None, "")
    refuse(module, "GroupNorm-and-activation", "norm", reason, fix)


@register_rule(f"{_HF}.bit.modeling_bit.BitGroupNormActivation", check=_check_activation, copies=True)
def group_norm_activation_grads(
    module: nn.GroupNorm, x: torch.Tensor, dy: torch.Tensor
) -> dict[str, PerExampleGrad]:
    """BiT's GroupNorm followed by its activation (Kolesnikov et al. 2020, sec. 3.1; Hugging Face's
    ``BitGroupNormActivation``): ``y = act(GN(x))``, so GroupNorm's per-example gradients for the gradient at
    the norm's output, ``dy * act'(GN(x))``, the activation's derivative taken by autograd (it acts on each
    value alone: checked)."""
    with torch.enable_grad():
        z = F.group_norm(x.detach(), module.num_groups, module.weight, module.bias, module.eps)
        z = z.detach().requires_grad_()
        (dz,) = torch.autograd.grad(module.activation(z), z, dy)
    return group_norm_grads(module, x, dz)


@register_rule(f"{_HF}.convnextv2.modeling_convnextv2.ConvNextV2GRN", copies=True)
def global_response_norm_grads(
    module: nn.Module, x: torch.Tensor, dy: torch.Tensor
) -> dict[str, PerExampleGrad]:
    """ConvNeXt V2's global response normalisation (Woo et al. 2023, sec. 3.2, eqs. 1-3): for ``x``
    (B, H, W, C), ``G = ||x||_2`` over H and W per example and channel, ``N = G / (mean_c G + 1e-6)``,
    ``y = w * (x * N) + b + x``; every statistic is the example's own, so ``dw_i = sum_hw dy_i * x_i * N_i``
    and ``db_i = sum_hw dy_i``, each (1, 1, 1, C) per example."""
    g = torch.linalg.vector_norm(x, ord=2, dim=(1, 2), keepdim=True)
    response = x * (g / (g.mean(dim=-1, keepdim=True) + 1e-6))
    shape = (-1, *module.weight.shape)  # (B, 1, 1, 1, C)
    return {
        "weight": Dense((dy * response).sum((1, 2)).view(shape)),
        "bias": Dense(dy.sum((1, 2)).view(shape)),
    }


@register_rule(nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d)
def instance_norm_grads(
    module: nn.modules.instancenorm._InstanceNorm, x: torch.Tensor, dy: torch.Tensor
) -> dict[str, PerExampleGrad]:
    """Each example's channels are normalised over their own positions (running statistics, if tracked, are
    used only in evaluation; a training forward that updates them is refused by the engine)."""
    use_input_stats = module.training or not module.track_running_stats
    x_hat = F.instance_norm(
        x,
        None if use_input_stats else module.running_mean,
        None if use_input_stats else module.running_var,
        use_input_stats=use_input_stats,
        eps=module.eps,
    )
    return _affine_grads(module, x_hat, dy, tuple(range(2, x.dim())))
