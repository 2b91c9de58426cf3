"""Per-example gradients of LFM2's gated short convolution (``Lfm2ShortConv``, the same forward in LFM2-MoE's
and LFM3's; their Hugging Face modeling files' ``forward``) and of Inkling's residual one
(:func:`residual_conv_grads`). The block owns no parameter; it reads its
depthwise causal ``conv``'s weight and bias itself (it passes them to ``causal_conv1d_fn``), so the rule
claims that submodule. ``in_proj`` and ``out_proj`` are layers of their own. For one example, with
``(B, C, x) = in_proj(h)`` split in three along the features (each (d, T)):

    u = B * x,    v = conv(u)    (causal depthwise, kernel k),    y = C * v,    output = out_proj(y)

so with ``g = dy W_out`` the gradient at ``y``, the convolution's output gradient is ``dv = C * g`` and

    dW[c, j] = sum_t dv[c, t] u[c, t + j - (k - 1)],    db[c] = sum_t dv[c, t]

(``u`` zero before the first position). The capture keeps ``in_proj``'s output and ``out_proj``'s input in
the block's training call (:class:`~dpexp.privacy.rules.CallLayout`'s ``keeps``); the rule recomputes ``y``
from them and refuses a block whose forward it does not reproduce (another gating, an activation), a cache,
and a wrapped ``conv`` or ``out_proj`` (their weights are read).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dpexp.privacy.per_example import Dense, PerExampleGrad
from dpexp.privacy.rules import (
    CallLayout,
    first_output,
    forward_arguments,
    given_cache,
    refuse,
    register_rule,
)
from dpexp.privacy.rules.autocast import autocast_at, replay
from dpexp.privacy.rules.submodule_values import once, reproduced, unfollowed

_HF = "transformers.models"
SHORT_CONVS = (
    f"{_HF}.lfm2.modeling_lfm2.Lfm2ShortConv",
    f"{_HF}.lfm2_moe.modeling_lfm2_moe.Lfm2MoeShortConv",
    f"{_HF}.lfm3.modeling_lfm3.Lfm3ShortConv",
)
_FIX = "Otherwise freeze its conv (requires_grad=False)."
_KEEPS = {"P": ("in_proj", "output"), "y": ("out_proj", "input")}


def _check(module: nn.Module) -> None:
    reason = unfollowed(module, set(), {"conv": nn.Conv1d, "out_proj": nn.Linear})
    refuse(module, "short-convolution", "block", reason, _FIX)


def short_conv_inputs(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple:
    """``(hidden_states (B, T, d), the call's autocast state)``, to which the capture appends the kept
    values; a call with a cache is refused (the rule's convolution starts from no state)."""
    call = forward_arguments(module, args, kwargs)
    if given_cache(call):
        raise ValueError(
            f"{type(module).__name__} was given a cache, from which the rule's convolution does not start; "
            "call the model with use_cache=False in training, or freeze its conv"
        )
    return call["hidden_states"], autocast_at(call["hidden_states"])


@register_rule(
    *SHORT_CONVS,
    check=_check,
    call=CallLayout(short_conv_inputs, first_output, keeps=lambda _: _KEEPS),
    claims=("conv",),
)
def short_conv_grads(module: nn.Module, call: tuple, dy: torch.Tensor) -> dict[str, PerExampleGrad]:
    """``conv.weight`` (B, d, 1, k) and ``conv.bias`` (B, d) per example by the formula of the module
    docstring; ``dy`` (B, T, d) the gradient of the block's output."""
    _, autocast, kept = call
    seen = once(module, kept, _KEEPS, f"register a rule for its type. {_FIX}")
    conv = module.conv
    kernel, dtype = conv.kernel_size[0], conv.weight.dtype
    with torch.no_grad():
        b, c, x = seen["P"].transpose(1, 2).chunk(3, dim=1)  # (B, d, T) each
        with replay(autocast):  # the call's precisions
            u = b * x
            length = u.shape[-1]
            v = F.conv1d(u, conv.weight, conv.bias, padding=kernel - 1, groups=u.shape[1])[..., :length]
            y = c * v
        recorded = seen["y"][0]  # out_proj's input (B, T, d)
        reproduced(module, "out_proj's input", recorded, y.transpose(1, 2), _FIX)
        u, c = u.to(dtype), c.to(dtype)  # the gradients in the weights' dtype
        dv = c * (dy.to(dtype) @ module.out_proj.weight).transpose(1, 2)  # (B, d, T)
        patches = F.pad(u, (kernel - 1, 0)).unfold(-1, kernel, 1)  # (B, d, T, k): u[t + j - (k - 1)]
        grads = {"conv.weight": Dense(torch.einsum("bct,bctj->bcj", dv, patches).unsqueeze(2))}
        if conv.bias is not None:
            grads["conv.bias"] = Dense(dv.sum(-1))
    return grads


def _check_residual(module: nn.Module) -> None:
    reason = unfollowed(module, set(), {"conv1d": nn.Conv1d})
    refuse(module, "short-convolution", "module", reason, _FIX.replace("conv", "conv1d"))


def residual_conv_inputs(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple:
    """``(hidden_states (B, T, d), conv_mask (B, T) or None)``; a call with a cache is refused (the rule's
    convolution starts from no state)."""
    call = forward_arguments(module, args, kwargs)
    if given_cache(call):
        raise ValueError(
            f"{type(module).__name__} was given a cache, from which the rule's convolution does not start; "
            "call the model with use_cache=False in training, or freeze its conv1d"
        )
    return call["hidden_states"], call.get("conv_mask")


@register_rule(
    f"{_HF}.inkling.modeling_inkling.InklingShortConvolution",
    check=_check_residual,
    call=CallLayout(residual_conv_inputs, first_output),
    claims=("conv1d",),
)
def residual_conv_grads(module: nn.Module, call: tuple, dy: torch.Tensor) -> dict[str, PerExampleGrad]:
    """Inkling's short convolution (``InklingShortConvolution``): ``y = conv1d(u) + x`` in float32, with
    ``u = mask * x`` and the causal depthwise ``conv1d`` (kernel k, no bias) read by the module itself, so
    ``dW[c, j] = sum_t dy[c, t] u[c, t + j - (k - 1)]`` (B, d, 1, k), taken in the weight's dtype as the
    module's ``causal_conv1d_fn`` convolves; ``dy`` (B, T, d) the gradient of the module's output.
    Without the rule the fallback took 48 ms of a 1.0 s private step (``fallbacks`` entry ``inkling``)."""
    hidden, mask = call
    conv = module.conv1d
    kernel, dtype = conv.kernel_size[0], conv.weight.dtype
    with torch.no_grad():
        u = hidden.float()
        if mask is not None:
            u = u * mask[:, :, None]  # the module's apply_mask_to_padding_states, in float32
        u = u.to(dtype).transpose(1, 2)  # (B, d, T)
        dv = dy.float().to(dtype).transpose(1, 2)  # through the module's float32 output
        patches = F.pad(u, (kernel - 1, 0)).unfold(-1, kernel, 1)  # (B, d, T, k): u[t + j - (k - 1)]
        grads = {"conv1d.weight": Dense(torch.einsum("bct,bctj->bcj", dv, patches).unsqueeze(2))}
        if conv.bias is not None:
            grads["conv1d.bias"] = Dense(dv.sum(-1))
    return grads
