"""Swin's window attention (Liu et al. 2021, Swin Transformer, sec. 3.2, eq. 4): timm's ``WindowAttention``
and Hugging Face's ``SwinAttention``.

Every window of N = Wh*Ww tokens attends within itself with scores ``softmax(Q K^T / sqrt(d) + Bias + M)``,
where ``Bias[h, s, t] = table[index[s, t], h]``: the layer's own ``relative_position_bias_table``
((2Wh-1)(2Ww-1), heads), read through a fixed buffer ``relative_position_index`` (N, N) and added to every
window's scores (broadcast over the windows of all examples), and M the constant shifted-window mask. The
Q, K, V and output projections are ``nn.Linear`` submodules with their own (position-wise) rules.

The rule taps the module's ``softmax`` (timm's unfused path): its input is the scores S (B*nW, heads, N, N),
windows of example i in rows [i*nW, (i+1)*nW) (window partition is example-major; the engine's probe
establishes this, and the rule is position-wise so the rows are folded to (B, nW, heads, N, N) only then),
and ``dS = dL/dS``. Since S is linear in Bias with coefficient 1,

    d table_i[r, h] = sum_{w, (s, t): index[s, t] = r} dS_i[w, h, s, t],

a sum over example i's windows and a scatter-add over the index: exact (a few additions per entry). Without
the rule the module was refused: the fallback recomputes a module per example, and the windows fold the batch
into dim 0. timm's fused path (``fused_attn``, scaled_dot_product_attention) forms the scores inside one
kernel, with no point at which their gradient can be read; it is refused (``TIMM_FUSED_ATTN=0``, the default
for this experimental path, or ``fused_attn = False``).

Hugging Face's ``SwinAttention`` (transformers 5) forms the same scores inside its attention function (eager:
a functional softmax; sdpa: one kernel), with the table in a ``SwinRelativePositionBias`` submodule called
without inputs: no module sees the scores, so its rule (:func:`hf_swin_bias_grads`) recomputes each window's
probabilities from the captured input and takes ``dS`` by the softmax's backward; see there.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

from dpexp.privacy.per_example import Dense, PerExampleGrad
from dpexp.privacy.rules import CallLayout, refuse, register_rule


def _check(module: nn.Module) -> None:
    own = {name for name, p in module.named_parameters(recurse=False) if p.requires_grad}
    reason = None
    if own - {"relative_position_bias_table"}:
        reason = f"it owns parameters {sorted(own - {'relative_position_bias_table'})} the rule does not know"
    elif getattr(module, "fused_attn", False):
        reason = (
            "fused_attn=True computes the attention scores inside scaled_dot_product_attention, where the "
            "gradient of the relative position bias cannot be read per example; set TIMM_FUSED_ATTN=0 or "
            "module.fused_attn = False"
        )
    elif not isinstance(getattr(module, "softmax", None), nn.Softmax):
        reason = "it has no softmax module whose input is the attention scores"
    refuse(
        module,
        "relative-position-bias",
        "module",
        reason,
        "Otherwise freeze relative_position_bias_table (requires_grad=False).",
    )


@register_rule(
    "timm.models.swin_transformer.WindowAttention", check=_check, tap="softmax", position_wise=True
)
def relative_position_bias_grads(
    module: nn.Module, scores: torch.Tensor, ds: torch.Tensor
) -> dict[str, PerExampleGrad]:
    """``ds``: (B, nW, heads, N, N), the gradient at the softmax's input folded per example (or
    (B, heads, N, N) with one window per example); returns ``d table`` (B, (2Wh-1)(2Ww-1), heads)."""
    grad = _table_grads(ds, module.relative_position_index, module.relative_position_bias_table)
    return {"relative_position_bias_table": Dense(grad)}


def _table_grads(ds: torch.Tensor, index: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """``ds`` (B, ..., heads, N, N): the scores' gradient of every window of every example; ``index``: the
    (N, N) (or flat) relative position of every pair of tokens; returns ``d table`` (B, *table.shape), the
    sum over an example's windows and over the pairs of each relative position."""
    batch, heads, n = ds.shape[0], ds.shape[-3], ds.shape[-1]
    per_pair = ds.reshape(batch, -1, heads, n * n).sum(1).transpose(1, 2)  # (B, N*N, heads)
    index = index.reshape(1, n * n, 1).expand(batch, n * n, heads)
    grad = torch.zeros((batch, *table.shape), dtype=ds.dtype, device=ds.device)
    return grad.scatter_add_(1, index, per_pair)


