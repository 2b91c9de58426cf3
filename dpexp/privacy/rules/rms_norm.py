"""RMSNorm (Zhang & Sennrich 2019): ``y = w * x_hat`` with ``x_hat = x / sqrt(mean(x^2) + eps)`` over the
feature axis, no centring, no bias; the norm of Llama, Qwen, Mistral, Phi-3, Granite, Mamba, OLMo-2, Gemma
(which scales by ``1 + w``), Gemma 3n and 4, Llama 4, T5, CPM-Ant, ImageGPT and ``torch.nn.RMSNorm``. Gated
forms, called on ``(hidden_states, gate)`` (the gated delta nets of Qwen3-Next and Kimi Linear, the Mamba-2
mixers of Bamba, Zamba2, Nemotron-H, Falcon-H1, ...; Yang et al. 2024, Gated Delta Networks; Dao & Gu 2024,
Mamba-2) multiply ``x_hat`` by ``act(gate)`` after the norm, or normalise ``x * silu(gate)`` in groups of
features: then ``dw_i = sum_t dy_{i,t} * x_hat_{i,t} * act(gate_{i,t})`` or the grouped ``x_hat`` of the gated
input.

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

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dpexp.privacy.per_example import Dense, PerExampleGrad
from dpexp.privacy.rules import CallLayout, as_sequence, first_output, forward_arguments, register_rule

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
        ("mamba2", "Mamba2"),
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
# forward: `(x_hat_float32 * w.float()).type_as(x)` with x_hat by `rsqrt` (identical source in each)
MOSHI_FORM = [
    f"{_HF}.moshi.modeling_moshi.MoshiRMSNorm",
    f"{_HF}.kyutai_speech_to_text.modeling_kyutai_speech_to_text.KyutaiSpeechToTextRMSNorm",
]
FLOAT_PRODUCT_FORM = [
    f"{_HF}.olmo2.modeling_olmo2.Olmo2RMSNorm",
    f"{_HF}.helium.modeling_helium.HeliumRMSNorm",
    f"{_HF}.muse_spark.modeling_muse_spark.MuseSparkTextCenteredRMSNorm",  # (1 + w) in w's dtype, then float
    *GEMMA_FORM,
    *GEMMA3N_FORM,
    *MOSHI_FORM,
]
# forward: `x_hat_float32.type_as(x) * self.weight`: Llama's product in the other order
LLAMA4_TEXT = f"{_HF}.llama4.modeling_llama4.Llama4TextRMSNorm"
T5_FORM = [
    f"{_HF}.t5.modeling_t5.T5LayerNorm",
    f"{_HF}.mt5.modeling_mt5.MT5LayerNorm",
    f"{_HF}.idefics.modeling_idefics.IdeficsRMSNorm",
]
# forward(hidden_states, gate): gated RMSNorms of the linear-attention and state-space layers
# `(w * x_hat.to(x.dtype) * act(gate.float())).to(x.dtype)`, act = ACT2FN[self.activation] (Qwen3-Next's
# gated delta net; its copies in Qwen3.5, OLMo-hybrid, ...)
NORM_THEN_GATE_FORM = [f"{_HF}.qwen3_next.modeling_qwen3_next.Qwen3NextRMSNormGated"]
# `(w.float() * x_hat_float32 * act(gate.float())).to(x.dtype)` (Kimi Linear's and its copies: Bailing-hybrid,
# ...)
FLOAT_NORM_THEN_GATE_FORM = [f"{_HF}.kimi_linear.modeling_kimi_linear.KimiLinearRMSNormGated"]
# `w * norm_g(x.float() * silu(gate.float())).to(x.dtype)` normalised in groups of ``group_size`` features,
# the gate optional (Mamba-2's; its copies in Bamba, Zamba2, Nemotron-H, GraniteMoeHybrid)
GATE_THEN_NORM_FORM = [f"{_HF}.mamba2.modeling_mamba2.MambaRMSNormGated"]
FALCON_H1_GATED = f"{_HF}.falcon_h1.modeling_falcon_h1.FalconH1RMSNormGated"  # either order, n_groups
# forward: `(x * rsqrt(mean(x.float()^2) + eps)).to(x.dtype) * w`: the variance in float32, the product in x's
# dtype (CPM-Ant)
CPMANT = f"{_HF}.cpmant.modeling_cpmant.CpmAntLayerNorm"
# forward: `x / sqrt(mean(x^2) + eps) * w`, all in x's dtype (ImageGPT)
IMAGEGPT = f"{_HF}.imagegpt.modeling_imagegpt.ImageGPTLayerNorm"
QWEN4_EXP_TEXT = (
    f"{_HF}.qwen4_exp.modeling_qwen4_exp.Qwen4ExpTextRMSNorm"  # Gemma's 1 + w, optionally grouped
)


def _eps(module: nn.Module) -> float:
    return module.variance_epsilon if hasattr(module, "variance_epsilon") else module.eps


def _normalised_float32(x: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def _grouped_float32(h: torch.Tensor, size: int, eps: float) -> torch.Tensor:
    """``h`` (float32) normalised by its root mean square over every ``size`` consecutive features."""
    groups = h.unflatten(-1, (-1, size))
    return (groups * torch.rsqrt(groups.pow(2).mean(-1, keepdim=True) + eps)).flatten(-2)


def _scale_grad(dy: torch.Tensor, x_hat: torch.Tensor) -> dict[str, PerExampleGrad]:
    """``dw_i = sum_t dy_{i,t} * x_hat_{i,t}`` for a scale over the last axis, shape (B, d)."""
    return {"weight": Dense(as_sequence(dy * x_hat).sum(1))}


@register_rule(*LLAMA_FORM, LLAMA4_TEXT, position_wise=True, copies=True)
def llama_rms_norm_grads(module: nn.Module, x: torch.Tensor, dy: torch.Tensor) -> dict[str, PerExampleGrad]:
    return _scale_grad(dy, _normalised_float32(x, _eps(module)).to(x.dtype))


@register_rule(CPMANT, position_wise=True, copies=True)
def cpmant_layer_norm_grads(
    module: nn.Module, x: torch.Tensor, dy: torch.Tensor
) -> dict[str, PerExampleGrad]:
    variance = x.float().pow(2).mean(-1, keepdim=True)
    return _scale_grad(dy, (x * torch.rsqrt(variance + module.eps)).to(x.dtype))


@register_rule(IMAGEGPT, position_wise=True, copies=True)
def imagegpt_layer_norm_grads(
    module: nn.Module, x: torch.Tensor, dy: torch.Tensor
) -> dict[str, PerExampleGrad]:
    return _scale_grad(dy, x / torch.sqrt(x.square().mean(-1, keepdim=True) + module.eps))


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


def _activation(module: nn.Module) -> Any:
    """The gate's activation a gated RMSNorm names (``self.activation``), as its forward looks it up."""
    from transformers.activations import ACT2FN  # only Hugging Face modules take these rules

    return ACT2FN[module.activation]


