"""Vision Transformers' own parameters: class, distillation and register tokens and absolute position
embedding (timm's ``VisionTransformer``, DeiT's ``VisionTransformerDistilled`` and ``Beit``, Hugging Face's
``ViTEmbeddings`` and CLIP's ``CLIPVisionEmbeddings``).

timm's ``VisionTransformer`` (and ``Beit``) builds its token sequence as ``x = cat(cls, reg, patches) + pos``
(or ``cat(cls, reg, patches + pos)`` with ``no_embed_class``; DeiT: ``cat(cls, dist, patches)``) and passes it
to ``pos_drop``. With ``dz_i = dL_i/dx_i`` of shape (T, d) at that point (the rule's tap), every one of these
parameters is added to some positions, so its per-example gradient is a slice of ``dz_i``:

    d cls_i = dz_i[0],   d reg_i (or d dist_i) = dz_i[1 : 1 + R],   d pos_i = dz_i[P_0 : P_0 + T_pos]

with ``P_0 = 0``, or the number of prefix tokens under ``no_embed_class``. These are small (T x d per
example), so they are held explicitly. Without the rule, the exact torch.func fallback would recompute the
whole network per example.
"""

from __future__ import annotations

import torch
from torch import nn

from dpexp.privacy.per_example import Dense, PerExampleGrad
from dpexp.privacy.rules import register_rule

_PREFIX = ("cls_token", "dist_token", "reg_token")  # in their order in the sequence
_TOKENS = (*_PREFIX, "pos_embed")


def _check(module: nn.Module) -> None:
    own = {name for name, p in module.named_parameters(recurse=False) if p.requires_grad}
    unknown = own - set(_TOKENS)
    reason = None
    if unknown:
        reason = f"it owns parameters {sorted(unknown)} that the rule does not know"
    elif getattr(module, "dynamic_img_size", False):
        reason = "dynamic_img_size=True resamples pos_embed per input size"
    elif getattr(module, "pos_embed", None) is None:
        reason = "without pos_embed the token sequence does not pass through pos_drop"
    elif not isinstance(getattr(module, "pos_drop", None), nn.Module):
        reason = "it has no pos_drop module"
    if reason is not None:
        raise ValueError(
            f"{type(module).__name__}: the privacy engine's class/position-token rule cannot handle this "
            f"model: {reason}. Freeze these parameters (requires_grad=False) or register a rule for it."
        )


@register_rule(
    "timm.models.vision_transformer.VisionTransformer",
    "timm.models.deit.VisionTransformerDistilled",
    "timm.models.beit.Beit",
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


@register_rule("transformers.models.vit.modeling_vit.ViTEmbeddings", check=_check_hf, tap="dropout")
def hf_vit_token_grads(module: nn.Module, x: torch.Tensor, dz: torch.Tensor) -> dict[str, PerExampleGrad]:
    """Hugging Face ViT: ``dropout(cat(cls, patches) + position_embeddings)``, so with ``dz`` (B, T, d) at the
    dropout's input, ``d cls_i = dz_i[0]`` and ``d pos_i = dz_i``. (Interpolated position encodings route the
    gradient through a resampling this rule does not model; the engine's verification refuses them.)"""
    batch = dz.shape[0]
    return {
        "cls_token": Dense(dz[:, :1].reshape(batch, *module.cls_token.shape)),
        "position_embeddings": Dense(dz.reshape(batch, *module.position_embeddings.shape)),
    }


def _check_clip(module: nn.Module) -> None:
    own = {name for name, p in module.named_parameters(recurse=False) if p.requires_grad}
    if own - {"class_embedding"}:
        raise ValueError(
            f"{type(module).__name__}: the privacy engine's class-embedding rule expects the module's own "
            f"trainable parameters to be just class_embedding; got {sorted(own)}. Freeze them or register a "
            "rule for it."
        )


@register_rule("transformers.models.clip.modeling_clip.CLIPVisionEmbeddings", check=_check_clip)
def clip_class_embedding_grads(
    module: nn.Module, x: torch.Tensor, dy: torch.Tensor
) -> dict[str, PerExampleGrad]:
    """Hugging Face CLIP's vision embeddings return ``cat(class, patches) + position_embedding(ids)``, so with
    ``dy`` (B, T, d) their output gradient, ``d class_i = dy_i[0]``; the patch convolution and the position
    Embedding are submodules with their own rules. (``interpolate_pos_encoding=True`` reads the position
    table outside its module; the engine's verification refuses it.) Without the rule the exact fallback
    recomputed the module per example: 1.8x the non-private step (results/bench/fallbacks.json)."""
    return {"class_embedding": Dense(dy[:, 0])}