# Hugging Face Swin (transformers >= 5): ``SwinAttention`` owns q/k/v/o projections and a
# ``SwinRelativePositionBias`` module (the table), called without inputs for the (1, heads, N, N) bias.
_HF_SWIN = "transformers.models.swin.modeling_swin.SwinAttention"
_HF_TABLE = "relative_position_bias.relative_position_bias_table"
_HF_IMPLEMENTATIONS = ("eager", "sdpa")  # the attention functions whose probabilities the rule recomputes


def _check_hf(module: nn.Module) -> None:
    reason = None
    bias = getattr(module, "relative_position_bias", None)
    if not (
        isinstance(bias, nn.Module)
        and isinstance(getattr(bias, "relative_position_bias_table", None), nn.Parameter)
        and torch.is_tensor(getattr(bias, "relative_position_index", None))
    ):
        reason = "it has no relative_position_bias module with a relative_position_bias_table and index"
    elif type(getattr(module, "o_proj", None)) is not nn.Linear:
        reason = (
            f"its o_proj is a {type(getattr(module, 'o_proj', None)).__name__}, not an nn.Linear, so the "
            "gradient at the attention's output (the rule reads it through o_proj's weight) is not known; "
            "leave o_proj unwrapped (adapters on q_proj/k_proj/v_proj are fine)"
        )
    refuse(
        module,
        "relative-position-bias",
        "module",
        reason,
        "Otherwise freeze relative_position_bias.relative_position_bias_table (requires_grad=False).",
    )


