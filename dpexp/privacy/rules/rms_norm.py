"""RMSNorm (Zhang & Sennrich 2019): ``y = w * x_hat`` with ``x_hat = x / sqrt(mean(x^2) + eps)`` over the
feature axis, no centring, no bias; the norm of Llama, Qwen, Mistral, Phi-3, Granite, Mamba, OLMo-2, Gemma
(which scales by ``1 + w``), Gemma 3n and 4, Llama 4, T5 and ``torch.nn.RMSNorm``.

The per-example gradient of the scale is ``dw_i = sum_t dy_{i,t} * x_hat_{i,t}`` (also for Gemma's
``1 + w``), summed over every axis between the batch and the features, as for LayerNorm. The families differ
only in where they change precision, which the rule reproduces (the verification of
:mod:`dpexp.privacy.capture` checks it against autograd): Llama casts ``x_hat`` back to the input dtype
before scaling, OLMo-2 and Gemma scale in float32 and cast after (Gemma 3n and 4 normalise by
``pow(., -0.5)`` instead of ``rsqrt``: the same value up to float32 rounding), T5 keeps the input dtype
unless the weight is in half precision. Without the rule these layers run on the ``torch.func`` fallback,
which made a small Llama's private step cost 2.1x a non-private one on CPU. The classes named below are the
originals; their copies in other models' files (GLM, Helium, Qwen2-MoE, DeepSeek, ...: the same class body,
:mod:`dpexp.privacy.rules.copies`) take the same rule.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dpexp.privacy.per_example import Dense, PerExampleGrad
from dpexp.privacy.rules import as_sequence, register_rule

_HF = "transformers.models"
# forward: `self.weight * (x.float() * rsqrt(mean(x^2) + eps)).to(x.dtype)` (identical source in each)
LLAMA_FORM = [
    f"{_HF}.{family}.modeling_{family}.{name}RMSNorm"
    for family, name in [
        ("llama", "Llama"),
        ("qwen2", "Qwen2"),
        ("qwen3", "Qwen3"),
        ("qwen3_moe", "Qwen3Moe"),
        ("mistral", "Mistral"),
        ("mixtral", "Mixtral"),
        ("phi3", "Phi3"),
        ("granite", "Granite"),
        ("mamba", "Mamba"),
    ]
]
# forward: `(scale * x_hat_float32).to(x.dtype)` with scale = 1 + w (Gemma, identical source in each), or w
# (OLMo-2; Helium casts w to float32 first: the same product)
GEMMA_FORM = [
    f"{_HF}.gemma.modeling_gemma.GemmaRMSNorm",
    f"{_HF}.gemma2.modeling_gemma2.Gemma2RMSNorm",
    f"{_HF}.gemma3.modeling_gemma3.Gemma3RMSNorm",
]
# forward: `(x_hat_float32 * w.float()).type_as(x)` with x_hat by `pow(mean(x^2) + eps, -0.5)` (identical
# source in each; `with_scale=False` leaves no parameter, and no rule is needed)
GEMMA3N_FORM = [
    f"{_HF}.gemma3n.modeling_gemma3n.Gemma3nRMSNorm",
    f"{_HF}.gemma4.modeling_gemma4.Gemma4RMSNorm",
]
FLOAT_PRODUCT_FORM = [
    f"{_HF}.olmo2.modeling_olmo2.Olmo2RMSNorm",
    f"{_HF}.helium.modeling_helium.HeliumRMSNorm",
    *GEMMA_FORM,
    *GEMMA3N_FORM,
]
# forward: `x_hat_float32.type_as(x) * self.weight`: Llama's product in the other order
LLAMA4_TEXT = f"{_HF}.llama4.modeling_llama4.Llama4TextRMSNorm"
T5_FORM = [f"{_HF}.t5.modeling_t5.T5LayerNorm", f"{_HF}.mt5.modeling_mt5.MT5LayerNorm"]


def _eps(module: nn.Module) -> float:
    return module.variance_epsilon if hasattr(module, "variance_epsilon") else module.eps


def _normalised_float32(x: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def _scale_grad(dy: torch.Tensor, x_hat: torch.Tensor) -> dict[str, PerExampleGrad]:
    """``dw_i = sum_t dy_{i,t} * x_hat_{i,t}`` for a scale over the last axis, shape (B, d)."""
    return {"weight": Dense(as_sequence(dy * x_hat).sum(1))}


@register_rule(*LLAMA_FORM, LLAMA4_TEXT, position_wise=True, copies=True)
def llama_rms_norm_grads(module: nn.Module, x: torch.Tensor, dy: torch.Tensor) -> dict[str, PerExampleGrad]:
    return _scale_grad(dy, _normalised_float32(x, _eps(module)).to(x.dtype))


@register_rule(*FLOAT_PRODUCT_FORM, position_wise=True, copies=True)
def float_product_rms_norm_grads(
    module: nn.Module, x: torch.Tensor, dy: torch.Tensor
) -> dict[str, PerExampleGrad]:
    return _scale_grad(dy.float(), _normalised_float32(x, _eps(module)))


@register_rule(*T5_FORM, position_wise=True, copies=True)
def t5_layer_norm_grads(module: nn.Module, x: torch.Tensor, dy: torch.Tensor) -> dict[str, PerExampleGrad]:
    variance = x.to(torch.float32).pow(2).mean(-1, keepdim=True)
    x_hat = x * torch.rsqrt(variance + module.variance_epsilon)
    if module.weight.dtype in (torch.float16, torch.bfloat16):
        x_hat = x_hat.to(module.weight.dtype)
    return _scale_grad(dy, x_hat)


@register_rule(nn.RMSNorm, position_wise=True)
def torch_rms_norm_grads(module: nn.RMSNorm, x: torch.Tensor, dy: torch.Tensor) -> dict[str, PerExampleGrad]:
    """``torch.nn.RMSNorm`` normalises over ``normalized_shape`` (one or more trailing axes)."""
    x_hat = F.rms_norm(x, module.normalized_shape, None, module.eps)
    reduce = tuple(range(1, x.dim() - len(module.normalized_shape)))
    product = dy * x_hat
    return {"weight": Dense(product.sum(reduce) if reduce else product)}
