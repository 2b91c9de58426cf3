"""Experts held as one module per expert: Switch Transformers' ``SwitchTransformersExperts`` (Fedus et al.
2022, sec. 2.1), a ``ModuleDict`` of ``expert_e`` MLPs ``wo(dropout(act(wi(x))))``, each called on the rows
routed to it.

The sparse MLP flattens its (B, T, d) input to N = B*T rows; its top-1 router (whose ``classifier`` is an
``nn.Linear`` layer of its own) picks expert ``e_t`` and probability ``s_t`` for row t, and drops the rows
beyond ``expert_capacity`` counted along each sequence (a cumulative sum over T: per example). The experts
return ``y_t = s_t W_o^e act(W_i^e x_t)`` for the rows kept. Each expert's linear layers see the rows
gathered from all examples, which is why they are refused as layers of their own (dim 0 is not the example);
the rule claims them and gives, for expert e and example i, with ``g_t = W_i^e x_t`` and ``h_t = act(g_t)``,

    d W_o^e_i = sum_{t of example i routed to e} (s_t dy_t) (x) h_t,
    d W_i^e_i = sum_{t ...} (act'(g_t) * W_o^e^T (s_t dy_t)) (x) x_t,

(Bu et al. 2023, eq. 2, row by row): each an :class:`~dpexp.privacy.per_example.Outer` over the expert's
rows grouped by example and padded to the most rows any example sent it (at most the capacity). The rule
recomputes ``g_t`` (one matmul per expert, as the forward) and takes ``act'`` by autograd through the
module's own activation. The engine folds the N rows to (B, T) once its probe establishes that rows
[i*T, (i+1)*T) are example i's, the routing tensors with them.

Refused, with the fix: dropout inside the experts in training (drawn over the rows gathered from all
examples, one example's routing moves the others' masks, and the rule cannot replay them), an activation
not known to act elementwise, parameters besides the experts' two weights. (NLLB-MoE's experts, alike in
form, stay refused: its router counts expert capacity over the tokens of the whole batch, so one example's
tokens decide which of another's reach their experts.)
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from dpexp.privacy.per_example import Outer, PerExampleGrad
from dpexp.privacy.rules import CallLayout, first_output, forward_arguments, refuse, register_rule
from dpexp.privacy.rules.activation import activation_refusal
from dpexp.privacy.rules.moe import compute_dtype

SWITCH = "transformers.models.switch_transformers.modeling_switch_transformers"
_FIX = "Freeze the experts."


def _experts(module: nn.Module) -> list[nn.Module]:
    return [module[f"expert_{e}"] for e in range(module.num_experts)]


def experts_claims(module: nn.Module) -> tuple[str, ...]:
    """Every expert's two linear layers."""
    return tuple(f"expert_{e}.{name}" for e in range(module.num_experts) for name in ("wi", "wo"))


def _refusal(module: nn.Module) -> tuple[str, str] | None:
    names = sorted(module.keys())
    if names != sorted(f"expert_{e}" for e in range(module.num_experts)):
        return f"its experts {names} are not expert_0 .. expert_{module.num_experts - 1}", _FIX
    for e, expert in enumerate(_experts(module)):
        own = {name for name, p in expert.named_parameters() if p.requires_grad}
        if not own <= {"wi.weight", "wo.weight"}:
            extra = sorted(own - {"wi.weight", "wo.weight"})
            return f"expert_{e} has parameters {extra} besides wi and wo", _FIX
        if not all(type(getattr(expert, name, None)) is nn.Linear for name in ("wi", "wo")):
            return f"expert_{e}'s wi and wo are not both nn.Linear", _FIX
        if expert.wi.bias is not None or expert.wo.bias is not None:
            return f"expert_{e}'s wi or wo has a bias, which its forward does not have", _FIX
        refusal = activation_refusal(expert.act, f"expert_{e}'s", "freeze the experts")
        if refusal is not None:
            return refusal
    return None


def _check(module: nn.Module) -> None:
    refuse(module, "mixture-of-experts", "experts module", *(_refusal(module) or (None, _FIX)))


