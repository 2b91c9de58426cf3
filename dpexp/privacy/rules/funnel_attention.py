"""Funnel Transformer's relative attention (Dai et al. 2020, Funnel-Transformer, app. A.2; Hugging Face's
``FunnelRelMultiheadAttention``): its own parameters enter the attention scores only,

    S = (q + s w) k^T + P(q + s v) + T(q + s u),     q = s q_head(query),  s = d_head^-1/2,

with ``w, v, u`` the biases ``r_w_bias``, ``r_r_bias``, ``r_s_bias`` (heads, d_head), each added to every
query row; ``P`` the positional term through ``r_kernel`` (d_model, heads, d_head) and ``T`` the token-type
term through ``seg_embed`` (2, heads, d_head), both masked by ``cls_mask`` where the model separates its
class token. With ``dS`` the gradient at ``S`` (B, heads, T_q, T_k), example i's gradients are sums over its
query rows:

- content (A.2, the first term): ``d w_i = s sum_{t, j} dS[i, :, t, j] k[i, j]``;
- relative shift (A.2.1): ``P[t, j] = ((q + s v) R^T)[t, shift(t, j)]`` with ``R = r W`` (``r``: the
  block's relative encodings, (T_r, d_model)), so with ``dP`` the transpose of the module's own gather
  (``_relative_shift_gather``, differentiated, none of its index arithmetic copied) applied to the masked
  ``dS``: ``d v_i = s sum_t dP_i R`` and ``d W_i = r^T dR_i``, ``dR_i = sum_t dP_i^T (q_i + s v)``, an
  :class:`~dpexp.privacy.per_example.Outer` over the T_r encodings;
- factorized (A.2.2): ``P = (Q phi) psi^T + (Q pi) omega^T``, ``Q = (q + s v) W^T`` per head, so
  ``dQ = (dS psi) phi + (dS omega) pi`` and ``d v_i = s sum_t dQ_i W``, ``d W_i = sum_t dQ_i^T (q_i + s v)``
  per head;
- token type: ``T[t, j] = ((q + s u) E^T)[t, same(t, j)]`` (``E``: ``seg_embed``, column 1 where the two
  tokens share a segment, 0 otherwise), so ``dE_i = sum_t dB_i^T (q_i + s u)`` and
  ``d u_i = s sum_t dB_i E`` with ``dB`` the masked ``dS`` summed over the keys of each kind.

``dS`` is read off the call's graph: the gradient at the sum of the three terms, the addition below the
scores' softmax (through the module's float32 cast and its mask). ``q_head``'s and ``k_head``'s outputs
are kept from the call; the projections and the output's post-projection and norm are submodules with
their own rules. What the rule gives is checked as every rule's is: on a verified micro-batch the
examples' gradients must add up to autograd's (:mod:`dpexp.privacy.verification`, check 2). Before this
rule the exact fallback recomputed the attention per example (``funnel``: 0.74x non-private throughput,
``results/bench/new_rules_stop52/``).
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import Node

from dpexp.privacy.per_example import Dense, Outer, PerExampleGrad
from dpexp.privacy.rules import (
    CallLayout,
    first_output,
    forward_arguments,
    refuse,
    register_rule,
    unknown_parameters,
)
from dpexp.privacy.rules.graph import GraphReads, call_nodes, kept_by
from dpexp.privacy.rules.submodule_values import read_call

_FUNNEL = "transformers.models.funnel.modeling_funnel.FunnelRelMultiheadAttention"
_OWN = {"r_w_bias", "r_r_bias", "r_kernel", "r_s_bias", "seg_embed"}
_KEEPS = {"q": ("q_head", "output"), "k": ("k_head", "output")}
_FIX = "Otherwise freeze r_w_bias, r_r_bias, r_kernel, r_s_bias and seg_embed (requires_grad=False)."
_BELOW_SOFTMAX = {"ToCopyBackward0", "SubBackward0"}  # the float32 cast and the mask's subtraction
_SUM = {"AddBackward0", "AddBackward1"}  # (content + positional) + token type (a tensor, or 0)


def _check(module: nn.Module) -> None:
    refuse(module, "funnel-attention", "module", unknown_parameters(module, _OWN), _FIX)


def _inputs(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple:
    """``(query (B, T_q, d_model), key (B, T_k, d_model), position_embeds, token_type_mat (B, T_q, T_k) or
    None, cls_mask (T_q, T_k) or None)``; refused where the call returns its probabilities, a second output
    whose gradient the rule would not see."""
    arguments = forward_arguments(module, args, kwargs, defaults=True)
    if arguments["output_attentions"]:
        raise ValueError(
            f"{type(module).__name__}: the privacy engine's funnel-attention rule cannot handle a call that "
            "returns its attention probabilities (output_attentions=True); set output_attentions=False. "
            f"{_FIX}"
        )
    position_embeds, token_type_mat, _, cls_mask = arguments["attention_inputs"]
    return (arguments["query"], arguments["key"], position_embeds, token_type_mat, cls_mask)


def _keeps(module: nn.Module) -> dict[str, tuple[str, str]]:
    return _KEEPS


def funnel_graph(module: nn.Module, call: tuple, output: Any, boundary: list) -> GraphReads | None:
    """The addition that forms the scores below their softmax (``d_scores``: its output gradient is
    ``dS``); None where the graph lacks it."""
    nodes = call_nodes(output, boundary)
    softmax = None if nodes is None else kept_by(nodes, "SoftmaxBackward0", "_saved_result")
    scores = None if softmax is None else _scores_below(softmax[0])
    return None if scores is None else GraphReads({}, {"d_scores": scores})


def _scores_below(softmax: Node) -> Node | None:
    """The node reached from the softmax's input through the casts and the mask's subtraction (first
    operands), if it is an addition; else None."""
    node = softmax.next_functions[0][0] if softmax.next_functions else None
    while node is not None and type(node).__name__ in _BELOW_SOFTMAX:
        node = node.next_functions[0][0]
    return node if node is not None and type(node).__name__ in _SUM else None


_LAYOUT = CallLayout(_inputs, first_output, keeps=_keeps, graph=funnel_graph)


@register_rule(_FUNNEL, check=_check, call=_LAYOUT)
def funnel_attention_grads(module: nn.Module, call: tuple, dy: torch.Tensor) -> dict[str, PerExampleGrad]:
    """The five parameters by the module docstring's formulas; ``dy`` unused (the gradient at the scores is
    read)."""
    (query, key, position_embeds, token_type_mat, cls_mask), kept, reads = read_call(
        module, call, _KEEPS, "funnel-attention", _FIX, inputs=5
    )
    heads, width = module.config.n_head, module.config.d_head
    batch, length, context = query.shape[0], query.shape[1], key.shape[1]
    scores, scale = reads["d_scores"], module.scale
    if scores.shape != (batch, heads, length, context):
        raise RuntimeError(
            f"{type(module).__name__}: the gradient read at its scores has shape {tuple(scores.shape)} where "
            f"the call's scores are {(batch, heads, length, context)}; register a rule for its type "
            f"(dpexp.privacy.rules.register_rule). {_FIX}"
        )
    with torch.no_grad():
        dtype = module.r_w_bias.dtype
        scores = scores.to(dtype)
        q = kept["q"].to(dtype).reshape(batch, length, heads, width) * scale
        k = kept["k"].to(dtype).reshape(batch, context, heads, width)
        masked = scores if cls_mask is None else scores * cls_mask.to(dtype)
        content = scale * torch.einsum("bnj,bjnd->bnd", scores.sum(2), k)
        if module.config.attention_type == "factorized":
            positional = _factorized(module, q, masked, position_embeds)
        else:
            positional = _relative_shift(module, q, masked, position_embeds, context)
        return {"r_w_bias": Dense(content), **positional, **_token_type(module, q, masked, token_type_mat)}


def _relative_shift(
    module: nn.Module, q: torch.Tensor, masked: torch.Tensor, position_embeds: Any, context: int
) -> dict[str, PerExampleGrad]:
    """``r_r_bias`` and ``r_kernel`` of the relative-shift form (A.2.1): the block's encodings ``r`` chosen
    as the module chooses them (shift 2 where the queries were pooled and the keys not)."""
    batch, length, heads, width = q.shape
    shift = 2 if length != context else 1
    encodings = position_embeds[module.block_index][shift - 1].to(q.dtype)  # (T_r, d_model)
    kernel, scale = module.r_kernel, module.scale
    gather = sys.modules[type(module).__module__]._relative_shift_gather
    with torch.enable_grad():
        shifted = q.new_zeros(batch, heads, length, encodings.shape[0], requires_grad=True)
        (d_shifted,) = torch.autograd.grad(gather(shifted, context, shift), shifted, masked)
    rotated = torch.einsum("td,dnh->tnh", encodings, kernel)  # R: (T_r, heads, d_head)
    d_bias = scale * torch.einsum("bnt,tnh->bnh", d_shifted.sum(2), rotated)
    d_rotated = torch.einsum("bnit,binh->btnh", d_shifted, q + scale * module.r_r_bias)
    left = encodings.expand(batch, *encodings.shape)
    right = d_rotated.reshape(batch, encodings.shape[0], heads * width)
    return {"r_r_bias": Dense(d_bias), "r_kernel": Outer(left, right, kernel.shape, kernel.shape[0])}


def _factorized(
    module: nn.Module, q: torch.Tensor, masked: torch.Tensor, position_embeds: Any
) -> dict[str, PerExampleGrad]:
    """``r_r_bias`` and ``r_kernel`` of the factorized form (A.2.2), ``(phi, pi, psi, omega)`` the call's."""
    phi, pi, psi, omega = (t.to(q.dtype) for t in position_embeds)
    kernel, scale = module.r_kernel, module.scale
    d_q = (
        torch.einsum("bnij,jd->bind", masked, psi) * phi[:, None]
        + torch.einsum("bnij,jd->bind", masked, omega) * pi[:, None]
    )  # at Q = (q + s v) W^T: (B, T_q, heads, d_model)
    d_bias = scale * torch.einsum("bnd,dnh->bnh", d_q.sum(1), kernel)
    d_kernel = torch.einsum("binh,bind->bdnh", q + scale * module.r_r_bias, d_q)
    return {"r_r_bias": Dense(d_bias), "r_kernel": Dense(d_kernel)}


def _token_type(
    module: nn.Module, q: torch.Tensor, masked: torch.Tensor, token_type_mat: torch.Tensor | None
) -> dict[str, PerExampleGrad]:
    """``r_s_bias`` and ``seg_embed``: zero for every example where the call had no token types."""
    batch = q.shape[0]
    bias, table, scale = module.r_s_bias, module.seg_embed, module.scale
    if token_type_mat is None:
        return {
            "r_s_bias": Dense(q.new_zeros(batch, *bias.shape)),
            "seg_embed": Dense(q.new_zeros(batch, *table.shape)),
        }
    same = token_type_mat[:, None].to(q.dtype)  # (B, 1, T_q, T_k)
    d_kinds = torch.stack([(masked * (1 - same)).sum(-1), (masked * same).sum(-1)], dim=-1)  # (B, n, T_q, 2)
    d_table = torch.einsum("bnis,bind->bsnd", d_kinds, q + scale * bias)
    d_bias = scale * torch.einsum("bns,snd->bnd", d_kinds.sum(2), table)
    return {"r_s_bias": Dense(d_bias), "seg_embed": Dense(d_table)}
