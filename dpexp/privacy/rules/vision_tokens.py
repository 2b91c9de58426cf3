"""Vision Transformers' own parameters: class, distillation, register and mask tokens and absolute position
embedding (timm's ``VisionTransformer``, DeiT's ``VisionTransformerDistilled`` and ``Beit``, Hugging Face's
``ViTEmbeddings``, CLIP's ``CLIPVisionEmbeddings``, DINOv2's ``Dinov2Embeddings`` (and, with register
tokens, ``Dinov2WithRegistersEmbeddings``), BEiT's (and data2vec-vision's) ``BeitEmbeddings``, Hiera's
``HieraEmbeddings``, LayoutLMv3's image tokens (``LayoutLMv3Model``, Huang et al. 2022) and torchvision's
``VisionTransformer`` and its ``Encoder``; and SigLIP's attention-pooling probe, a learned query token.

timm's ``VisionTransformer`` (and ``Beit``, and LayoutLMv3's model for its image patches) builds its token
sequence as ``x = cat(cls, reg, patches) + pos`` (or ``cat(cls, reg, patches + pos)`` with
``no_embed_class``; DeiT: ``cat(cls, dist, patches)``; a ``Beit``
without absolute positions, as BEiT-large: ``cat(cls, patches)``) and passes it to ``pos_drop``. With
``dz_i = dL_i/dx_i`` of shape (T, d) at that point (the rule's tap), every one of these parameters is added
to some positions, so its per-example gradient is a slice of ``dz_i``:

    d cls_i = dz_i[0],   d reg_i (or d dist_i) = dz_i[1 : 1 + R],   d pos_i = dz_i[P_0 : P_0 + T_pos]

with ``P_0 = 0``, or the number of prefix tokens under ``no_embed_class``. These are small (T x d per
example), so they are held explicitly. Without the rule, the exact torch.func fallback would recompute the
whole network per example.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dpexp.privacy.per_example import Dense, PerExampleGrad
from dpexp.privacy.rules import (
    CallLayout,
    first_output,
    forward_arguments,
    qualified_name,
    refuse,
    register_rule,
    unknown_parameters,
)

_PREFIX = ("cls_token", "dist_token", "reg_token")  # in their order in the sequence
_TOKENS = (*_PREFIX, "pos_embed")
# whose token sequence reaches pos_drop without an absolute position embedding too (BEiT's relative position
# bias instead, as in beit_large_patch16_224; timm's VisionTransformer then returns before pos_drop)
_DROPS_WITHOUT_POS_EMBED = ("timm.models.beit.Beit",)


def _check(module: nn.Module) -> None:
    own = {name for name, p in module.named_parameters(recurse=False) if p.requires_grad}
    unknown = own - set(_TOKENS)
    reason = None
    if unknown:
        reason = f"it owns parameters {sorted(unknown)} that the rule does not know"
    elif getattr(module, "dynamic_img_size", False):
        reason = "dynamic_img_size=True resamples pos_embed per input size"
    elif getattr(module, "pos_embed", None) is None and (
        qualified_name(type(module)) not in _DROPS_WITHOUT_POS_EMBED
    ):
        reason = "without pos_embed the token sequence does not pass through pos_drop"
    elif not isinstance(getattr(module, "pos_drop", None), nn.Module):
        reason = "it has no pos_drop module"
    refuse(
        module,
        "class/position-token",
        "model",
        reason,
        "Freeze these parameters (requires_grad=False) or register a rule for it.",
    )


@register_rule(
    "timm.models.vision_transformer.VisionTransformer",
    "timm.models.deit.VisionTransformerDistilled",
    "timm.models.beit.Beit",
    "transformers.models.layoutlmv3.modeling_layoutlmv3.LayoutLMv3Model",  # its image tokens, timm's form
    check=_check,
    tap="pos_drop",
)
def token_grads(module: nn.Module, x: torch.Tensor, dz: torch.Tensor) -> dict[str, PerExampleGrad]:
    """``dz``: (B, T, d), the gradient with respect to the input of ``module.pos_drop``."""
    batch = dz.shape[0]
    grads: dict[str, PerExampleGrad] = {}
    offset = 0
    for attr in _PREFIX:
        token = getattr(module, attr, None)
        if token is not None:
            n = token.shape[1]
            grads[attr] = Dense(dz[:, offset : offset + n].reshape(batch, *token.shape))
            offset += n
    pos = module.pos_embed
    if pos is not None:
        start = offset if getattr(module, "no_embed_class", False) else 0
        grads["pos_embed"] = Dense(dz[:, start : start + pos.shape[1]].reshape(batch, *pos.shape))
    return grads


def _check_hf(module: nn.Module) -> None:
    mask_token = getattr(module, "mask_token", None)
    if mask_token is not None and mask_token.requires_grad:
        raise ValueError(
            f"{type(module).__name__}: the privacy engine's class/position-token rule does not cover the "
            "mask token of masked image modelling (its use depends on bool_masked_pos). Freeze it "
            "(mask_token.requires_grad_(False)) or register a rule for it."
        )


@register_rule(
    "transformers.models.vit.modeling_vit.ViTEmbeddings",  # and its copies (ViT-MSN's)
    "transformers.models.ijepa.modeling_ijepa.IJepaEmbeddings",  # no class token
    "transformers.models.pvt.modeling_pvt.PvtPatchEmbeddings",  # per stage; a class token in the last
    check=_check_hf,
    tap="dropout",
    copies=True,
)
def hf_vit_token_grads(module: nn.Module, x: torch.Tensor, dz: torch.Tensor) -> dict[str, PerExampleGrad]:
    """Hugging Face ViT: ``dropout(cat(cls, patches) + position_embeddings)`` (I-JEPA's without ``cls``), so
    with ``dz`` (B, T, d) at the dropout's input, ``d cls_i = dz_i[0]`` and ``d pos_i = dz_i``. (Interpolated
    position encodings route the gradient through a resampling this rule does not model; the engine's
    verification refuses them.) PVT's patch embeddings (Wang et al. 2021, "Pyramid Vision Transformer",
    sec. 3.2: one per stage, the last with a class token) build the same sequence from their convolution's
    normalised patches, and resample their table with ``interpolate_pos_encoding`` to the patch grid, which
    the table's reshape fixes at its own size: a bilinear resampling to the same size, the identity. They
    return ``(tokens, height, width)``; the tap makes the tuple irrelevant. Without the rule PVT's
    embeddings took the fallback at 2.5x the non-private step (``fallbacks`` suite, entry ``pvt``)."""
    batch = dz.shape[0]
    grads = {"position_embeddings": Dense(dz.reshape(batch, *module.position_embeddings.shape))}
    if getattr(module, "cls_token", None) is not None:
        grads["cls_token"] = Dense(dz[:, :1].reshape(batch, *module.cls_token.shape))
    return grads


_TORCHVISION_VIT = "torchvision.models.vision_transformer"


def _check_own(parameter: str, submodule: str) -> Callable[[nn.Module], None]:
    """A check that ``parameter`` is the module's one trainable parameter and ``submodule`` (the tap) is
    a module."""

    def check(module: nn.Module) -> None:
        own = {name for name, p in module.named_parameters(recurse=False) if p.requires_grad}
        if own - {parameter} or not isinstance(getattr(module, submodule, None), nn.Module):
            raise ValueError(
                f"{type(module).__name__}: the privacy engine's {parameter} rule expects the module's own "
                f"trainable parameters to be just {parameter}, added before its {submodule} module; got "
                f"{sorted(own)}. Freeze them or register a rule for it."
            )

    return check


@register_rule(
    f"{_TORCHVISION_VIT}.VisionTransformer", check=_check_own("class_token", "encoder"), tap="encoder"
)
def torchvision_class_token_grads(
    module: nn.Module, x: torch.Tensor, dz: torch.Tensor
) -> dict[str, PerExampleGrad]:
    """torchvision's ``VisionTransformer`` (Dosovitskiy et al. 2021, eq. 1) passes ``cat(class_token,
    patches)`` to its ``encoder``: with ``dz`` (B, T, d) the gradient at the encoder's input,
    ``d class_token_i = dz_i[0]``. Without the rule the exact fallback recomputed the whole model per
    example (the class token is the root module's own parameter)."""
    return {"class_token": Dense(dz[:, :1].reshape(dz.shape[0], *module.class_token.shape))}


@register_rule(f"{_TORCHVISION_VIT}.Encoder", check=_check_own("pos_embedding", "dropout"), tap="dropout")
def torchvision_position_grads(
    module: nn.Module, x: torch.Tensor, dz: torch.Tensor
) -> dict[str, PerExampleGrad]:
    """torchvision's ViT ``Encoder`` adds ``pos_embedding`` (1, T, d) to its input and passes the sum to its
    ``dropout``: with ``dz`` (B, T, d) the gradient there, ``d pos_embedding_i = dz_i``."""
    return {"pos_embedding": Dense(dz.reshape(dz.shape[0], *module.pos_embedding.shape))}


def _check_clip(module: nn.Module) -> None:
    own = {name for name, p in module.named_parameters(recurse=False) if p.requires_grad}
    if own - {"class_embedding"}:
        raise ValueError(
            f"{type(module).__name__}: the privacy engine's class-embedding rule expects the module's own "
            f"trainable parameters to be just class_embedding; got {sorted(own)}. Freeze them or register a "
            "rule for it."
        )


@register_rule("transformers.models.clip.modeling_clip.CLIPVisionEmbeddings", check=_check_clip, copies=True)
def clip_class_embedding_grads(
    module: nn.Module, x: torch.Tensor, dy: torch.Tensor
) -> dict[str, PerExampleGrad]:
    """Hugging Face CLIP's vision embeddings return ``cat(class, patches) + position_embedding(ids)``, so with
    ``dy`` (B, T, d) their output gradient, ``d class_i = dy_i[0]``; the patch convolution and the position
    Embedding are submodules with their own rules. (``interpolate_pos_encoding=True`` reads the position
    table outside its module; the engine's verification refuses it.) Without the rule the exact fallback
    recomputed the module per example: 1.8x the non-private step (results/bench/fallbacks.json)."""
    return {"class_embedding": Dense(dy[:, 0])}


_DINOV2 = "transformers.models.dinov2.modeling_dinov2.Dinov2Embeddings"
_DINOV2_TOKENS = {"cls_token", "mask_token", "position_embeddings"}


def _check_dinov2(module: nn.Module) -> None:
    own = {name for name, p in module.named_parameters(recurse=False) if p.requires_grad}
    if own - _DINOV2_TOKENS:
        raise ValueError(
            f"{type(module).__name__}: the privacy engine's class/mask/position-token rule does not know its "
            f"parameters {sorted(own - _DINOV2_TOKENS)}. Freeze them or register a rule for it."
        )


def _patches(module: nn.Module, height: int, width: int) -> int:
    patch_h, patch_w = module.patch_embeddings.patch_size
    return (height // patch_h) * (width // patch_w)


def _resamples(module: nn.Module, height: int, width: int) -> bool:
    """Whether the module's ``interpolate_pos_encoding`` resamples its table for an image of this size."""
    positions = module.position_embeddings.shape[1] - 1
    return _patches(module, height, width) != positions or height != width


def _resampled_position_grads(
    module: nn.Module,
    dy: torch.Tensor,
    height: int,
    width: int,
    in_float32: bool = True,
    antialias: bool = False,
) -> torch.Tensor:
    """``J^T dy_i`` (B, 1 + P, d) for every example, J the Jacobian of the module's resampling of its position
    table (1, 1 + P, d) to the (height, width) image (``interpolate_pos_encoding``: the class position as it
    is, the s x s patch positions bicubically to the patch grid, in float32 as DINOv2 computes them, or in
    the table's own dtype as BEiT does: ``in_float32=False``; antialiased as DINOv2 with registers does),
    taken with the table expanded to one copy per example, as the module resamples it once for all."""
    table = module.position_embeddings.detach()
    batch, dim = dy.shape[0], dy.shape[-1]
    side = math.isqrt(table.shape[1] - 1)
    patch_h, patch_w = module.patch_embeddings.patch_size
    with torch.enable_grad():
        rows = table.expand(batch, -1, -1).clone().requires_grad_()
        grid = rows[:, 1:].reshape(batch, side, side, dim).permute(0, 3, 1, 2)
        grid = F.interpolate(
            grid.to(torch.float32) if in_float32 else grid,
            size=(height // patch_h, width // patch_w),
            mode="bicubic",
            align_corners=False,
            antialias=antialias,
        ).to(table.dtype)
        out = torch.cat((rows[:, :1], grid.permute(0, 2, 3, 1).reshape(batch, -1, dim)), 1)
        (grad,) = torch.autograd.grad(out, rows, dy)
    return grad


def _token_call(module: nn.Module, args: tuple, kwargs: dict[str, Any], resample_in_float32: bool) -> tuple:
    """``(pixel_values (B, C, H, W), bool_masked_pos (B, N) or None)`` of a call of DINOv2's or BEiT's
    embeddings; refuses a call whose output gradient is not the gradient at the tokens (embedding dropout in
    training), a traced call, a float32 resampling of a float64 table (DINOv2: the engine's check of the
    per-example sums would fail by its rounding), and a mask that is not one row per image."""
    call = forward_arguments(module, args, kwargs, defaults=True)
    pixels, mask = call["pixel_values"], call["bool_masked_pos"]
    if module.training and module.dropout.p > 0:
        raise ValueError(
            f"applies embedding dropout (p={module.dropout.p}) to its output in training, so its output "
            "gradient is not the tokens' gradient the rule needs; set hidden_dropout_prob=0 (or "
            "embeddings.dropout.p = 0), or freeze cls_token, mask_token and position_embeddings"
        )
    if torch.jit.is_tracing():
        raise ValueError("is traced, where it always resamples its positions; train it untraced")
    table = module.position_embeddings
    if (
        resample_in_float32
        and table is not None
        and table.dtype == torch.float64
        and _resamples(module, *pixels.shape[-2:])
    ):
        raise ValueError(
            f"resamples position_embeddings for {tuple(pixels.shape[-2:])} images in float32 (bicubic), so "
            "in a float64 model the per-example gradients cannot be verified to add up to autograd's to "
            "float64 precision; train in float32 (or bfloat16), or feed square images of config.image_size"
        )
    patches = _patches(module, *pixels.shape[-2:])
    if mask is not None and tuple(mask.shape) != (pixels.shape[0], patches):
        raise ValueError(
            f"bool_masked_pos has shape {tuple(mask.shape)}; the mask-token rule needs one row per image, "
            f"({pixels.shape[0]}, {patches})"
        )
    return pixels, mask


def dinov2_inputs(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple:
    """DINOv2 resamples its positions in float32 (:func:`_token_call`)."""
    return _token_call(module, args, kwargs, resample_in_float32=True)


def _token_grads(
    module: nn.Module,
    call: tuple[torch.Tensor, torch.Tensor | None],
    dy: torch.Tensor,
    in_float32: bool,
    antialias: bool = False,
) -> dict[str, PerExampleGrad]:
    """``d cls_i = dy_i[0]``, ``d pos_i = dy_i`` (or ``J^T dy_i`` through a resampling), ``d mask_token_i =
    sum_t m_{i,t} dy_i[1 + t]`` for ``dropout(cat(cls, p * (1 - m) + mask_token * m) + pos)``."""
    pixels, mask = call
    batch = dy.shape[0]
    height, width = pixels.shape[-2:]
    grads: dict[str, PerExampleGrad] = {"cls_token": Dense(dy[:, :1].reshape(batch, *module.cls_token.shape))}
    table = module.position_embeddings
    if table is not None:
        resampled = _resamples(module, height, width)
        pos = _resampled_position_grads(module, dy, height, width, in_float32, antialias) if resampled else dy
        grads["position_embeddings"] = Dense(pos.reshape(batch, *table.shape))
    if module.mask_token is not None:
        token = torch.zeros((batch, dy.shape[-1]), dtype=dy.dtype, device=dy.device)
        if mask is not None:
            token = torch.einsum("bt,btd->bd", mask.to(dy.dtype), dy[:, 1:])
        grads["mask_token"] = Dense(token.reshape(batch, *module.mask_token.shape))
    return grads


@register_rule(_DINOV2, check=_check_dinov2, call=CallLayout(dinov2_inputs, first_output))
def dinov2_token_grads(
    module: nn.Module, call: tuple[torch.Tensor, torch.Tensor | None], dy: torch.Tensor
) -> dict[str, PerExampleGrad]:
    """Hugging Face DINOv2 (Oquab et al. 2023, sec. 4; the ViT tokens of Dosovitskiy et al. 2021, eq. 1):
    ``dropout(cat(cls, p * (1 - m) + mask_token * m) + position_embeddings)`` with ``p`` (B, N, d) the patch
    embeddings (a submodule with its own rule) and ``m`` (B, N) the optional ``bool_masked_pos``. With ``dy``
    (B, 1 + N, d) the output gradient (no dropout: :func:`dinov2_inputs`), ``d cls_i = dy_i[0]``,
    ``d pos_i = dy_i`` (``J^T dy_i`` where the module resamples the table for another image size:
    :func:`_resampled_position_grads`, exact to the float32 rounding of that resampling) and
    ``d mask_token_i = sum_t m_{i,t} dy_i[1 + t]``: zero for an example without masked patches, and for
    every example when no mask is passed (the token is then unused). Without the rule, the
    fallback recomputed the module per example (1.7x the non-private step, results/bench/fallbacks.json)."""
    return _token_grads(module, call, dy, in_float32=True)


def _check_registers(module: nn.Module) -> None:
    reason = unknown_parameters(module, _DINOV2_TOKENS | {"register_tokens"})
    refuse(module, "class/register/mask/position-token", "module", reason, "Freeze them, or register a rule.")


@register_rule(
    "transformers.models.dinov2_with_registers.modeling_dinov2_with_registers.Dinov2WithRegistersEmbeddings",
    check=_check_registers,
    call=CallLayout(dinov2_inputs, first_output),
)
def dinov2_register_token_grads(
    module: nn.Module, call: tuple[torch.Tensor, torch.Tensor | None], dy: torch.Tensor
) -> dict[str, PerExampleGrad]:
    """Hugging Face DINOv2 with registers (Darcet et al. 2024, "Vision Transformers Need Registers", sec. 3):
    DINOv2's sequence ``e = cat(cls, p * (1 - m) + mask_token * m) + position_embeddings``, then the R
    register tokens inserted after the class token, ``dropout(cat(e[:1], registers, e[1:]))``; its position
    table resampled antialiased. With ``dy`` (B, 1 + R + N, d), ``d registers_i = dy_i[1 : 1 + R]`` and the
    other tokens' gradients are DINOv2's (:func:`dinov2_token_grads`) for ``cat(dy_i[:1], dy_i[1 + R:])``."""
    registers = module.register_tokens.shape[1]
    tokens = torch.cat((dy[:, :1], dy[:, 1 + registers :]), 1)
    grads = _token_grads(module, call, tokens, in_float32=True, antialias=True)
    grads["register_tokens"] = Dense(dy[:, 1 : 1 + registers].reshape(-1, *module.register_tokens.shape))
    return grads


_BEIT = (
    "transformers.models.beit.modeling_beit.BeitEmbeddings",
    "transformers.models.data2vec.modeling_data2vec_vision.Data2VecVisionEmbeddings",
)


def beit_inputs(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple:
    """BEiT resamples its positions in the table's dtype, so a float64 model is verified to float64
    precision (:func:`_token_call`)."""
    return _token_call(module, args, kwargs, resample_in_float32=False)


@register_rule(*_BEIT, check=_check_dinov2, call=CallLayout(beit_inputs, first_output))
def beit_token_grads(
    module: nn.Module, call: tuple[torch.Tensor, torch.Tensor | None], dy: torch.Tensor
) -> dict[str, PerExampleGrad]:
    """Hugging Face BEiT (Bao et al. 2022, sec. 2.1-2.2) and data2vec-vision: the same token sequence as
    DINOv2's, ``dropout(cat(cls, p * (1 - m) + mask_token * m) + position_embeddings)``, with the mask token
    of masked image modelling (``use_mask_token``, a (1, 1, d) parameter used where ``bool_masked_pos`` is
    set) and the absolute position table only with ``use_absolute_position_embeddings`` (without it BEiT
    uses relative position biases inside its attention, and the rule gives cls and mask token alone). For
    images of another size the module resamples the table bicubically in its own dtype, and the rule takes
    ``J^T dy_i`` through that resampling (:func:`_resampled_position_grads`), exact in float64 too. Without
    the rule, the fallback recomputed the module per example."""
    return _token_grads(module, call, dy, in_float32=False)


def _check_probe(module: nn.Module) -> None:
    reason = unknown_parameters(module, {"probe"})
    if reason is None and not isinstance(getattr(module, "attention", None), nn.MultiheadAttention):
        reason = "its attention is not an nn.MultiheadAttention, whose query input the rule reads"
    refuse(module, "attention-pooling probe", "module", reason, "Freeze them, or register a rule for it.")


@register_rule(
    "transformers.models.siglip.modeling_siglip.SiglipMultiheadAttentionPoolingHead",
    "transformers.models.siglip2.modeling_siglip2.Siglip2MultiheadAttentionPoolingHead",  # a padding mask
    check=_check_probe,
    tap="attention",
    copies=True,
)
def probe_grads(module: nn.Module, query: torch.Tensor, dq: torch.Tensor) -> dict[str, PerExampleGrad]:
    """SigLIP's attention pooling (Zhai et al. 2023, sec. 2; the multihead attention pooling of Lee et al.
    2019): the learned ``probe`` (1, 1, d), repeated to one query per image, attends over the image's tokens
    (``attention``, an ``nn.MultiheadAttention`` with its own rule). The rule taps the attention's query
    input, (B, 1, d), and ``d probe_i = dq_i``. Without it the fallback recomputed the head per example."""
    return {"probe": Dense(dq.reshape(-1, *module.probe.shape))}


# ---------------------------------------------------------------------------------------------- Hiera
_HIERA = "transformers.models.hiera.modeling_hiera.HieraEmbeddings"


def _check_hiera(module: nn.Module) -> None:
    reason = unknown_parameters(module, {"position_embeddings"})
    refuse(module, "position-embedding", "module", reason, "Freeze them, or register a rule.")


def hiera_inputs(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple:
    """``(pixel_values,)`` of a call of Hiera's embeddings; refuses a call that resamples the position table
    (``interpolate_pos_encoding`` for another size, or traced), whose gradient the rule does not take back
    through the bicubic resampling."""
    call = forward_arguments(module, args, kwargs, defaults=True)
    pixels = call["pixel_values"]
    height, width = pixels.shape[-2:]
    conv = module.patch_embeddings.projection  # its output grid is the token grid the table is added to
    geometry = zip((height, width), conv.kernel_size, conv.stride, conv.padding, conv.dilation, strict=True)
    patches = math.prod((size + 2 * p - d * (k - 1) - 1) // s + 1 for size, k, s, p, d in geometry)
    if call["interpolate_pos_encoding"] and (
        torch.jit.is_tracing() or patches != module.position_embeddings.shape[1] or height != width
    ):
        raise ValueError(
            f"resamples position_embeddings for {(height, width)} images (interpolate_pos_encoding=True), "
            "which the rule does not differentiate; feed images of config.image_size, or freeze "
            "position_embeddings"
        )
    return (pixels,)


@register_rule(_HIERA, check=_check_hiera, call=CallLayout(hiera_inputs, first_output))
def hiera_position_grads(
    module: nn.Module, call: tuple[torch.Tensor], dy: torch.Tensor
) -> dict[str, PerExampleGrad]:
    """Hugging Face Hiera (Ryali et al. 2023: a hierarchical ViT with an absolute position embedding
    added to the patch embeddings): ``patch_embeddings(x) + position_embeddings`` (1, N, d), the patch
    convolution a submodule with its own rule, returned with the MAE mask and restore ids (None or integers:
    no gradient). With ``dy`` (B, N, d) the first output's gradient, ``d pos_i = dy_i``. Without the rule
    the exact fallback recomputed the module, convolution included, per example."""
    table = module.position_embeddings
    return {"position_embeddings": Dense(dy.reshape(dy.shape[0], *table.shape))}
