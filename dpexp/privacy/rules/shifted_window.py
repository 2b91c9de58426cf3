"""torchvision's Swin attention, ``ShiftedWindowAttention`` (Liu et al. 2021, Swin Transformer, sec. 3.2,
eq. 4) and ``ShiftedWindowAttentionV2`` (Liu et al. 2022, Swin Transformer V2, sec. 3.2-3.3, eqs. 2-4).

The module passes its ``qkv`` and ``proj`` weights to ``shifted_window_attention`` and never calls those
``nn.Linear`` submodules, so no linear rule sees them. On an input X (B, H, W, C) the function pads H and W to
multiples of the window (Wh, Ww), rolls the map by (-sh, -sw) (shifted windows), and cuts it into the nW
windows of every example, rows (B*nW, N = Wh*Ww, C) example-major: the windowed tokens ``x``. Then per window
and head

    [q | k | v] = x W_qkv^T + b_qkv,   S = q k^T / sqrt(d) + Bias + M,   P = softmax(S),
    y = (P v) W_proj^T + b_proj = o W_proj^T + b_proj,

with ``Bias[h, s, t] = table[index[s, t], h]`` (V1) and M the constant shift mask (-100 between tokens from
different regions of the rolled map); V2's scores are ``cos(q, k) * exp(min(logit_scale, log 100)) +
16 sigmoid(T)[index] + M`` with ``T`` its ``cpb_mlp`` on a coordinate table, and the key's third of
``b_qkv`` is zeroed in every call. The output is ``y`` put back in place, rolled by (sh, sw) and cropped.

The gradient at ``y``'s windows is therefore the output gradient dY cut the same way (zero-padded, rolled
by (-sh, -sw)), ``dy``; and example i's gradients are sums over its windows' tokens (Bu et al. 2023, eq. 2):

    dW_proj_i = sum dy (x) o,  db_proj_i = sum dy,  dW_qkv_i = sum d[q|k|v] (x) x,  db_qkv_i = sum d[q|k|v],

in the factored :class:`~dpexp.privacy.per_example.Outer` form, and the table's (or the temperature's and
the MLP's) from the scores' gradient dS summed over the windows
(:func:`~dpexp.privacy.rules.window_attention.table_grads`,
:func:`~dpexp.privacy.rules.window_attention.cosine_bias_grads`). The rule reads ``o``, ``d[q|k|v]`` and dS
off the autograd graph of the call (:func:`swin_graph`: the probabilities and values its backward keeps,
and the output gradients of ``qkv``'s product and of the softmax, which autograd's own backward forms), so
nothing of the attention runs again but ``o = P V``; where the graph lacks that structure it computes the
attention again from the captured input (its padding, roll, windows and mask as the function forms them)
and takes them by one autograd backward through that computation, the weights detached: the attention's
own backward once more, never a per-example one. Before (stop 60) the module ran on the exact fallback,
declared as reading ``qkv`` and ``proj`` (0.57x non-private on the ``torchvision`` suite's Swin, 0.25x for
Swin-T on an H200).

Dropout inside the function (``attention_dropout``, ``dropout``) draws masks the rule cannot replay: refused
in training, with the fix.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dpexp.privacy.per_example import Dense, Outer, PerExampleGrad
from dpexp.privacy.rules import CallLayout, first_output, refuse, register_rule, unknown_parameters
from dpexp.privacy.rules.graph import (
    GraphReads,
    call_nodes,
    kept_by,
    kept_product_below,
    matmul_with,
    product_below,
)
from dpexp.privacy.rules.window_attention import (
    V2_MAX_LOGIT_SCALE,
    cosine_bias_grads,
    cpb_table,
    detached,
    softmax_grad,
    table_grads,
)

_SWIN = "torchvision.models.swin_transformer"
_V1, _V2 = f"{_SWIN}.ShiftedWindowAttention", f"{_SWIN}.ShiftedWindowAttentionV2"
_MASKED = -100.0  # the score shifted_window_attention adds between tokens of different regions


def _is_v2(module: nn.Module) -> bool:
    return hasattr(module, "cpb_mlp")


def _check(module: nn.Module) -> None:
    v2 = _is_v2(module)
    reason = unknown_parameters(module, {"logit_scale"} if v2 else {"relative_position_bias_table"})
    if reason is None and not all(type(getattr(module, n, None)) is nn.Linear for n in ("qkv", "proj")):
        reason = (
            "its qkv and proj are not both nn.Linear, whose weights shifted_window_attention reads (an "
            "adapter around them is never called)"
        )
    mlp = getattr(module, "cpb_mlp", None)
    if reason is None and v2 and [type(m) for m in mlp] != [nn.Linear, nn.ReLU, nn.Linear]:
        reason = "its cpb_mlp is not Sequential(Linear, ReLU, Linear), the network the rule differentiates"
    refuse(module, "shifted-window-attention", "module", reason, "Freeze its parameters, or register a rule.")


def swin_inputs(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple:
    """``(x (B, H, W, C),)``; refuses dropout inside the function in training, whose masks the rule cannot
    replay."""
    x = kwargs.get("x", args[0] if args else None)
    if module.training and (module.attention_dropout > 0 or module.dropout > 0):
        raise ValueError(
            f"applies dropout inside shifted_window_attention in training (attention_dropout="
            f"{module.attention_dropout}, dropout={module.dropout}), whose masks the per-example gradient "
            "rule cannot replay; build the model with attention_dropout=0.0 and dropout=0.0"
        )
    if x.dim() != 4:
        raise ValueError(f"got an input of shape {tuple(x.shape)}; the rule needs (B, H, W, C)")
    return (x,)


def _geometry(module: nn.Module, height: int, width: int) -> tuple[int, int, list[int]]:
    """``(padded H, padded W, shift)`` as ``shifted_window_attention`` forms them: no shift along an axis
    that one window covers."""
    wh, ww = module.window_size
    padded = height + (wh - height % wh) % wh, width + (ww - width % ww) % ww
    shift = [0 if w >= p else s for w, p, s in zip((wh, ww), padded, module.shift_size, strict=True)]
    return padded[0], padded[1], shift


def _windows(module: nn.Module, t: torch.Tensor) -> torch.Tensor:
    """(B, H, W, C) -> (B*nW, Wh*Ww, C): padded with zeros, rolled by the negative shift, cut into windows
    (example-major), as the function treats its input, and so also the gradient at its output's windows."""
    batch, height, width, channels = t.shape
    wh, ww = module.window_size
    padded_h, padded_w, shift = _geometry(module, height, width)
    t = F.pad(t, (0, 0, 0, padded_w - width, 0, padded_h - height))
    if sum(shift) > 0:
        t = torch.roll(t, shifts=(-shift[0], -shift[1]), dims=(1, 2))
    t = t.view(batch, padded_h // wh, wh, padded_w // ww, ww, channels).permute(0, 1, 3, 2, 4, 5)
    return t.reshape(-1, wh * ww, channels)


def _shift_mask(module: nn.Module, height: int, width: int, like: torch.Tensor) -> torch.Tensor | None:
    """(nW, N, N): ``_MASKED`` between tokens of one window that come from different regions of the rolled
    map, 0 elsewhere; None without a shift."""
    wh, ww = module.window_size
    padded_h, padded_w, shift = _geometry(module, height, width)
    if sum(shift) == 0:
        return None
    region = like.new_zeros((padded_h, padded_w))
    rows = ((0, -wh), (-wh, -shift[0]), (-shift[0], None))
    cols = ((0, -ww), (-ww, -shift[1]), (-shift[1], None))
    for count, ((r0, r1), (c0, c1)) in enumerate((r, c) for r in rows for c in cols):
        region[r0:r1, c0:c1] = count
    region = region.view(padded_h // wh, wh, padded_w // ww, ww).permute(0, 2, 1, 3).reshape(-1, wh * ww)
    return (region.unsqueeze(1) != region.unsqueeze(2)).to(like.dtype) * _MASKED


def _bias(module: nn.Module, n: int, dtype: torch.dtype) -> torch.Tensor:
    """(heads, N, N): V1's ``table[index]``, V2's ``16 sigmoid(T[index])`` with T its ``cpb_mlp`` on the
    coordinate table; parameters detached."""
    if not _is_v2(module):
        table = module.relative_position_bias_table.detach().to(dtype)
    else:
        table = cpb_table(module.cpb_mlp[0], module.cpb_mlp[2], module.relative_coords_table, dtype)[-1]
    bias = table[module.relative_position_index].view(n, n, -1).permute(2, 0, 1)
    return 16 * bias.sigmoid() if _is_v2(module) else bias


def _claims(module: nn.Module) -> tuple[str, ...]:
    return ("qkv", "proj", "cpb_mlp.0", "cpb_mlp.2") if _is_v2(module) else ("qkv", "proj")


def swin_graph(
    module: nn.Module, call: tuple, output: torch.Tensor, boundary: list[torch.Tensor]
) -> GraphReads | None:
    """What the rule would recompute, read off the call's autograd graph
    (:mod:`dpexp.privacy.rules.graph`): the probabilities P kept by the one softmax, the values V kept by the
    ``bmm`` whose output passes through views and a copy to ``proj``'s matrix product (and whose other
    matrix *is* P), in V2 the unit queries and keys kept by the ``bmm`` below the softmax; and the output
    gradients of ``qkv``'s matrix product, ``d[q|k|v]``, and of the softmax, ``dP``, which autograd's own
    backward forms. None where the graph lacks that structure (inputs that need no gradient, autocast's
    weight copies, dropout's masks): the rule then recomputes."""
    nodes = call_nodes(output, boundary)
    if nodes is None:
        return None
    mixed, projected = matmul_with(nodes, module.qkv.weight), matmul_with(nodes, module.proj.weight)
    softmax = kept_by(nodes, "SoftmaxBackward0", "_saved_result")
    kept = None if projected is None else kept_product_below(projected, nodes)
    if mixed is None or softmax is None or kept is None or kept[0].data_ptr() != softmax[1].data_ptr():
        return None
    values = {"probs": softmax[1], "values": kept[1]}
    if _is_v2(module):
        units = product_below(softmax[0], nodes)
        if units is None:
            return None
        values.update(queries=units[0], keys=units[1])
    return GraphReads(values, {"d_mixed": mixed, "d_probs": softmax[0]})


def _read(
    reads: dict[str, torch.Tensor], rows: int, n: int, channels: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(o, d[q|k|v], dS, cos)`` from :func:`swin_graph`'s reads: ``o = P V`` (one product), ``dS = P * (dP
    - rowsum(P * dP))`` (the softmax's backward), V2's ``cos`` the unit queries' product with the keys."""
    probs = reads["probs"].to(dtype)
    heads = probs.shape[1]
    if probs.shape != (rows, heads, n, n) or reads["d_mixed"].numel() != rows * n * 3 * channels:
        raise RuntimeError("the graph's probabilities or projections do not match the call's windows")
    values = reads["values"].to(dtype).view(rows, heads, n, -1)
    o = (probs @ values).transpose(1, 2).reshape(rows, n, channels)
    d_probs = reads["d_probs"].to(dtype).view(probs.shape)
    d_scores = softmax_grad(probs, d_probs)
    cos = None
    if "queries" in reads:
        cos = (reads["queries"].to(dtype) @ reads["keys"].to(dtype)).view(probs.shape)
    return o, reads["d_mixed"].to(dtype).view(rows, n, 3 * channels), d_scores, cos


def _recomputed(
    module: nn.Module, tokens: torch.Tensor, d_y: torch.Tensor, mask: torch.Tensor | None, batch: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(o, d[q|k|v], dS, cos)`` by computing the attention again from the windowed tokens (rows, N, C)
    and one autograd backward of ``<o, d_y W_proj>`` to ``[q|k|v]`` and to a zero added to the scores."""
    rows, n, channels = tokens.shape
    heads, dtype, v2 = module.num_heads, tokens.dtype, _is_v2(module)
    b_qkv = detached(module.qkv.bias, dtype)
    if v2 and b_qkv is not None:
        b_qkv = b_qkv.clone()
        b_qkv[channels : 2 * channels] = 0  # as the function does: the keys have no bias in V2
    cos = None
    with torch.enable_grad():
        mixed = F.linear(tokens, detached(module.qkv.weight, dtype), b_qkv).requires_grad_()  # a leaf
        zero = torch.zeros((rows, heads, n, n), dtype=dtype, device=tokens.device, requires_grad=True)
        q, k, v = mixed.view(rows, n, 3, heads, -1).permute(2, 0, 3, 1, 4)
        if v2:
            cos = F.normalize(q, dim=-1) @ F.normalize(k, dim=-1).transpose(-2, -1)
            scores = cos * detached(module.logit_scale, dtype).clamp(max=V2_MAX_LOGIT_SCALE).exp()
        else:
            scores = (q * (channels // heads) ** -0.5) @ k.transpose(-2, -1)
        scores = scores + _bias(module, n, dtype) + zero
        if mask is not None:
            scores = (scores.view(batch, -1, heads, n, n) + mask[None, :, None]).view(rows, heads, n, n)
        o = (scores.softmax(-1) @ v).transpose(1, 2).reshape(rows, n, channels)
        d_mixed, d_scores = torch.autograd.grad(o, (mixed, zero), d_y @ detached(module.proj.weight, dtype))
    return o.detach(), d_mixed, d_scores, None if cos is None else cos.detach()


@register_rule(
    _V1, _V2, check=_check, call=CallLayout(swin_inputs, first_output, graph=swin_graph), claims=_claims
)
def shifted_window_grads(module: nn.Module, call: tuple, dy: torch.Tensor) -> dict[str, PerExampleGrad]:
    """``call[0]``: the input X (B, H, W, C), the batch in dim 0 (the probe establishes it), and where the
    call's graph gave them (:func:`swin_graph`) ``call[1]`` its reads; ``dy`` (B, H, W, C) the output
    gradient. Computed in float64 for a float64 model, else in float32; exact to that rounding (the engine's
    verification compares the sums with autograd's)."""
    x = call[0]
    batch, height, width, channels = x.shape
    v2 = _is_v2(module)
    dtype = torch.float64 if module.qkv.weight.dtype == torch.float64 else torch.float32
    tokens = _windows(module, x.detach().to(dtype))  # (B*nW, N, C)
    d_y = _windows(module, dy.to(dtype))  # the gradient at the projection's output, same rows
    rows, n = tokens.shape[:2]
    windows = rows // batch
    if len(call) > 1:
        o, d_mixed, d_scores, cos = _read(call[1], rows, n, channels, dtype)
    else:
        o, d_mixed, d_scores, cos = _recomputed(
            module, tokens, d_y, _shift_mask(module, height, width, tokens), batch
        )
    per_example = (batch, windows * n)
    d_mixed, d_y = d_mixed.reshape(*per_example, -1), d_y.reshape(*per_example, -1)
    qkv, proj = module.qkv, module.proj
    grads: dict[str, PerExampleGrad] = {
        "qkv.weight": Outer(d_mixed, tokens.reshape(*per_example, -1), qkv.weight.shape, 3 * channels),
        "proj.weight": Outer(d_y, o.reshape(*per_example, -1), proj.weight.shape, channels),
    }
    if qkv.bias is not None:
        d_bias = d_mixed.sum(1)
        if v2:
            d_bias[:, channels : 2 * channels] = 0
        grads["qkv.bias"] = Dense(d_bias)
    if proj.bias is not None:
        grads["proj.bias"] = Dense(d_y.sum(1))
    d_scores = d_scores.reshape(batch, windows, -1, n, n)
    index = module.relative_position_index
    if not v2:
        table = module.relative_position_bias_table
        return {**grads, "relative_position_bias_table": Dense(table_grads(d_scores, index, table))}
    for name, grad in cosine_bias_grads(
        d_scores, cos.reshape(d_scores.shape), module.logit_scale, module.cpb_mlp[0], module.cpb_mlp[2],
        module.relative_coords_table, index,
    ).items():  # fmt: skip
        grads[name if name == "logit_scale" else f"cpb_mlp.{name}"] = Dense(grad)
    return grads
