"""``nn.MultiheadAttention`` (and so ``nn.TransformerEncoderLayer`` / ``DecoderLayer``, which call it).

Its parameters enter through linear maps applied at every position: the projections
``q_t = W_q x^q_t + b_q`` (query positions t), ``k_s = W_k x^k_s + b_k``, ``v_s = W_v x^v_s + b_v`` (key
positions s), the learned extra key and value ``bias_k``, ``bias_v`` (``add_bias_kv``) appended as one more
key position, and the output projection ``y_t = W_o ctx_t + b_o`` of the attention context ``ctx_t``. Example
i's gradients are therefore sums over its positions (Bu et al. 2023, eq. 2, once per map):

    dW_q = sum_t dq_t (x) x^q_t,   dW_k = sum_s dk_s (x) x^k_s,   dW_v = sum_s dv_s (x) x^v_s,
    db_{q,k,v} = sums of dq, dk, dv,   dbias_k = dk_{S+1},   dbias_v = dv_{S+1},
    dW_o = sum_t dy_t (x) ctx_t,   db_o = sum_t dy_t,

in the factored :class:`~dpexp.privacy.per_example.Outer` / ``Dense`` forms. With one packed
``in_proj_weight`` (3E, E) its per-example gradient is the three row blocks stacked: in self-attention
(query, key and value one tensor) ``sum_t [dq_t; dk_t; dv_t] (x) x_t``, otherwise an ``Outer`` over the
concatenated positions of query, key and value whose left factor is zero outside each block. The
``dq, dk, dv, dy`` of every example and position come from one recomputation of the attention from the
captured inputs (parameters detached, a zero added to each map's output, masks applied as PyTorch's
``multi_head_attention_forward`` does) and one autograd backward of ``<outputs, d outputs>`` to those zeros.
Without ``bias_k``/``bias_v`` or zero attention nothing is recomputed: the context and ``dq, dk, dv`` are
read off the autograd graph of the call itself (:func:`attention_graph`, :mod:`dpexp.privacy.rules.graph`),
where autograd's own backward forms them.
The output projection ``out_proj`` is a submodule that the forward never calls: the rule claims its
parameters. Opacus replaces the module by its own ``DPMultiheadAttention``; here the user's module runs
unchanged.

The engine sees the call batch-first, from the module's ``batch_first`` (``key_padding_mask`` and
``attn_weights`` have the batch in dim 0 either way; a 3-D ``attn_mask`` of shape (B * heads, L, S) is viewed
as (B, heads, L, S)); the probe establishes it. Supported: ``kdim``/``vdim``, ``add_bias_kv``,
``add_zero_attn``, ``bias=False``, boolean or additive ``key_padding_mask`` and ``attn_mask``, ``is_causal``
(a hint: the mask is then given), ``need_weights`` with or without head averaging. Refused at the call,
with the fix: unbatched (2-D) inputs and attention dropout in training (the fused kernels' mask cannot be
replayed).
"""

from __future__ import annotations

import inspect
import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dpexp.privacy.per_example import Dense, Outer, PerExampleGrad
from dpexp.privacy.rules import CallLayout, register_rule
from dpexp.privacy.rules.graph import (
    GraphReads,
    call_nodes,
    kept_attention_output,
    kept_product_below,
    matmul_with,
)

_SIGNATURE = inspect.signature(nn.MultiheadAttention.forward)


def attention_inputs(module: nn.MultiheadAttention, args: tuple, kwargs: dict[str, Any]) -> tuple:
    """``(query, key, value, key_padding_mask, attn_mask, need_weights, average_attn_weights, sources)``
    with query (B, L, E), key and value (B, S, kdim / vdim), attn_mask (L, S) or (B, heads, L, S), and
    ``sources`` the number of distinct tensors among query, key and value (1: self-attention; 2: the key is
    the value, as the decoder's attention to its memory; 3), which decides the projections'
    form in ``multi_head_attention_forward``."""
    call = _SIGNATURE.bind(module, *args, **kwargs)
    call.apply_defaults()
    q, k, v = call.arguments["query"], call.arguments["key"], call.arguments["value"]
    if q.dim() != 3:
        raise ValueError(
            f"got an unbatched query of shape {tuple(q.shape)}; the privacy engine needs the batch in the "
            "inputs: pass (B, L, E) with batch_first=True, or (L, B, E)"
        )
    if module.training and module.dropout > 0:
        raise ValueError(
            f"applies attention dropout (p={module.dropout}) in training, whose mask the per-example "
            "gradient rule cannot replay; set dropout=0 (e.g. nn.TransformerEncoderLayer(dropout=0))"
        )
    sources = 1 if q is k and k is v else 2 if k is v else 3
    if not module.batch_first:
        q, k, v = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
    mask = call.arguments["attn_mask"]
    if mask is not None and mask.dim() == 3:
        mask = mask.view(q.shape[0], module.num_heads, *mask.shape[1:])
    return (
        q,
        k,
        v,
        call.arguments["key_padding_mask"],
        mask,
        bool(call.arguments["need_weights"]),
        bool(call.arguments["average_attn_weights"]),
        sources,
    )


