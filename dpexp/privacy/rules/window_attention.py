"""Swin's window attention (Liu et al. 2021, Swin Transformer, sec. 3.2, eq. 4): timm's ``WindowAttention``
and Hugging Face's ``SwinAttention``; and Swin V2's scaled cosine attention with its continuous position
bias (Liu et al. 2022, Swin Transformer V2, sec. 3.2-3.3, eqs. 2-4): Hugging Face's ``Swinv2SelfAttention``.

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

Hugging Face's older ``SwinSelfAttention`` form, kept by Donut-Swin, MaskFormer-Swin and CLAP's audio encoder,
owns the table itself and returns the heads' output before the projection: its rule
(:func:`swin_self_attention_grads`) reads the probabilities from the module's own forward.

Hugging Face's ``SwinAttention`` (transformers 5) forms the same scores inside its attention function (eager:
a functional softmax; sdpa: one kernel), with the table in a ``SwinRelativePositionBias`` submodule called
without inputs: no module sees the scores, so its rule (:func:`hf_swin_bias_grads`) recomputes each window's
probabilities from the captured input and takes ``dS`` by the softmax's backward; see there. Swin V2's
``Swinv2SelfAttention`` scales cosine similarities by a learnt per-head temperature (``logit_scale``) and
adds a bias computed by a small MLP from a coordinate buffer shared by all examples: both meet the batch in
the scores, so its rule (:func:`hf_swinv2_grads`) takes ``dS`` the same way and carries it back through the
temperature and the MLP per example.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from dpexp.privacy.per_example import Dense, PerExampleGrad
from dpexp.privacy.rules import CallLayout, forward_arguments, refuse, register_rule
from dpexp.privacy.rules.submodule_values import once


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
    grad = table_grads(ds, module.relative_position_index, module.relative_position_bias_table)
    return {"relative_position_bias_table": Dense(grad)}


def table_grads(ds: torch.Tensor, index: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """``ds`` (B, ..., heads, N, N): the scores' gradient of every window of every example; ``index``: the
    (N, N) (or flat) relative position of every pair of tokens; returns ``d table`` (B, *table.shape), the
    sum over an example's windows and over the pairs of each relative position."""
    batch, heads, n = ds.shape[0], ds.shape[-3], ds.shape[-1]
    per_pair = ds.reshape(batch, -1, heads, n * n).sum(1).transpose(1, 2)  # (B, N*N, heads)
    index = index.reshape(1, n * n, 1).expand(batch, n * n, heads)
    grad = torch.zeros((batch, *table.shape), dtype=ds.dtype, device=ds.device)
    return grad.scatter_add_(1, index, per_pair)


def window_rows(hidden: torch.Tensor, dy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``(x, dy, nW)``: a window attention's captured input, (B, nW, N, C) once folded per example or (B, N,
    C), as one window per row (B*nW, N, C), its output gradient (B, ...) as (B*nW, F), and the windows per
    example."""
    x = hidden.reshape(-1, *hidden.shape[-2:])
    return x, dy.reshape(x.shape[0], -1), x.shape[0] // dy.shape[0]


def scores_grad(
    probs: torch.Tensor, v: torch.Tensor, d_heads: torch.Tensor, d_returned: torch.Tensor
) -> torch.Tensor:
    """The scores' gradient by the softmax's backward, ``dS = P * (dP - rowsum(P * dP))``, for probabilities
    ``P`` and values ``V`` (rows, heads, N, N / head_dim), the gradient ``d_heads`` at the attention's output
    per head (rows, heads, N, head_dim): ``dP = dO V^T``, plus ``d_returned`` (rows, heads*N*N), the
    gradient of the probabilities where the attention returned them into the loss (rows, 0) otherwise."""
    d_probs = d_heads @ v.transpose(-2, -1)
    if d_returned.shape[1]:
        d_probs = d_probs + d_returned.reshape(d_probs.shape).to(d_probs.dtype)
    return softmax_grad(probs, d_probs)


def softmax_grad(probs: torch.Tensor, d_probs: torch.Tensor) -> torch.Tensor:
    """The softmax's backward over the last dimension: ``dS = P * (dP - rowsum(P * dP))``, any shape."""
    return probs * (d_probs - (probs * d_probs).sum(-1, keepdim=True))


