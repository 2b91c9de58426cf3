"""Differential attention (Ye et al. 2024, Differential Transformer, sec. 2.1, eqs. 1-2): Hugging Face's
``DiffLlamaAttention``.

Each head pair takes the difference of two softmax attentions over the same queries and keys, weighted by
one learnt scalar per layer, re-parameterised by four vectors of the head's width (eq. 2):

    lambda = exp(lq1 . lk1) - exp(lq2 . lk2) + lambda_init,
    a = o1 - lambda o2,   y = (1 - lambda_init) GroupNorm(a) W_o^T

(``o1``, ``o2`` the two attentions' outputs, ``GroupNorm`` an RMSNorm without parameters). The four vectors
enter the output through ``lambda`` alone, so example i's gradients are one scalar, ``d lambda_i``, times
the derivative of ``lambda`` (eq. 2, with ``l1 = exp(lq1 . lk1)``, ``l2 = exp(lq2 . lk2)``):

    d lq1_i = d lambda_i l1 lk1,    d lk1_i = d lambda_i l1 lq1,
    d lq2_i = -d lambda_i l2 lk2,   d lk2_i = -d lambda_i l2 lq2,

and ``d lambda_i = sum_t <do[i, t], dy[i, t] / d lambda>`` with ``do`` the gradient at ``o_proj``'s input.
As the attention-sinks rule does, the rule reads ``dy / d lambda`` off one more run of the module's own
forward in forward mode (:func:`~dpexp.privacy.rules.directional.directional_grads`), one vector moved along
its partner scaled to move ``lambda`` by ``l1`` (or ``-l2``): the two attentions, the group norm and the
module's float32 sums are its own; the attention function runs on inputs without tangents, so any
implementation serves. The projections are ``nn.Linear`` submodules with their own rules. Before (stop 61)
the module took the exact fallback (``diffllama`` entry of ``bench_suite=sweep_fallbacks``).
"""

from __future__ import annotations

import torch
from torch import nn

from dpexp.privacy.per_example import Dense, PerExampleGrad
from dpexp.privacy.rules import CallLayout, refuse, register_rule
from dpexp.privacy.rules.directional import directional_grads, rerun_inputs
from dpexp.privacy.rules.submodule_values import unfollowed
from dpexp.privacy.rules.window_attention import attention_output_grad

_DIFFLLAMA = "transformers.models.diffllama.modeling_diffllama.DiffLlamaAttention"
_LAMBDAS = ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2")
_FIX = "Otherwise freeze lambda_q1, lambda_k1, lambda_q2 and lambda_k2 (requires_grad=False)."


def _check(module: nn.Module) -> None:
    reason = unfollowed(module, set(_LAMBDAS), {"o_proj": nn.Linear})
    refuse(module, "differential-attention", "module", reason, _FIX)


def _inputs(module: nn.Module, args: tuple, kwargs: dict) -> tuple:
    return rerun_inputs(module, args, kwargs, "freeze the lambda vectors")


def _exp_dot(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """``exp(q . k)`` as the module forms it: the sum in float32, then its dtype."""
    return torch.exp(torch.sum(q * k, dim=-1, dtype=torch.float32)).to(q.dtype)


@register_rule(_DIFFLLAMA, check=_check, call=CallLayout(_inputs, attention_output_grad))
def differential_grads(module: nn.Module, call: tuple, dy: torch.Tensor) -> dict[str, PerExampleGrad]:
    """The four vectors' per-example gradients (B, head_dim) by the module docstring's formula; ``call``:
    :func:`~dpexp.privacy.rules.directional.rerun_inputs`' triple, ``dy`` (B, T*d [+ heads*T*S]) the gradients
    of the output and of the returned probabilities. ``d lambda_i`` summed in float64 for float64
    parameters, else in float32; the gradients in float32, the precision of the module's sums that form
    lambda (autograd's gradient of the vectors carries that rounding too)."""
    q1, k1, q2, k2 = (getattr(module, name).detach() for name in _LAMBDAS)
    with torch.no_grad():
        l1, l2 = _exp_dot(q1, k1), _exp_dot(q2, k2)
        slopes = {"lambda_q1": l1 * k1, "lambda_k1": l1 * q1, "lambda_q2": -l2 * k2, "lambda_k2": -l2 * q2}
        moved = max(slopes, key=lambda name: float(slopes[name].norm()))
        slope = slopes[moved]  # d lambda / d moved
        if not slope.any():  # every derivative of lambda is zero, and so is every gradient
            d_lambda = slope.new_zeros(call[0].shape[0])
        else:  # moved along slope / |slope|^2, lambda moves by one (to first order)
            d_lambda = directional_grads(
                module, call, dy, {moved: slope / slope.square().sum()}, 1, f"register a rule for it. {_FIX}"
            )[:, 0]
        # In float32, where the module forms lambda: autograd's gradient of the vectors carries its rounding.
        d_lambda = d_lambda.float()[:, None]
        return {name: Dense(d_lambda * s.float()) for name, s in slopes.items()}
