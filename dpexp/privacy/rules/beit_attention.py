"""timm's BEiT attention (``timm.models.beit.Attention``; Bao et al. 2022, BEiT, sec. 2.5 and app. B): the
attention of ``beit_*`` models, BEiT-large among them (Bu et al. 2023, Table 1).

The module owns the query and value biases ``q_bias``, ``v_bias`` (the key's is a zero buffer) and, with
``window_size``, a relative position bias table (R, heads) read through the fixed index buffer (N, N); it
reads its ``qkv`` submodule's weight itself, ``qkv = F.linear(x, W_qkv, cat(q_bias, 0, v_bias))``, and
computes

    S = (q * scale) k^T + Bias (+ the block's shared bias),   P = softmax(S),   y = proj(P v),

with ``Bias[h, s, t] = table[index[s, t], h]`` broadcast over the batch (inside one kernel where
``fused_attn``). Example i's gradients are sums over its positions and pairs of positions:

    dW_qkv,i = sum_t dqkv_{i,t} (x) x_{i,t},   dq_bias_i = sum_t dq_{i,t},   dv_bias_i = sum_t dv_{i,t},
    d table_i[r, h] = sum_{(s, t): index[s, t] = r} dS_i[h, s, t],

(Bu et al. 2023, eq. 2, for the projection; the scatter-add of Swin's window attention for the table). No
module sees ``qkv`` or ``S``, so the rule recomputes ``q, k, v`` and ``P`` from the captured input (the
module's own ``_get_rel_pos_bias`` for the bias) and takes the gradients by hand from ``dO = dy W_proj``,
the gradient at ``proj``'s input (an ``nn.Linear``, a layer of its own):

    dv = P^T dO,   dS = P * (dP - rowsum(P * dP)) with dP = dO v^T,   dq = scale dS k,   dk = scale dS^T q,

in float32 (float64 for a float64 model), one attention's backward more per layer, where the fallback
recomputed the whole module per example. The engine's verification compares the sums with autograd's.
Refused at the call: attention or output dropout in training (masks the recomputation cannot replay).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dpexp.privacy.per_example import Dense, Outer, PerExampleGrad
from dpexp.privacy.rules import CallLayout, first_output, forward_arguments, refuse, register_rule
from dpexp.privacy.rules.window_attention import scores_grad, table_grads

_TIMM_BEIT = "timm.models.beit.Attention"
_OWN = {"q_bias", "v_bias", "relative_position_bias_table"}


def _check(module: nn.Module) -> None:
    own = {name for name, p in module.named_parameters(recurse=False) if p.requires_grad}
    reason = None
    if own - _OWN:
        reason = f"it owns parameters {sorted(own - _OWN)} that the rule does not know"
    elif not all(type(getattr(module, name, None)) is nn.Linear for name in ("qkv", "proj")):
        reason = (
            "its qkv and proj are not both nn.Linear, the projections the rule differentiates; leave them "
            "unwrapped"
        )
    elif module.qkv.bias is not None:
        reason = "its qkv has a bias of its own beside q_bias and v_bias"
    refuse(module, "BEiT attention", "module", reason, "Otherwise freeze the attention's parameters.")


def beit_inputs(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple:
    """``(x (B, N, C), shared_rel_pos_bias (1, heads, N, N) or None)``; refuses dropout in training."""
    call = forward_arguments(module, args, kwargs)
    drops = {name: getattr(module, name).p for name in ("attn_drop", "proj_drop")}
    if module.training and any(p > 0 for p in drops.values()):
        raise ValueError(
            f"applies dropout {drops} in training, whose masks the BEiT attention rule cannot recompute; set "
            "attn_drop_rate=0 and proj_drop_rate=0 (or the modules' p = 0), or freeze the attention"
        )
    return call["x"], call.get("shared_rel_pos_bias")


@register_rule(_TIMM_BEIT, check=_check, call=CallLayout(beit_inputs, first_output), claims=("qkv",))
def beit_attention_grads(
    module: nn.Module, call: tuple[torch.Tensor, torch.Tensor | None], dy: torch.Tensor
) -> dict[str, PerExampleGrad]:
    """``call = (x, shared bias)``, ``dy`` (B, N, C) the gradient at the module's output; returns the
    gradients of ``qkv.weight`` (factored), ``q_bias``, ``v_bias`` and the table (B, R, heads)."""
    x, shared = call
    batch, n, _ = x.shape
    heads, table = module.num_heads, module.relative_position_bias_table
    dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    with torch.no_grad():
        bias = None if module.q_bias is None else torch.cat((module.q_bias, module.k_bias, module.v_bias))
        qkv = F.linear(x.to(dtype), module.qkv.weight.to(dtype), None if bias is None else bias.to(dtype))
        q, k, v = qkv.reshape(batch, n, 3, heads, -1).permute(2, 0, 3, 1, 4)  # (B, heads, N, head_dim)
        scores = (q * module.scale) @ k.transpose(-2, -1)
        if table is not None:
            scores = scores + module._get_rel_pos_bias().to(dtype)
        if shared is not None:
            scores = scores + shared.to(dtype)
        probs = scores.softmax(-1)
        d_out = (dy.to(dtype) @ module.proj.weight.to(dtype)).reshape(batch, n, heads, -1).transpose(1, 2)
        d_scores = scores_grad(probs, v, d_out, d_out.new_zeros(batch, 0))
        dq = (d_scores @ k) * module.scale
        dk = (d_scores.transpose(-2, -1) @ q) * module.scale
        dv = probs.transpose(-2, -1) @ d_out
        d_qkv = torch.stack((dq, dk, dv), 2).permute(0, 3, 2, 1, 4).reshape(batch, n, -1)  # (B, N, 3 H hd)
    weight = module.qkv.weight
    grads: dict[str, PerExampleGrad] = {"qkv.weight": Outer(d_qkv, x, weight.shape, weight.shape[0])}
    if module.q_bias is not None:
        width = module.q_bias.shape[0]
        grads["q_bias"] = Dense(d_qkv[..., :width].sum(1).to(module.q_bias.dtype))
        grads["v_bias"] = Dense(d_qkv[..., 2 * width :].sum(1).to(module.v_bias.dtype))
    if table is not None:
        grad = table_grads(d_scores, module.relative_position_index, table)
        grads["relative_position_bias_table"] = Dense(grad.to(table.dtype))
    return grads
