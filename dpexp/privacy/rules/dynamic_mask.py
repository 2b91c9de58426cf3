"""Doge's dynamic mask attention (Hugging Face's ``DogeAttention``, the SmallDoge models'): a learnt ``A``
per key/value head scales the softplus of a projection of the values into a bias every query adds to its
scores for that key,

    dt[b, t, h] = exp(A_h * softplus(dt_proj(v)[b, t, h])),   S[b, h', s, t] += dt[b, t, h(h')],

where query head h' reads key/value head h(h') (grouped-query attention), and keys past the
``keep_window_size`` largest are masked. ``A_h`` moves only the scores of the query heads of its group, so as
for attention sinks (:mod:`dpexp.privacy.rules.sinks`) the input of ``o_proj`` moves with ``A_h`` in those
heads' columns alone, and example i's gradient is

    d A_i[h] = sum_{h' in group h} sum_t <do[i, t, h'], dy[i, t, h'] / dA>  (+ the returned probabilities'),

read off one more run of the module's own forward in forward mode with ``A`` moved along a tangent of ones
(:func:`~dpexp.privacy.rules.directional.directional_grads`): the mask's arithmetic, window and padding are
the module's own. ``dt_proj``, the projections and the norms are submodules with their own rules. Without the
rule the module took the exact fallback (``doge`` entry of ``bench_suite=sweep_fallbacks``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from dpexp.privacy.per_example import Dense, PerExampleGrad
from dpexp.privacy.rules import CallLayout, refuse, register_rule
from dpexp.privacy.rules.directional import directional_grads, eager_inputs
from dpexp.privacy.rules.submodule_values import unfollowed
from dpexp.privacy.rules.window_attention import attention_output_grad

_DOGE = "transformers.models.doge.modeling_doge.DogeAttention"
_FIX = "Otherwise freeze A (requires_grad=False)."


def _check(module: nn.Module) -> None:
    refuse(module, "dynamic-mask", "module", unfollowed(module, {"A"}, {"o_proj": nn.Linear}), _FIX)


def _inputs(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple:
    return eager_inputs(module, args, kwargs, "dynamic-mask", "freeze A")


@register_rule(_DOGE, check=_check, call=CallLayout(_inputs, attention_output_grad))
def dynamic_mask_grads(module: nn.Module, call: tuple, dy: torch.Tensor) -> dict[str, PerExampleGrad]:
    """``d A`` (B, key/value heads) by the module docstring's formula; ``dy`` (B, T*d [+ heads*T*S]) the
    gradients of the output and of the returned probabilities. In float32: the module's eager attention
    takes its softmax in float32, and ``d A``, a small sum of large terms of opposite signs, carries that
    rounding (autograd's gradient of ``A`` does too, differently)."""
    a = module.A
    heads = module.config.num_attention_heads
    per_head = directional_grads(
        module, call, dy, {"A": torch.ones_like(a)}, heads, f"register a rule for it. {_FIX}"
    )  # (B, heads): query head h' is in key/value group h' // (heads / kv heads), as repeat_kv orders them
    return {"A": Dense(per_head.view(per_head.shape[0], a.shape[0], -1).sum(-1).float())}