def gated_inputs(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple:
    """``(hidden_states, gate)`` of a gated RMSNorm's call, the gate None or of the states' shape."""
    call = forward_arguments(module, args, kwargs, defaults=True)
    hidden, gate = list(call.values())[:2]
    if not torch.is_tensor(hidden) or (
        gate is not None and (not torch.is_tensor(gate) or gate.shape != hidden.shape)
    ):
        shapes = [tuple(t.shape) if torch.is_tensor(t) else type(t).__name__ for t in (hidden, gate)]
        raise ValueError(
            f"got hidden_states and gate of shapes {shapes}; the privacy engine's gated RMSNorm rule needs a "
            "gate of the states' shape (or none)."
        )
    return hidden, gate


GATED = {"position_wise": True, "call": CallLayout(gated_inputs, first_output, rows=(0, 1)), "copies": True}


@register_rule(*NORM_THEN_GATE_FORM, **GATED)
def norm_then_gate_grads(module: nn.Module, x: tuple, dy: torch.Tensor) -> dict[str, PerExampleGrad]:
    """``dw_i = sum_t dy_t * x_hat_t * act(gate_t)``, the product in the forward's precisions."""
    hidden, gate = x
    x_hat = _normalised_float32(hidden, _eps(module)).to(hidden.dtype)
    return _scale_grad((dy * _activation(module)(gate.float())).to(hidden.dtype), x_hat)


@register_rule(*FLOAT_NORM_THEN_GATE_FORM, **GATED)
def float_norm_then_gate_grads(module: nn.Module, x: tuple, dy: torch.Tensor) -> dict[str, PerExampleGrad]:
    """``dw_i = sum_t dy_t * x_hat_t * act(gate_t)`` in float32."""
    hidden, gate = x
    gated = dy.float() * _activation(module)(gate.float())
    return _scale_grad(gated, _normalised_float32(hidden, _eps(module)))


@register_rule(*GATE_THEN_NORM_FORM, **GATED)
def gate_then_norm_grads(module: nn.Module, x: tuple, dy: torch.Tensor) -> dict[str, PerExampleGrad]:
    """``dw_i = sum_t dy_t * norm_g(x_t * silu(gate_t))``, normalised in groups of ``group_size`` (all the
    features where the module has no ``group_size``, as in transformers 5.17)."""
    hidden, gate = x
    h = hidden.float() if gate is None else hidden.float() * F.silu(gate.float())
    size = getattr(module, "group_size", h.shape[-1])
    return _scale_grad(dy, _grouped_float32(h, size, _eps(module)).to(hidden.dtype))


@register_rule(FALCON_H1_GATED, **GATED)
def falcon_h1_gated_grads(module: nn.Module, x: tuple, dy: torch.Tensor) -> dict[str, PerExampleGrad]:
    """Falcon-H1's ``(w * norm_g(h) [* silu(gate)]).to(x.dtype)`` in float32, ``h = x [* silu(gate)]``: the
    gate before the ``n_groups`` group norms, or after them (``norm_before_gate``)."""
    hidden, gate = x
    silu = None if gate is None else F.silu(gate.float())
    after = silu is not None and module.norm_before_gate
    h = hidden if silu is None or after else hidden * silu
    x_hat = _grouped_float32(h.float(), h.shape[-1] // module.n_groups, _eps(module))
    return _scale_grad(dy.float() * silu if after else dy.float(), x_hat)


@register_rule(QWEN4_EXP_TEXT, position_wise=True, copies=True)
def grouped_float_product_grads(
    module: nn.Module, x: torch.Tensor, dy: torch.Tensor
) -> dict[str, PerExampleGrad]:
    """Qwen4-Exp's ``(x_hat_float32 * (1 + w).float()).type_as(x)``, normalised in groups of ``group_size``
    features (all of them where it is None)."""
    return _scale_grad(
        dy.float(), _grouped_float32(x.float(), module.group_size or x.shape[-1], _eps(module))
    )


@register_rule(nn.RMSNorm, position_wise=True)
def torch_rms_norm_grads(module: nn.RMSNorm, x: torch.Tensor, dy: torch.Tensor) -> dict[str, PerExampleGrad]:
    """``torch.nn.RMSNorm`` normalises over ``normalized_shape`` (one or more trailing axes)."""
    x_hat = F.rms_norm(x, module.normalized_shape, None, module.eps)
    reduce = tuple(range(1, x.dim() - len(module.normalized_shape)))
    product = dy * x_hat
    return {"weight": Dense(product.sum(reduce) if reduce else product)}