# Hugging Face Swin (transformers >= 5): ``SwinAttention`` owns q/k/v/o projections and a
# ``SwinRelativePositionBias`` module (the table), called without inputs for the (1, heads, N, N) bias.
_HF_SWIN = "transformers.models.swin.modeling_swin.SwinAttention"
_HF_TABLE = "relative_position_bias.relative_position_bias_table"
_HF_IMPLEMENTATIONS = ("eager", "sdpa")  # the attention functions whose probabilities the rule recomputes


def wrapped_o_proj(module: nn.Module) -> str | None:
    """Why a rule that reads the attention's output gradient through ``o_proj``'s weight cannot run on
    ``module``, or None where ``o_proj`` is a plain ``nn.Linear``."""
    if type(getattr(module, "o_proj", None)) is nn.Linear:
        return None
    return (
        f"its o_proj is a {type(getattr(module, 'o_proj', None)).__name__}, not an nn.Linear, so the "
        "gradient at the attention's output (the rule reads it through o_proj's weight) is not known; "
        "leave o_proj unwrapped (adapters on q_proj/k_proj/v_proj are fine)"
    )


def through_o_proj(
    module: nn.Module, dy: torch.Tensor, length: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """``dy`` in :func:`attention_output_grad`'s layout split into the gradient at ``o_proj``'s input,
    ``dO W_o`` (rows, length, heads * head_dim) in ``dtype``, and the rest of each row (the returned
    probabilities' gradient, if any). ``o_proj`` is a plain ``nn.Linear`` (:func:`wrapped_o_proj`)."""
    width = length * module.o_proj.out_features
    d_out = dy[:, :width].reshape(dy.shape[0], length, -1).to(dtype)
    return d_out @ module.o_proj.weight.to(dtype), dy[:, width:]


def _check_hf(module: nn.Module) -> None:
    reason = None
    bias = getattr(module, "relative_position_bias", None)
    if not (
        isinstance(bias, nn.Module)
        and isinstance(getattr(bias, "relative_position_bias_table", None), nn.Parameter)
        and torch.is_tensor(getattr(bias, "relative_position_index", None))
    ):
        reason = "it has no relative_position_bias module with a relative_position_bias_table and index"
    else:
        reason = wrapped_o_proj(module)
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
    call = forward_arguments(module, args, kwargs)
    hidden, mask = call["hidden_states"], call.get("attention_mask")
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


def attention_output_grad(module: nn.Module, grads: list[torch.Tensor | None]) -> torch.Tensor:
    """The gradients of an attention's output (rows, N, C) and, where returned (Swin's eager
    ``attn_weights``, Swin V2's ``output_attentions``, GPT-OSS's eager probabilities), of its probabilities
    (rows, heads, N, S), flattened and concatenated per row: (rows, N*C [+ heads*N*S]). A window attention's
    rows are its B*nW windows, a full attention's its B examples."""
    out, *rest = grads
    weights = rest[0] if rest else None
    parts = [out.flatten(1)] + ([] if weights is None else [weights.flatten(1).to(out.dtype)])
    return torch.cat(parts, 1) if len(parts) > 1 else parts[0]


@register_rule(
    _HF_SWIN,
    check=_check_hf,
    call=CallLayout(hf_swin_inputs, attention_output_grad),
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
    heads, head_dim = module.num_attention_heads, module.head_dim
    x, dy, windows = window_rows(hidden, dy)
    rows, n = x.shape[:2]
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
        d_heads, d_probs = through_o_proj(module, dy, n, dtype)
        d_scores = scores_grad(probs, v, split(d_heads), d_probs)
    index = module.relative_position_bias.relative_position_index
    grad = table_grads(d_scores.reshape(batch, windows, heads, n, n), index, table)
    return {_HF_TABLE: Dense(grad.to(table.dtype))}


# Hugging Face Swin V2: ``Swinv2SelfAttention`` owns ``logit_scale`` (heads, 1, 1), a
# ``continuous_position_bias_mlp`` Sequential(Linear(2, 512), ReLU, Linear(512, heads)) run on the buffer
# ``relative_coords_table``, and query/key/value ``nn.Linear`` submodules (with their own rules).
_HF_SWINV2 = "transformers.models.swinv2.modeling_swinv2.Swinv2SelfAttention"
_V2_MLP = "continuous_position_bias_mlp"
V2_MAX_LOGIT_SCALE = math.log(1.0 / 0.01)  # the clamp of the temperature (Swin V2, sec. 3.2: tau > 0.01)


def _check_hf_v2(module: nn.Module) -> None:
    mlp = getattr(module, _V2_MLP, None)
    layers = [type(layer) for layer in mlp] if isinstance(mlp, nn.Sequential) else None
    reason = None
    if layers != [nn.Linear, nn.ReLU, nn.Linear]:
        reason = f"its {_V2_MLP} is not Sequential(Linear, ReLU, Linear), the network the rule differentiates"
    elif not isinstance(getattr(module, "logit_scale", None), nn.Parameter):
        reason = "it has no logit_scale parameter"
    elif not all(
        torch.is_tensor(getattr(module, b, None))
        for b in ("relative_coords_table", "relative_position_index")
    ):
        reason = "it has no relative_coords_table and relative_position_index buffers"
    elif not all(type(getattr(module, name, None)) is nn.Linear for name in ("query", "key", "value")):
        reason = (
            "its query, key and value are not all nn.Linear, whose outputs the rule reads; leave them "
            "unwrapped"
        )
    elif not isinstance(getattr(module, "dropout", None), nn.Dropout):
        reason = "it has no attention dropout module, where the rule reads the probabilities"
    refuse(
        module,
        "scaled-cosine-attention",
        "module",
        reason,
        f"Otherwise freeze logit_scale and {_V2_MLP} (requires_grad=False).",
    )


def hf_swinv2_inputs(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple:
    """``(hidden_states (B*nW, N, C),)``, the capture appending the kept values; refuses attention dropout
    in training, whose mask the rule does not apply."""
    call = forward_arguments(module, args, kwargs)
    if module.training and module.dropout.p > 0:
        raise ValueError(
            f"applies attention dropout (p={module.dropout.p}) to its probabilities in training, whose mask "
            "the rule does not apply; set attention_probs_dropout_prob=0, or freeze logit_scale and "
            f"{_V2_MLP}"
        )
    return (call["hidden_states"],)


@register_rule(
    _HF_SWINV2,
    check=_check_hf_v2,
    call=CallLayout(hf_swinv2_inputs, attention_output_grad, keeps=lambda _: _KEEP_V2),
    position_wise=True,
    claims=(f"{_V2_MLP}.0", f"{_V2_MLP}.2"),
)
def hf_swinv2_grads(
    module: nn.Module, call: tuple[torch.Tensor, dict], dy: torch.Tensor
) -> dict[str, PerExampleGrad]:
    """Hugging Face Swin V2's ``Swinv2SelfAttention``. Per window and head the scores are (Swin V2, eq. 2-3)

        S = cos(Q, K) * exp(min(logit_scale, log 100)) + 16 sigmoid(T)[index] + M,   T = W2 relu(W1 c + b1),

    with ``c`` the (log-spaced, eq. 4) relative coordinates of the buffer ``relative_coords_table`` (one row
    per relative position r), ``T`` (r, heads) the MLP's table and M the shift mask. The rule keeps the
    probabilities P and Q, K, V from the module's training call (:func:`kept_probabilities`: how it adds
    the mask is its own, and nothing runs again) and takes the scores' gradient by the softmax's backward,
    ``dS = P * (dP - rowsum(P * dP))``, ``dP = dO V^T`` (+ the gradient of the returned probabilities);
    then the temperature's and the MLP's per-example gradients by :func:`cosine_bias_grads` (dense:
    (B, heads, 512) and (B, 512, 2) values). ``call[0]`` is
    (B, nW, N, C) once the probe has established the windows per example (position-wise, as
    :func:`hf_swin_bias_grads`), or (B, N, C); computed in float64 for a float64 model, else in float32,
    exact to that rounding."""
    hidden, kept = call
    batch = dy.shape[0]
    heads = module.num_attention_heads
    x, dy, windows = window_rows(hidden, dy)
    rows, n, channels = x.shape
    dtype = torch.float64 if module.logit_scale.dtype == torch.float64 else torch.float32
    seen = kept_probabilities(module, kept, _KEEP_V2, f"freeze logit_scale and {_V2_MLP}")
    first, second = module.get_submodule(f"{_V2_MLP}.0"), module.get_submodule(f"{_V2_MLP}.2")
    with torch.no_grad():

        def split(t: torch.Tensor) -> torch.Tensor:  # (rows, N, C) -> (rows, heads, N, head_dim)
            return t.reshape(rows, n, heads, -1).transpose(1, 2).to(dtype)

        probs = seen["probs"].to(dtype)
        q, k, v = (split(seen[name]) for name in ("query", "key", "value"))
        cos = nn.functional.normalize(q, dim=-1) @ nn.functional.normalize(k, dim=-1).transpose(-2, -1)
        d_out = dy[:, : n * channels].reshape(rows, n, channels).to(dtype)
        d_scores = scores_grad(probs, v, split(d_out), dy[:, n * channels :])
        cos = cos.reshape(batch, windows, heads, n, n)
        d_scores = d_scores.reshape(batch, windows, heads, n, n)
        grads = {
            name if name == "logit_scale" else f"{_V2_MLP}.{name}": grad
            for name, grad in cosine_bias_grads(
                d_scores, cos, module.logit_scale, first, second, module.relative_coords_table,
                module.relative_position_index,
            ).items()
        }  # fmt: skip
    return {name: Dense(g.to(module.get_parameter(name).dtype)) for name, g in grads.items()}


def cosine_bias_grads(
    d_scores: torch.Tensor,
    cos: torch.Tensor,
    logit_scale: torch.Tensor,
    first: nn.Linear,
    second: nn.Linear,
    coords: torch.Tensor,
    index: torch.Tensor,
) -> dict[str, torch.Tensor]:
    """Swin V2's temperature and continuous position bias (Liu et al. 2022, sec. 3.2-3.3, eqs. 2-4): with
    the scores ``S = cos * exp(min(logit_scale, log 100)) + 16 sigmoid(T)[index] + M`` and ``T = W2 relu(W1 c
    + b1)`` (``first``, ``second``) on the relative coordinates ``coords`` (one row of 2 per relative
    position r), and ``d_scores``, ``cos`` (B, nW, heads, N, N) the scores' gradient and the cosines of every
    window of every example, the per-example gradients summed over example i's windows:

        d logit_scale_i[h] = sum dS_i[h] * cos[h] * exp(logit_scale_h)   (0 where the clamp is active),
        dT_i[r, h] = sum_{(s, t): index[s, t] = r} dS_i[h, s, t] * 16 sigmoid'(T[r, h]),

    and the MLP's by its backward with ``dT_i``, the first layer's as ``dW1_i[k] = sum_h W2[h, k] sum_r
    dT_i[r, h] 1[pre_rk > 0] [c_r | 1]``: a product over r per head, never the (B, r, 512) hidden gradient.
    Keys ``logit_scale`` (B, *logit_scale.shape), ``0.weight``, ``0.bias``, ``2.weight``, ``2.bias`` (the
    MLP's layers; a bias only where its layer has one), computed in ``d_scores``' dtype."""
    batch, heads, dtype = d_scores.shape[0], d_scores.shape[2], d_scores.dtype
    log_scale = logit_scale.to(dtype).reshape(heads)
    scale = log_scale.clamp(max=V2_MAX_LOGIT_SCALE).exp() * (log_scale <= V2_MAX_LOGIT_SCALE)
    d_log_scale = (d_scores * cos).sum((1, 3, 4)) * scale  # (B, heads)
    coords, pre, hid, table = cpb_table(first, second, coords, dtype)
    sig = table.sigmoid()
    d_table = table_grads(d_scores, index, sig)  # (B, r, heads)
    d_table = d_table * (16 * sig * (1 - sig))
    inputs = torch.cat([coords, coords.new_ones(coords.shape[0], 1)], 1)  # (r, 3): [c_r | 1]
    gated = ((pre > 0).to(dtype).unsqueeze(-1) * inputs.unsqueeze(1)).flatten(1)  # (r, 512 * 3)
    per_head = (d_table.transpose(1, 2) @ gated).unflatten(-1, (pre.shape[1], -1))  # (B, heads, 512, 3)
    d_first = torch.einsum("bhkj,hk->bkj", per_head, second.weight.to(dtype))  # (B, 512, 3)
    grads = {
        "logit_scale": d_log_scale.reshape(batch, *logit_scale.shape),
        "2.weight": torch.einsum("brh,rk->bhk", d_table, hid),
        "0.weight": d_first[..., :-1],
    }
    if first.bias is not None:
        grads["0.bias"] = d_first[..., -1]
    if second.bias is not None:
        grads["2.bias"] = d_table.sum(1)
    return grads


def cpb_table(
    first: nn.Linear, second: nn.Linear, coords: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Swin V2's continuous position bias network on the relative coordinates (sec. 3.3): ``(c, pre, hid,
    T)`` with ``c`` (r, 2) the coordinates, ``pre = W1 c + b1`` and ``hid = relu(pre)`` (r, hidden), and
    ``T = W2 hid + b2`` (r, heads), parameters detached, in ``dtype``."""
    coords = coords.reshape(-1, first.in_features).to(dtype)
    pre = nn.functional.linear(coords, detached(first.weight, dtype), detached(first.bias, dtype))
    hid = pre.relu()
    table = nn.functional.linear(hid, detached(second.weight, dtype), detached(second.bias, dtype))
    return coords, pre, hid, table


def kept_probabilities(
    module: nn.Module, kept: dict, keeps: dict[str, tuple[str, str]], otherwise: str
) -> dict:
    """The values a self-attention rule keeps from the module's training call (``keeps``, CallLayout's):
    ``"probs"``, the probabilities (rows, heads, N, N) as they enter the attention dropout (refused in
    training, so they are the ones applied), and its projections' outputs (rows, N, C). Autograd keeps the
    same tensors for its own backward, so nothing is computed again or held longer. ``otherwise``: the
    user's fix besides a rule."""
    seen = once(module, kept, keeps, f"register a rule for this attention, or {otherwise}")
    return {**seen, "probs": seen["probs"][0]}


_KEEP_V2 = {"probs": ("dropout", "input"), **{name: (name, "output") for name in ("query", "key", "value")}}
_KEEP_V1 = {"probs": ("dropout", "input"), "value": ("value", "output")}


# Hugging Face's older form of Swin's attention, kept by Donut-Swin, MaskFormer-Swin and CLAP's audio encoder
# (HTS-AT): ``DonutSwinSelfAttention`` owns the table and its index itself, with query, key and value
# ``nn.Linear`` submodules and an eager softmax in the model's dtype, and returns the heads' concatenated
# output (B*nW, N, C) (and the probabilities when asked); the output projection is the next module's.
_SELF_ATTENTIONS = tuple(
    f"transformers.models.{path}SelfAttention"
    for path in ("donut.modeling_donut_swin.DonutSwin", "maskformer.modeling_maskformer_swin.MaskFormerSwin",
                 "clap.modeling_clap.ClapAudio")
)  # fmt: skip
_TABLE = "relative_position_bias_table"


def _check_self_attention(module: nn.Module) -> None:
    own = {name for name, p in module.named_parameters(recurse=False) if p.requires_grad}
    reason = None
    if own - {_TABLE}:
        reason = f"it owns parameters {sorted(own - {_TABLE})} the rule does not know"
    elif not torch.is_tensor(getattr(module, "relative_position_index", None)):
        reason = "it has no relative_position_index buffer"
    elif not all(type(getattr(module, name, None)) is nn.Linear for name in ("query", "key", "value")):
        reason = "its query, key and value are not all nn.Linear, whose values it reads; leave them unwrapped"
    elif not isinstance(getattr(module, "dropout", None), nn.Dropout):
        reason = "it has no attention dropout module, where the rule reads the probabilities"
    refuse(
        module,
        "relative-position-bias",
        "module",
        reason,
        f"Otherwise freeze {_TABLE} (requires_grad=False).",
    )


def swin_self_attention_inputs(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple:
    """``(hidden_states (B*nW, N, C),)``, the capture appending the kept values; refuses attention dropout
    in training, whose mask the rule does not apply."""
    call = forward_arguments(module, args, kwargs)
    if module.training and module.dropout.p > 0:
        raise ValueError(
            f"applies attention dropout (p={module.dropout.p}) to its probabilities in training, whose mask "
            f"the rule does not apply; set attention_probs_dropout_prob=0, or freeze {_TABLE}"
        )
    return (call["hidden_states"],)


@register_rule(
    *_SELF_ATTENTIONS,
    check=_check_self_attention,
    call=CallLayout(swin_self_attention_inputs, attention_output_grad, keeps=lambda _: _KEEP_V1),
    position_wise=True,
    copies=True,
)
def swin_self_attention_grads(
    module: nn.Module, call: tuple[torch.Tensor, dict], dy: torch.Tensor
) -> dict[str, PerExampleGrad]:
    """The older ``SwinSelfAttention`` form: the probabilities P of every window and its value
    projection's output V kept from the module's training call (:func:`kept_probabilities`; its scaling,
    bias lookup and shift mask its own, nothing run again), and, since the module's output is the heads'
    output itself, ``dO = dy_out``: ``dS = P * (dP - rowsum(P * dP))`` with ``dP = dO V^T`` (+ the
    gradient of the returned probabilities), then ``d table_i`` as for :func:`hf_swin_bias_grads`.
    ``call[0]`` is (B, nW, N, C) once the probe has established the windows per example (position-wise), or
    (B, N, C); computed in float64 for a float64 table, else in float32, exact to that rounding."""
    hidden, kept = call
    table = module.relative_position_bias_table
    batch = dy.shape[0]
    heads = module.num_attention_heads
    x, dy, windows = window_rows(hidden, dy)
    rows, n, channels = x.shape
    dtype = torch.float64 if table.dtype == torch.float64 else torch.float32
    seen = kept_probabilities(module, kept, _KEEP_V1, f"freeze {_TABLE}")
    with torch.no_grad():

        def split(t: torch.Tensor) -> torch.Tensor:  # (rows, N, C) -> (rows, heads, N, head_dim)
            return t.reshape(rows, n, heads, -1).transpose(1, 2).to(dtype)

        d_out = dy[:, : n * channels].reshape(rows, n, channels)
        d_scores = scores_grad(
            seen["probs"].to(dtype), split(seen["value"]), split(d_out), dy[:, n * channels :]
        )
        grad = table_grads(
            d_scores.reshape(batch, windows, heads, n, n), module.relative_position_index, table
        )
    return {_TABLE: Dense(grad.to(table.dtype))}


def detached(t: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """A parameter as a constant of the rule's computation, in ``dtype`` (None stays None)."""
    return None if t is None else t.detach().to(dtype)