def hf_swin_inputs(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple:
    """``(hidden_states (B*nW, N, C), attention_mask (nW, N, N) or None)``; refuses a call whose attention
    probabilities the rule cannot recompute exactly: another attention implementation than eager or sdpa,
    attention dropout in training (its mask is drawn inside the attention function), and eager attention
    in float64 (its softmax runs in float32)."""
    call = inspect.signature(module.forward).bind(*args, **kwargs)
    hidden, mask = call.arguments["hidden_states"], call.arguments.get("attention_mask")
    implementation = getattr(module.config, "_attn_implementation", None)
    if implementation not in _HF_IMPLEMENTATIONS:
        raise ValueError(
            f"attention implementation {implementation!r}: the relative-position-bias rule recomputes the "
            "attention probabilities softmax(QK^T * scaling + bias + mask) of the 'eager' and 'sdpa' "
            "implementations only; load the model with attn_implementation='sdpa' (or 'eager'), or freeze "
            "the relative_position_bias_table"
        )
    if module.training and module.attention_dropout > 0:
        raise ValueError(
            f"applies attention dropout (p={module.attention_dropout}) inside the attention function in "
            "training, whose mask the rule cannot see; set attention_probs_dropout_prob=0 (or "
            "module.attention_dropout = 0), or freeze the relative_position_bias_table"
        )
    if implementation == "eager" and hidden.dtype == torch.float64:
        raise ValueError(
            "computes its eager softmax in float32, so in a float64 model the per-example gradients cannot "
            "be verified to add up to autograd's to float64 precision; use attn_implementation='sdpa' "
            "(model.set_attn_implementation('sdpa')), or train in float32"
        )
    return hidden, mask


def hf_swin_output_grad(module: nn.Module, grads: list[torch.Tensor | None]) -> torch.Tensor:
    """The gradients of ``attn_output`` (B*nW, N, C) and, where returned (eager), ``attn_weights``
    (B*nW, heads, N, N), flattened and concatenated per row: (B*nW, N*C [+ heads*N*N])."""
    out, *rest = grads
    weights = rest[0] if rest else None
    parts = [out.flatten(1)] + ([] if weights is None else [weights.flatten(1).to(out.dtype)])
    return torch.cat(parts, 1) if len(parts) > 1 else parts[0]


@register_rule(
    _HF_SWIN,
    check=_check_hf,
    call=CallLayout(hf_swin_inputs, hf_swin_output_grad),
    position_wise=True,
    claims=("relative_position_bias",),
)
def hf_swin_bias_grads(
    module: nn.Module, call: tuple[torch.Tensor, torch.Tensor | None], dy: torch.Tensor
) -> dict[str, PerExampleGrad]:
    """Hugging Face Swin's ``SwinAttention``: the scores ``S = Q K^T * scaling + Bias + M`` are formed inside
    the attention function (eager: a functional softmax; sdpa: one kernel), where no module sees them, so the
    rule recomputes the probabilities ``P = softmax(S)`` of every window from the captured input ``X``
    (Q, K, V by calling the module's own projections, Bias by calling its ``relative_position_bias``, M the
    shift mask it was passed) and takes the scores' gradient by the softmax's backward,

        dP = dO V^T (+ d attn_weights),   dS = P * (dP - rowsum(P * dP)),

    with ``dO = dy_out W_o`` the gradient at ``o_proj``'s input (an ``nn.Linear``). Then, as for timm's
    window attention, ``d table_i`` is the sum of ``dS`` over example i's windows, scatter-added over the
    index. ``call[0]`` is (B, nW, N, C) once the probe has established that rows [i*nW, (i+1)*nW) are
    example i's windows (position-wise: one window is one position), or (B, N, C) with one window per
    example; the recomputation runs in float64 for a float64 table, else in float32 (as eager's softmax),
    and is exact to that rounding (the engine's verification compares the sums with autograd's)."""
    hidden, mask = call
    table = module.relative_position_bias.relative_position_bias_table
    batch = dy.shape[0]
    n, channels = hidden.shape[-2:]
    heads, head_dim = module.num_attention_heads, module.head_dim
    x = hidden.reshape(-1, n, channels)
    rows = x.shape[0]
    windows = rows // batch
    dy = dy.reshape(rows, -1)
    dtype = torch.float64 if table.dtype == torch.float64 else torch.float32
    with torch.no_grad():

        def split(t: torch.Tensor) -> torch.Tensor:  # (rows, N, C) -> (rows, heads, N, head_dim)
            return t.reshape(rows, n, heads, head_dim).transpose(1, 2).to(dtype)

        q, k, v = (split(proj(x)) for proj in (module.q_proj, module.k_proj, module.v_proj))
        scores = q @ k.transpose(-2, -1) * module.scaling + module.relative_position_bias().to(dtype)
        if mask is not None:
            if mask.shape[0] != windows:
                raise RuntimeError(
                    f"{type(module).__name__}: a shift mask for {mask.shape[0]} windows, but {windows} "
                    "windows per example; register a rule for this attention."
                )
            scores = (scores.unflatten(0, (batch, windows)) + mask.to(dtype)[None, :, None]).flatten(0, 1)
        probs = scores.softmax(-1)
        d_out = dy[:, : n * channels].reshape(rows, n, channels).to(dtype)
        d_probs = split(d_out @ module.o_proj.weight.to(dtype)) @ v.transpose(-2, -1)
        if dy.shape[1] > n * channels:  # eager's attn_weights reached the loss
            d_probs = d_probs + dy[:, n * channels :].reshape(rows, heads, n, n).to(dtype)
        d_scores = probs * (d_probs - (probs * d_probs).sum(-1, keepdim=True))
    index = module.relative_position_bias.relative_position_index
    grad = _table_grads(d_scores.reshape(batch, windows, heads, n, n), index, table)
    return {_HF_TABLE: Dense(grad.to(table.dtype))}
