"""DBRX's experts (``DbrxExperts``, Databricks 2024; transformers 5.x): the E experts' weights live in its
``mlp`` (``DbrxExpertGLU``) stacked as ``w1``, ``v1``, ``w2``, each (E I, d), and the experts module passes
expert e's slices ``W1_e, V1_e, W2_e`` (I, d) with the rows routed to e to ``mlp``, which computes
``h = act(x W1_e^T) * (x V1_e^T)`` and ``h W2_e``; each row's output is weighed by its routing score and added
to its token.

The block's (B, T, d) input is flattened to N = B*T rows in the experts' forward, row r = (i, t) in
row-major order, and the router's ``top_k_index``, ``top_k_weights`` (N, k) follow that order: the rule
folds them to (B, T, k) by the module's own reshape (never by sizes), so that every tensor of the call
leads with the example. ``mlp`` sees rows gathered from all examples and is claimed by this rule, as
Switch Transformers' experts are (:mod:`~dpexp.privacy.rules.expert_modules`). For every (token, slot) row
r = (t, j) routed to expert e, with ``g_r = W1_e x_t``, ``u_r = V1_e x_t``, ``h_r = act(g_r) * u_r``,
``s_r`` its score and ``dh_r = W2_e (s_r dy_t)``,

    d W2_e = sum_r h_r (x) (s_r dy_t),
    d W1_e = sum_r (act'(g_r) * u_r * dh_r) (x) x_t,    d V1_e = sum_r (act(g_r) * dh_r) (x) x_t,

example i's gradient the sum over its rows (:class:`~dpexp.privacy.per_example.Routed`, E blocks of the
stacked weights; Bu et al. 2023, eq. 2, expert by expert). The rule recomputes each expert's projections
of its rows (one matmul each, as the forward) and takes ``act'`` by autograd through ``mlp``'s own
activation. Refused, with the fix: an activation not known to act elementwise, parameters besides the three
stacked weights, a call other than (B, T, d) states with (B*T, k) routing.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from dpexp.privacy.per_example import PerExampleGrad, Routed
from dpexp.privacy.rules import CallLayout, first_output, forward_arguments, refuse, register_rule
from dpexp.privacy.rules.activation import activation_refusal
from dpexp.privacy.rules.moe import compute_dtype, routed_rows

DBRX = "transformers.models.dbrx.modeling_dbrx"
_WEIGHTS = ("w1", "v1", "w2")
_FIX = "Freeze the experts."


def _refusal(module: nn.Module) -> tuple[str, str] | None:
    mlp = getattr(module, "mlp", None)
    if not isinstance(mlp, nn.Module):
        return "it has no mlp holding the experts' weights", _FIX
    own = {name for name, p in module.named_parameters() if p.requires_grad}
    expected = {f"mlp.{name}" for name in _WEIGHTS}
    if not own <= expected:
        return f"it has parameters {sorted(own - expected)} besides mlp.w1, mlp.v1 and mlp.w2", _FIX
    shape = (module.num_experts * module.ffn_hidden_size, module.hidden_size)
    shapes = {name: tuple(getattr(mlp, name).shape) for name in _WEIGHTS}
    if any(s != shape for s in shapes.values()):
        return f"its stacked weights have shapes {shapes}, not (E I, d) = {shape}", _FIX
    return activation_refusal(mlp.activation_fn, "its", "freeze the experts")


def _check(module: nn.Module) -> None:
    refuse(module, "mixture-of-experts", "experts module", *(_refusal(module) or (None, _FIX)))


def dbrx_inputs(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple:
    """``(hidden_states (B, T, d), top_k_index (B, T, k), top_k_weights (B, T, k), compute dtype)``: the
    routing folded as the forward pairs it with the flattened states."""
    call = forward_arguments(module, args, kwargs)
    hidden, index, weights = list(call.values())[:3]
    shapes = [tuple(t.shape) if torch.is_tensor(t) else type(t).__name__ for t in (hidden, index, weights)]
    if not (
        all(torch.is_tensor(t) for t in (hidden, index, weights))
        and hidden.dim() == 3
        and index.dim() == 2
        and weights.shape == index.shape
        and index.shape[0] == hidden.shape[0] * hidden.shape[1]
        and not index.is_floating_point()
    ):
        raise ValueError(
            f"got hidden_states, top_k_index, top_k_weights of shapes {shapes}; the privacy engine's DBRX "
            "experts rule needs (B, T, d) states with (B*T, k) routing. Call the experts as DbrxFFN does."
        )
    rows = (*hidden.shape[:2], index.shape[1])
    return hidden, index.view(rows), weights.view(rows), compute_dtype(hidden)


@register_rule(
    f"{DBRX}.DbrxExperts",
    check=_check,
    position_wise=True,
    call=CallLayout(dbrx_inputs, first_output, rows=(0, 1, 2)),
    claims=("mlp",),
)
def dbrx_experts_grads(module: nn.Module, x: tuple, dy: torch.Tensor) -> dict[str, PerExampleGrad]:
    """``x`` is :func:`dbrx_inputs`' tuple (its tensors (b, T, ...)), ``dy`` (b, T, d); returns ``mlp.w1``,
    ``mlp.v1`` and ``mlp.w2``'s gradients (module docstring), recomputed in the call's compute dtype."""
    hidden, index, weights, dtype = x
    mlp, experts = module.mlp, module.num_experts
    inputs, scaled, expert, example, sizes = routed_rows(hidden, index, weights, dy, experts, dtype)
    width = hidden.shape[-1]
    w1, v1, w2 = (getattr(mlp, name).detach().to(dtype).view(experts, -1, width) for name in _WEIGHTS)
    gate, up, hidden_grad = (inputs.new_empty(len(expert), w1.shape[1]) for _ in range(3))
    for e, (a, g, u, s, dh) in enumerate(
        zip(*(t.split(sizes) for t in (inputs, gate, up, scaled, hidden_grad)), strict=True)
    ):
        torch.mm(a, w1[e].T, out=g)
        torch.mm(a, v1[e].T, out=u)
        torch.mm(s, w2[e].T, out=dh)  # h W2_e's backward to h
    with torch.enable_grad():
        leaf = gate.requires_grad_()
        activated = mlp.activation_fn(leaf)
    (act_grad,) = torch.autograd.grad(activated, leaf, hidden_grad * up)
    activated = activated.detach()
    shape = mlp.w1.shape
    w1_grad = Routed(act_grad, inputs, expert, example, hidden.shape[0], shape, experts)
    return {
        "mlp.w1": w1_grad,
        "mlp.v1": w1_grad.sibling(activated * hidden_grad, inputs, shape),
        "mlp.w2": w1_grad.sibling(activated * up, scaled, shape),
    }
