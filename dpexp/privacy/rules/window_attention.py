"""Swin's window attention (Liu et al. 2021, Swin Transformer, sec. 3.2, eq. 4): timm's ``WindowAttention``.

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
"""

from __future__ import annotations

import torch
from torch import nn

from dpexp.privacy.per_example import Dense, PerExampleGrad
from dpexp.privacy.rules import register_rule


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
    if reason is not None:
        raise ValueError(
            f"{type(module).__name__}: the privacy engine's relative-position-bias rule cannot handle this "
            f"module: {reason}. Otherwise freeze relative_position_bias_table (requires_grad=False)."
        )


@register_rule(
    "timm.models.swin_transformer.WindowAttention", check=_check, tap="softmax", position_wise=True
)
def relative_position_bias_grads(
    module: nn.Module, scores: torch.Tensor, ds: torch.Tensor
) -> dict[str, PerExampleGrad]:
    """``ds``: (B, nW, heads, N, N), the gradient at the softmax's input folded per example (or
    (B, heads, N, N) with one window per example); returns ``d table`` (B, (2Wh-1)(2Ww-1), heads)."""
    table = module.relative_position_bias_table
    batch, heads, n = ds.shape[0], ds.shape[-3], ds.shape[-1]
    per_pair = ds.reshape(batch, -1, heads, n * n).sum(1).transpose(1, 2)  # (B, N*N, heads)
    index = module.relative_position_index.reshape(1, n * n, 1).expand(batch, n * n, heads)
    grad = torch.zeros((batch, *table.shape), dtype=ds.dtype, device=ds.device)
    return {"relative_position_bias_table": Dense(grad.scatter_add_(1, index, per_pair))}