def switch_inputs(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple:
    """``(rows (N, d), selected experts (N, 1, E) one-hot, routing weights (N, 1), compute dtype)``;
    refuses dropout in training."""
    call = forward_arguments(module, args, kwargs)
    hidden, selected, weights = list(call.values())[:3]
    drops = {e: expert.dropout.p for e, expert in enumerate(_experts(module)) if expert.dropout.p > 0}
    if module.training and drops:
        raise ValueError(
            f"its experts apply dropout (p = {sorted(set(drops.values()))}) in training, between their two "
            "layers, on the rows gathered from all examples: one example's routing moves where the others' "
            "masks fall in the random stream, and the rule cannot recompute them; set dropout_rate=0 in the "
            "config, or freeze the experts"
        )
    shapes = [tuple(t.shape) if torch.is_tensor(t) else type(t).__name__ for t in (hidden, selected, weights)]
    if not (
        all(torch.is_tensor(t) for t in (hidden, selected, weights))
        and hidden.dim() == 2
        and selected.shape == (hidden.shape[0], 1, module.num_experts)
        and weights.shape == (hidden.shape[0], 1)
    ):
        raise ValueError(
            f"got hidden_states, selected_experts, routing_weights of shapes {shapes}; the privacy engine's "
            "mixture-of-experts rule needs (N, d) rows with (N, 1, E) one-hot experts and (N, 1) weights. "
            "Call the experts as the sparse MLP does."
        )
    return hidden, selected, weights, compute_dtype(hidden)


def _by_example(values: torch.Tensor, example: torch.Tensor, batch: int) -> torch.Tensor:
    """Rows (n, F) of examples ``example`` (n,), sorted by example, as (batch, M, F) padded with zeros, M the
    most rows of one example (at least 1)."""
    counts = torch.bincount(example, minlength=batch)
    rank = torch.arange(len(example), device=example.device) - (counts.cumsum(0) - counts)[example]
    out = values.new_zeros(batch, max(int(counts.max()) if len(example) else 0, 1), values.shape[-1])
    out[example, rank] = values
    return out


@register_rule(
    f"{SWITCH}.SwitchTransformersExperts",
    check=_check,
    position_wise=True,
    call=CallLayout(switch_inputs, first_output, rows=(0, 1, 2)),
    claims=experts_claims,
)
def switch_experts_grads(module: nn.Module, x: tuple, dy: torch.Tensor) -> dict[str, PerExampleGrad]:
    """``x`` is :func:`switch_inputs`' tuple with its tensors folded to (b, T, ...) (or (b, ...), one row per
    example), ``dy`` likewise; returns every expert's ``wi.weight`` and ``wo.weight`` gradients."""
    hidden, selected, weights, dtype = x
    batch, width = hidden.shape[0], hidden.shape[-1]
    rows = hidden.detach().reshape(-1, width).to(dtype)  # (N, d), example-major
    length = rows.shape[0] // batch
    chosen = selected.reshape(rows.shape[0], -1)  # (N, E)
    scaled = (dy.reshape(-1, width) * weights.reshape(-1, 1)).to(dtype)  # s_t dy_t
    grads: dict[str, PerExampleGrad] = {}
    for e, expert in enumerate(_experts(module)):
        token = chosen[:, e].nonzero().squeeze(1)  # ascending: example-major
        example = token // length
        inputs = rows[token]
        with torch.enable_grad():
            projected = (inputs @ expert.wi.weight.detach().to(dtype).T).requires_grad_()
            activated = expert.act(projected)
        out_grad = scaled[token]
        (projected_grad,) = torch.autograd.grad(activated, projected, out_grad @ expert.wo.weight.to(dtype))
        grads[f"expert_{e}.wi.weight"] = Outer(
            _by_example(projected_grad, example, batch),
            _by_example(inputs, example, batch),
            expert.wi.weight.shape,
            expert.wi.weight.shape[0],
        )
        grads[f"expert_{e}.wo.weight"] = Outer(
            _by_example(out_grad, example, batch),
            _by_example(activated.detach(), example, batch),
            expert.wo.weight.shape,
            expert.wo.weight.shape[0],
        )
    return grads