def attention_output_grad(module: nn.MultiheadAttention, grads: list[torch.Tensor | None]) -> torch.Tensor:
    """Gradients of ``(attn_output, attn_weights)`` packed batch-first: (B, L * E [+ weights' size])."""
    out, weights = grads
    out = out if module.batch_first else out.transpose(0, 1)
    parts = [out] + ([] if weights is None else [weights])
    return torch.cat([p.reshape(p.shape[0], -1) for p in parts], 1)


def _additive(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """A boolean mask (True: not attended) as -inf / 0, an additive one as it is."""
    if mask is None or mask.is_floating_point():
        return mask
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(mask, float("-inf"))


def _projections(module: nn.MultiheadAttention) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """(weight, bias) of the q, k and v maps, as views of the module's parameters."""
    if module._qkv_same_embed_dim:
        weights = module.in_proj_weight.chunk(3)
    else:
        weights = [module.q_proj_weight, module.k_proj_weight, module.v_proj_weight]
    biases = module.in_proj_bias.chunk(3) if module.in_proj_bias is not None else [None] * 3
    return list(zip(weights, biases, strict=True))


def _projection_weights(module: nn.MultiheadAttention, sources: int) -> dict[str, torch.Tensor]:
    """The weights ``multi_head_attention_forward`` multiplies the inputs by, each in one ``F.linear``: the
    packed ``in_proj_weight`` whole in self-attention, split ``[:E]``, ``[E:]`` when the key is the value,
    in three otherwise; the three separate weights of a module with ``kdim``/``vdim``."""
    if not module._qkv_same_embed_dim:
        return {"q": module.q_proj_weight, "k": module.k_proj_weight, "v": module.v_proj_weight}
    weight, embed = module.in_proj_weight, module.embed_dim
    if sources == 1:
        return {"qkv": weight}
    if sources == 2:
        return {"q": weight[:embed], "kv": weight[embed:]}
    return dict(zip("qkv", weight.chunk(3), strict=True))


def attention_graph(
    module: nn.MultiheadAttention, x: tuple, output: tuple, boundary: list[torch.Tensor]
) -> GraphReads | None:
    """The context and the projections' output gradients, read off the call's autograd graph
    (:mod:`dpexp.privacy.rules.graph`) instead of recomputed: without ``bias_k``/``bias_v`` or zero attention,
    ``multi_head_attention_forward`` projects its (L, B, E) and (S, B, kdim) inputs with one ``F.linear``
    per weight of :func:`_projection_weights` (a matrix product keeping that weight's transpose). Without
    the weights returned it attends with ``scaled_dot_product_attention``, whose fused kernels keep their
    output, the context (B, heads, L, E / heads); with them, it forms the context as ``bmm(weights, v)``
    ((B * heads, L, S) by (B * heads, S, E / heads)), which keeps both for its backward, and passes it
    through views and a copy to the output projection. None otherwise, and where the call built no such
    graph (inputs that need no gradient with the weights frozen, autocast's weight copies)."""
    query, need_weights, sources = x[0], x[5], x[7]
    if module.bias_k is not None or module.add_zero_attn:
        return None
    nodes = call_nodes(output[0], boundary)
    if nodes is None:
        return None
    found = {
        name: matmul_with(nodes, weight) for name, weight in _projection_weights(module, sources).items()
    }
    if any(node is None for node in found.values()):
        return None
    batch, length, embed = query.shape
    heads = module.num_heads
    if not need_weights:
        context = kept_attention_output(nodes)
        if context is None or context.shape != (batch, heads, length, embed // heads):
            return None
        return GraphReads({"context": context}, found)  # autograd's tensor: no copy held until the backward
    out_node = matmul_with(nodes, module.out_proj.weight)
    kept = None if out_node is None else kept_product_below(out_node, nodes)
    if kept is None:
        return None
    weights, values = kept
    if weights.shape[:2] != (batch * heads, length) or values.shape[1:] != (weights.shape[2], embed // heads):
        return None
    return GraphReads({"weights": weights, "values": values}, found)


def attention_grads(module: nn.MultiheadAttention, x: tuple, dy: torch.Tensor) -> dict[str, PerExampleGrad]:
    """Per-example gradients of every parameter of ``module`` (``out_proj.*`` included), see the docstring.
    Where the call's graph gave the context and the projections' output gradients (:func:`attention_graph`:
    ``x`` has a ninth entry) nothing is recomputed; otherwise :func:`_recomputed`."""
    query, key, value, padding, mask, need_weights, average, sources = x[:8]
    batch, length, embed = query.shape
    if len(x) > 8:
        context, dproj = _read(module, x[-1], query, key, sources)
        do, _ = _split_output_grad(dy, batch, length, embed, False)
        extra = {}
    else:
        dtype = module.out_proj.weight.dtype
        query, key, value = (t.detach().to(dtype) for t in (query, key, value))
        do, dweights = _split_output_grad(dy, batch, length, embed, need_weights)
        do = do.to(dtype)
        call = (padding, mask, need_weights, average, sources)
        context, dproj, extra = _recomputed(module, query, key, value, call, do, dweights)
    grads: dict[str, PerExampleGrad] = {"out_proj.weight": Outer(do, context, (embed, embed), embed)}
    if module.out_proj.bias is not None:
        grads["out_proj.bias"] = Dense(do.sum(1))
    query, key, value = query.detach(), key.detach(), value.detach()
    if len(dproj) == 1:  # self-attention, packed: [dq, dk, dv] at every position of the one input
        grads["in_proj_weight"] = Outer(dproj[0], query, (3 * embed, embed), 3 * embed)
    elif module._qkv_same_embed_dim:
        grads["in_proj_weight"] = _stacked(*dproj, query, key, value)
    else:
        for name, d, a in zip("qkv", dproj, (query, key, value), strict=True):
            grads[f"{name}_proj_weight"] = Outer(d, a, (embed, a.shape[-1]), embed)
    if module.in_proj_bias is not None:
        grads["in_proj_bias"] = Dense(torch.cat([d.sum(1) for d in dproj], -1))
    for name, g in extra.items():
        grads[name] = Dense(g.view(batch, 1, 1, embed))
    return grads


def _read(
    module: nn.MultiheadAttention, reads: dict[str, torch.Tensor], query: torch.Tensor, key: torch.Tensor,
    sources: int,
) -> tuple[torch.Tensor, list[torch.Tensor]]:  # fmt: skip
    """The context (B, L, E) and the projections' output gradients batch-first, from the graph's reads:
    the context as the attention kernel returned it, (B, heads, L, E / heads), or as the product of the
    weights and values its ``bmm`` kept, and each projection's gradient as ``F.linear`` formed it on the
    time-major input, (L * B, width) with row ``l * B + b`` (or (L, B, width)). Returns ``[d qkv]`` in packed
    self-attention, else ``[dq, dk, dv]``."""
    batch, length, embed = query.shape
    context = reads.get("context")
    if context is None:  # the weights and values the context's bmm kept, (B * heads, ...)
        context = torch.bmm(reads["weights"], reads["values"]).view(batch, module.num_heads, length, -1)
    context = context.transpose(1, 2).reshape(batch, length, embed)
    positions = {"qkv": length, "q": length, "kv": key.shape[1], "k": key.shape[1], "v": key.shape[1]}
    grads = {}
    for name, weight in _projection_weights(module, sources).items():
        grad, rows = reads[name], positions[name]
        if grad.numel() != rows * batch * weight.shape[0]:
            raise RuntimeError(
                f"nn.MultiheadAttention: the {name} projection's gradient read off the graph has shape "
                f"{tuple(grad.shape)}, not ({rows} * {batch}, {weight.shape[0]})"
            )
        grads[name] = grad.reshape(rows, batch, weight.shape[0]).transpose(0, 1).contiguous()
    if "kv" in grads:
        grads["k"], grads["v"] = grads.pop("kv").chunk(2, -1)
    return context, [grads["qkv"]] if "qkv" in grads else [grads[name] for name in "qkv"]


def _recomputed(
    module: nn.MultiheadAttention, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, call: tuple,
    do: torch.Tensor, dweights: torch.Tensor | None,
) -> tuple[torch.Tensor, list[torch.Tensor], dict[str, torch.Tensor]]:  # fmt: skip
    """The context, the projections' output gradients (as :func:`_read`) and those of ``bias_k``,
    ``bias_v``, from one recomputation of the call in the weights' dtype (under autocast from the recorded
    half-precision inputs in float32: the norms and clipped sums are those of these gradients, which differ
    from autograd's by its rounding). The output projection is not run again: ``do`` is the output's
    gradient itself and the context's is ``do W_o``. In self-attention the three projections are one packed
    matmul, and without the weights returned the attention is ``scaled_dot_product_attention``, whose
    backward forms no (L, S) gradient."""
    padding, mask, need_weights, average, sources = call
    batch, length, embed = query.shape
    heads = module.num_heads
    packed = sources == 1 and module._qkv_same_embed_dim
    projections = [(w.detach(), None if b is None else b.detach()) for w, b in _projections(module)]
    with torch.enable_grad():
        if packed:
            zqkv = query.new_zeros(batch, length, 3 * embed, requires_grad=True)
            bias = None if module.in_proj_bias is None else module.in_proj_bias.detach()
            q, k, v = (F.linear(query, module.in_proj_weight.detach(), bias) + zqkv).chunk(3, -1)
            leaves = [zqkv]
        else:
            leaves = [t.new_zeros(*t.shape[:2], embed, requires_grad=True) for t in (query, key, value)]
            q, k, v = (
                F.linear(t, weight, bias) + z
                for t, (weight, bias), z in zip((query, key, value), projections, leaves, strict=True)
            )
        padding, mask = _additive(padding, q.dtype), _additive(mask, q.dtype)
        extra = {}
        if module.bias_k is not None:
            extra = {n: q.new_zeros(batch, 1, embed, requires_grad=True) for n in ("bias_k", "bias_v")}
            k = torch.cat([k, module.bias_k.detach().expand(batch, 1, embed) + extra["bias_k"]], 1)
            v = torch.cat([v, module.bias_v.detach().expand(batch, 1, embed) + extra["bias_v"]], 1)
            padding, mask = (None if m is None else F.pad(m, (0, 1)) for m in (padding, mask))
        if module.add_zero_attn:
            k, v = (torch.cat([t, t.new_zeros(batch, 1, embed)], 1) for t in (k, v))
            padding, mask = (None if m is None else F.pad(m, (0, 1)) for m in (padding, mask))
        qh, kh, vh = (t.view(batch, t.shape[1], heads, -1).transpose(1, 2) for t in (q, k, v))
        bias_scores = _score_bias(mask, padding)
        if need_weights:
            scores = qh @ kh.transpose(-1, -2) / math.sqrt(embed // heads)
            attn = torch.softmax(scores if bias_scores is None else scores + bias_scores, -1)
            results = [attn @ vh, attn.mean(1) if average else attn]
        else:
            results = [F.scaled_dot_product_attention(qh, kh, vh, attn_mask=bias_scores)]
        context = results[0].transpose(1, 2).reshape(batch, length, embed)
        dcontext = (do @ module.out_proj.weight.detach()).view(batch, length, heads, -1).transpose(1, 2)
        grads_out = [dcontext] + ([] if dweights is None else [dweights.view_as(results[1]).to(do.dtype)])
        found = torch.autograd.grad(results, [*leaves, *extra.values()], grads_out, allow_unused=True)
    found = [
        torch.zeros_like(z) if g is None else g
        for g, z in zip(found, [*leaves, *extra.values()], strict=True)
    ]
    return context.detach(), found[: len(leaves)], dict(zip(extra, found[len(leaves) :], strict=True))


def _score_bias(mask: torch.Tensor | None, padding: torch.Tensor | None) -> torch.Tensor | None:
    """The additive attention mask (L, S) or (B, heads, L, S) plus the key padding (B, S) as (B, 1, 1, S)."""
    if padding is None:
        return mask
    padding = padding[:, None, None, :]
    return padding if mask is None else mask + padding


def _split_output_grad(
    dy: torch.Tensor, batch: int, length: int, embed: int, need_weights: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The packed (B, L * E [+ weights' size]) output gradient as the output's (B, L, E) and the weights'
    (flat, or None when no weights are returned)."""
    out = dy[:, : length * embed].reshape(batch, length, embed)
    return out, (dy[:, length * embed :] if need_weights else None)


def _stacked(
    dq: torch.Tensor,
    dk: torch.Tensor,
    dv: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
) -> Outer:
    """``in_proj_weight``'s per-example gradient ``[dW_q; dW_k; dW_v]`` (3E, E) as one ``Outer`` over the
    concatenated positions of query, key and value, whose left factor is zero outside each block (inputs
    that are not one tensor; self-attention takes one packed ``Outer``)."""
    embed = query.shape[-1]
    blocks = [F.pad(d, (i * embed, (2 - i) * embed)) for i, d in enumerate((dq, dk, dv))]
    return Outer(torch.cat(blocks, 1), torch.cat([query, key, value], 1), (3 * embed, embed), 3 * embed)


register_rule(
    nn.MultiheadAttention,
    call=CallLayout(attention_inputs, attention_output_grad, graph=attention_graph),
    claims=("out_proj",),
)(attention_grads)
