"""A learnt per-head bias on an attention's output gate (Beam's ``BeamAttention``): per position and head h,

    y = a * sigmoid(g),   g = gate_proj(x) + gate_bias[h],

with ``a`` the attention's output and ``y`` the input of ``o_proj``. Since ``dy/d gate_bias[h] = a s (1 - s)
= y (1 - s)`` in head h's columns (``s = sigmoid(g)``) and nowhere else, example i's gradient is

    d gate_bias_i[h] = sum_{t, c in head h} do[i, t, c] y[i, t, c] (1 - s[i, t, c]),

with ``do = d_out W_o`` the gradient at ``o_proj``'s input (``o_proj`` an ``nn.Linear``). ``y`` and
``gate_proj``'s output are kept from the module's training call (:class:`~dpexp.privacy.rules.CallLayout`'s
``keeps``), so the rule runs nothing again and holds for every attention implementation, a cache included.
``gate_proj`` and the other projections are ``nn.Linear`` submodules with their own rules. Without the rule
the module took the exact fallback, which recomputed it per example.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from dpexp.privacy.per_example import Dense, PerExampleGrad
from dpexp.privacy.rules import CallLayout, forward_arguments, refuse, register_rule
from dpexp.privacy.rules.submodule_values import once, unfollowed
from dpexp.privacy.rules.window_attention import attention_output_grad, through_o_proj, wrapped_o_proj

_BEAM = "transformers.models.beam.modeling_beam.BeamAttention"
_FIX = "Otherwise freeze gate_bias (requires_grad=False)."
_KEEPS = {"y": ("o_proj", "input"), "gate": ("gate_proj", "output")}


def _check(module: nn.Module) -> None:
    reason = unfollowed(module, {"gate_bias"}, {"gate_proj": nn.Linear}) or wrapped_o_proj(module)
    refuse(module, "attention-gate-bias", "module", reason, _FIX)


def gate_inputs(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple:
    """``(hidden_states (B, T, d),)``; the capture appends the values the rule keeps."""
    return (forward_arguments(module, args, kwargs)["hidden_states"],)


@register_rule(
    _BEAM, check=_check, call=CallLayout(gate_inputs, attention_output_grad, keeps=lambda _: _KEEPS)
)
def gate_bias_grads(module: nn.Module, call: tuple, dy: torch.Tensor) -> dict[str, PerExampleGrad]:
    """``d gate_bias`` (B, heads) by the formula of the module docstring; ``dy`` (B, T*d [+ heads*T*S]): the
    gradients of the output and of the returned probabilities (which do not depend on the gate). Computed
    in float64 for a float64 bias, else in float32."""
    hidden, kept = call
    seen = once(module, kept, _KEEPS, "register a rule for this attention, or freeze gate_bias")
    batch, length = hidden.shape[:2]
    bias = module.gate_bias
    heads = bias.shape[0]
    dtype = torch.float64 if bias.dtype == torch.float64 else torch.float32
    with torch.no_grad():
        y = seen["y"][0].reshape(batch, length, heads, -1).to(dtype)
        gate = seen["gate"].reshape(batch, length, heads, -1).to(dtype) + bias.to(dtype)[:, None]
        d_heads = through_o_proj(module, dy, length, dtype)[0].reshape(batch, length, heads, -1)
        grad = (d_heads * y * (1 - gate.sigmoid())).sum((1, 3))
    return {"gate_bias": Dense(grad.to(bias.dtype))}
