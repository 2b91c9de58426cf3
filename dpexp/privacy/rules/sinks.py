"""Attention sinks: a learnt logit per head that every query row's softmax also normalises over, and whose
column is then dropped (Xiao et al. 2024, Efficient Streaming Language Models with Attention Sinks; the
learnable form of Hugging Face's ``GptOssAttention``, its eager attention function).

Per head h, query position t and example i, with the real scores ``z_j`` (``Q K^T * scaling + mask``), the
values ``v_j`` and the sink ``s_h`` (a parameter shared by all examples and positions):

    p_j = exp(z_j) / (sum_k exp(z_k) + exp(s_h)),   p_sink = 1 - sum_j p_j,   o = sum_j p_j v_j.

Since ``d p_j / d s_h = -p_j p_sink``, example i's gradient is a sum over its query positions,

    d s_i[h] = - sum_t p_sink[i, h, t] (<do[i, t, h], o[i, t, h]> + sum_j p_j dP_j),

with ``o`` the attention's output per head (``o_proj``'s input), ``do = dy W_o`` its gradient (``o_proj`` an
``nn.Linear``) and ``dP`` the gradient of the probabilities the module returns, where they reach the loss.
The rule takes ``p`` and ``o`` from the module's own forward, run once more on the captured call without
recording (how the scores are formed, rotary positions, sliding windows and masks included, is the module's
own), and reads ``o`` at ``o_proj``'s input. The projections are ``nn.Linear`` submodules with their own
rules. Without the rule the module took the exact fallback, which recomputed it per example.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

from dpexp.privacy.per_example import Dense, PerExampleGrad
from dpexp.privacy.rules import CallLayout, refuse, register_rule
from dpexp.privacy.rules.submodule_values import rerun
from dpexp.privacy.rules.window_attention import attention_output_grad, wrapped_o_proj

_GPT_OSS = "transformers.models.gpt_oss.modeling_gpt_oss.GptOssAttention"
_FIX = "Otherwise freeze the sinks (requires_grad=False)."


def _check(module: nn.Module) -> None:
    own = {name for name, p in module.named_parameters(recurse=False) if p.requires_grad}
    unknown = sorted(own - {"sinks"})
    reason = f"it owns parameters {unknown} the rule does not know" if unknown else wrapped_o_proj(module)
    refuse(module, "attention-sinks", "module", reason, _FIX)


def sinks_inputs(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple:
    """``(hidden_states (B, T, d), args, kwargs)``: the main input and the call as given, which the rule runs
    again. Refuses a call it cannot run again to the same probabilities: another attention implementation
    than eager (the others return no probabilities), attention dropout in training (its mask is drawn
    inside the attention function), and a key/value cache (a second run would extend it)."""
    call = inspect.signature(module.forward).bind(*args, **kwargs)
    implementation = getattr(module.config, "_attn_implementation", None)
    if implementation != "eager":
        raise ValueError(
            f"attention implementation {implementation!r}: the attention-sinks rule reads the probabilities "
            "that the 'eager' implementation returns; load the model with attn_implementation='eager', or "
            "freeze the sinks"
        )
    if module.training and module.attention_dropout > 0:
        raise ValueError(
            f"applies attention dropout (p={module.attention_dropout}) inside the attention function in "
            "training, whose mask the rule cannot see; set attention_dropout=0, or freeze the sinks"
        )
    if any(call.arguments.get(name) is not None for name in ("cache", "past_key_values")):
        raise ValueError(
            "was given a key/value cache, which the rule's second run of the attention would extend; call "
            "the model with use_cache=False in training, or freeze the sinks"
        )
    return call.arguments["hidden_states"], args, kwargs


@register_rule(_GPT_OSS, check=_check, call=CallLayout(sinks_inputs, attention_output_grad))
def sinks_grads(module: nn.Module, call: tuple, dy: torch.Tensor) -> dict[str, PerExampleGrad]:
    """``d sinks`` (B, heads) by the formula of the module docstring; ``dy`` (B, T*d [+ heads*T*S]): the
    gradients of the output and of the returned probabilities. Computed in float64 for float64 sinks,
    else in float32."""
    hidden, args, kwargs = call
    batch, length = hidden.shape[:2]
    heads, head_dim = module.sinks.shape[0], module.head_dim
    dtype = torch.float64 if module.sinks.dtype == torch.float64 else torch.float32
    output, seen = rerun(
        module,
        args,
        kwargs,
        {"out": ("o_proj", "input")},
        "register a rule for this attention, or freeze the sinks",
    )
    probs = output[1]
    if not torch.is_tensor(probs):
        raise RuntimeError(
            f"{type(module).__name__}: its second run returned {type(probs).__name__} probabilities, where "
            "the rule needs eager's; register a rule for this attention, or freeze the sinks."
        )
    with torch.no_grad():
        probs = probs.to(dtype)  # (B, heads, T, S)
        out = seen["out"][0].reshape(batch, length, heads, head_dim).to(dtype)
        width = length * module.o_proj.out_features  # the output's part of each row of dy
        d_out = dy[:, :width].reshape(batch, length, -1).to(dtype)
        d_heads = (d_out @ module.o_proj.weight.to(dtype)).reshape(batch, length, heads, head_dim)
        d_mass = (d_heads * out).sum(-1).transpose(1, 2)  # <do, o>: (B, heads, T)
        d_returned = dy[:, width:]
        if d_returned.shape[1]:
            d_mass = d_mass + (probs * d_returned.reshape(probs.shape).to(dtype)).sum(-1)
        sink = 1 - probs.sum(-1)  # p_sink: (B, heads, T)
        grad = -(sink * d_mass).sum(-1)
    return {"sinks": Dense(grad.to(module.sinks.dtype))}
