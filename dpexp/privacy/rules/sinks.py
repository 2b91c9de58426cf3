"""Attention sinks: a learnt logit per head that every query row's softmax also normalises over, and whose
column is then dropped (Xiao et al. 2024, Efficient Streaming Language Models with Attention Sinks; the
learnable form of Hugging Face's ``GptOssAttention`` and of the attentions written after it).

Per head h, query position t and example i, with the real scores ``z_j``, the values ``v_j`` and the sink
``s_h`` (a parameter shared by all examples and positions):

    p_j = exp(z_j) / (sum_k exp(z_k) + exp(s_h)),   p_sink = 1 - sum_j p_j,   a = sum_j p_j v_j.

The models write it in two ways: GPT-OSS, Flint, MiMo-V2-Flash, HY-V4 and DeepSeek-V4 append ``s_h`` to the
scores as a last column, softmax and drop it; Granite-SWA and Granite-MoE-SWA scale the plain softmax's
output by ``sigmoid(logsumexp(z) - s_h) = 1 - p_sink``. HY-V4 then gates ``a`` elementwise. Since
``d p_j / d s_h = -p_j p_sink``, in every form the input ``y`` of ``o_proj`` (the heads' outputs, gated or
not) moves as ``dy/ds_h = -p_sink y`` in head h's columns and not at all in another head's, and example
i's gradient is a sum over its query positions,

    d s_i[h] = sum_t <do[i, t, h], dy[i, t, h]/ds_h> + sum_{t, j} dP[i, h, t, j] dP[i, h, t, j]/ds_h,

with ``do = d_out W_o`` the gradient at ``o_proj``'s input (``o_proj`` an ``nn.Linear``; DeepSeek-V4's heads
go through a block-diagonal grouped projection and a mixing one, followed alike) and ``dP`` the
gradient of the probabilities the module returns, where they reach the loss. The rule does not follow
either formula: it runs the module's own forward once more in forward mode, with every sink moved along a
tangent of ones (:func:`~dpexp.privacy.rules.submodule_values.tangents`), and reads the tangents at
``o_proj``'s input and of the returned probabilities. Because a sink moves only its own head's columns,
head h's columns of those tangents are ``dy/ds_h`` and ``dP/ds_h``: how the scores are formed, rotary
positions, windows, masks, gates and float32 casts included, is the module's own. A module whose sinks
reached another head's columns would give example sums that differ from autograd's, which the engine's
verification refuses. The projections are ``nn.Linear`` submodules with their own rules. Without the rule
these modules took the exact fallback, which recomputed them per example.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from dpexp.privacy.per_example import Dense, PerExampleGrad
from dpexp.privacy.rules import CallLayout, refuse, register_rule, unknown_parameters
from dpexp.privacy.rules.directional import directional_grads, eager_inputs, wrapped_projection
from dpexp.privacy.rules.window_attention import attention_output_grad

_MODELS = "transformers.models"
_ATTENTIONS = (
    f"{_MODELS}.gpt_oss.modeling_gpt_oss.GptOssAttention",
    f"{_MODELS}.flint.modeling_flint.FlintAttention",
    f"{_MODELS}.mimo_v2_flash.modeling_mimo_v2_flash.MiMoV2FlashAttention",  # sinks on its window layers
    f"{_MODELS}.hy_v4.modeling_hy_v4.HYV4Attention",  # a gated output
    f"{_MODELS}.granite_swa.modeling_granite_swa.GraniteSWAAttention",  # the sigmoid(lse - s) form
    f"{_MODELS}.granitemoe_swa.modeling_granitemoe_swa.GraniteMoeSWAAttention",
    f"{_MODELS}.deepseek_v4.modeling_deepseek_v4.DeepseekV4Attention",  # a grouped output projection
)
_FIX = "Otherwise freeze the sinks (requires_grad=False)."


def _check(module: nn.Module) -> None:
    reason = unknown_parameters(module, {"sinks"}) or wrapped_projection(module)
    refuse(module, "attention-sinks", "module", reason, _FIX)


def sinks_inputs(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple:
    """:func:`~dpexp.privacy.rules.directional.eager_inputs` for the sinks: a kernel may not apply them at
    all."""
    return eager_inputs(module, args, kwargs, "attention-sinks", "freeze the sinks")


@register_rule(*_ATTENTIONS, check=_check, call=CallLayout(sinks_inputs, attention_output_grad))
def sinks_grads(module: nn.Module, call: tuple, dy: torch.Tensor) -> dict[str, PerExampleGrad]:
    """``d sinks`` (B, heads) by the formula of the module docstring
    (:func:`~dpexp.privacy.rules.directional.directional_grads` along a tangent of ones); ``dy`` (B, T*d
    [+ heads*T*S]): the gradients of the output and of the returned probabilities. The tangents are those of
    the module's dtype (float32 where it casts)."""
    sinks = module.sinks
    grad = directional_grads(
        module, call, dy, {"sinks": torch.ones_like(sinks)}, sinks.shape[0],
        "register a rule for this attention, or freeze the sinks",
    )  # fmt: skip
    return {"sinks": Dense(grad.to(sinks.dtype))}
