"""Inkling's mixture of experts (transformers' ``InklingMoE``): a sigmoid router over the routed and the
shared experts at once, with a learnt global scale, and shared experts whose weights are 3-D parameters of
their module and whose outputs the router weighs per token. Its routed experts (``InklingExperts``) take the
experts rule of :mod:`dpexp.privacy.rules.moe`.

**Router** (``InklingTopkRouter``: ``weight`` (E + S, d) for E routed and S shared experts, ``global_scale``
(1,)). For each of the N = B*T rows ``x_t``, in float32 with autocast off: logits ``z_t = W x_t``; the top k
routed experts chosen by ``sigmoid(z_t[:E])`` plus the load-balancing buffer ``e_score_correction_bias``;
``l = logsigmoid([z_t[chosen], z_t[E:]])`` and weights ``w = exp(l - logsumexp(l)) * route_scale *
global_scale``, the first k for the routed experts (``topk_weights``), the last S for the shared ones
(``shared_gammas``). The module returns the routed logits too. With ``dy`` the gradients of those three
outputs, the rule recomputes them from the logits with one copy of ``global_scale`` per example and takes

    dW_i = sum_t dz_t (x) x_t   (an :class:`~dpexp.privacy.per_example.Outer`),   d global_scale_i,

by autograd (the same top-k on the same float32 logits, so the same choice).

**Shared experts** (``InklingSharedExperts``: ``gate_proj``, ``up_proj`` (S, I, d), ``down_proj`` (S, d, I)):
every row goes through every shared expert s, ``y_t = sum_s D_s (act(G_s x_t) * U_s x_t * gamma_{t,s})``
(the sum in float32), ``gamma`` the router's ``shared_gammas``. With ``h_{t,s} = act(g) * u * gamma`` and
``dh = D_s^T dy_t``:

    d down_proj_i[s] = sum_t dy_t (x) h_{t,s},   d gate_proj_i[s] = sum_t dg_{t,s} (x) x_t,   likewise up,

``dg``, ``du`` by autograd through the module's own ``act_fn``; S > 1 experts as one ``Outer`` whose left
factor holds expert s's rows in block s.

Both act on each row alone: the engine folds the N rows to (B, T) once its probe establishes the layout
(position-wise rules). Refused at construction: parameters the rules do not know, a shared-experts activation
not known to act elementwise; at the shared experts' call: gammas other than one per row and expert. Without
these rules Inkling's MoE layers were refused (the router's and shared experts' rows are flattened over the
batch, which the fallback cannot fold).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dpexp.privacy.per_example import Dense, Outer, PerExampleGrad
from dpexp.privacy.rules import CallLayout, forward_arguments, per_example_copies, refuse, register_rule
from dpexp.privacy.rules.activation import activation_refusal
from dpexp.privacy.rules.moe import compute_dtype
from dpexp.privacy.rules.submodule_values import unfollowed

_INKLING = "transformers.models.inkling.modeling_inkling"
_FIX = "Otherwise freeze the module's parameters (requires_grad=False)."


def _check_router(module: nn.Module) -> None:
    refuse(module, "Inkling router", "router", unfollowed(module, {"weight", "global_scale"}, {}), _FIX)


def router_inputs(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple:
    """``(hidden_states (N, d),)``: the rows the router flattens its input to."""
    hidden = forward_arguments(module, args, kwargs)["hidden_states"]
    return (hidden.reshape(-1, module.hidden_dim),)


def router_output_grad(module: nn.Module, grads: list[torch.Tensor | None]) -> torch.Tensor:
    """The gradients of the routed logits (N, E), ``topk_weights`` (N, k) and ``shared_gammas`` (N, S) as
    one (N, E + k + S) tensor in the widest of their dtypes (each converts back exactly); the indices have
    none."""
    logits, weights, _, gammas = grads
    dtype = torch.promote_types(torch.promote_types(logits.dtype, weights.dtype), gammas.dtype)
    return torch.cat([logits.to(dtype), weights.to(dtype), gammas.to(dtype)], dim=-1)


@register_rule(
    f"{_INKLING}.InklingTopkRouter",
    check=_check_router,
    position_wise=True,
    call=CallLayout(router_inputs, router_output_grad),
)
def router_grads(module: nn.Module, x: tuple, dy: torch.Tensor) -> dict[str, PerExampleGrad]:
    """``weight`` and ``global_scale`` of one call (module docstring); ``x[0]`` (b, T, d) folded rows (or
    (b, d)), ``dy`` likewise (b, ..., E + k + S)."""
    (hidden,) = x
    batch, width = hidden.shape[0], hidden.shape[-1]
    rows = hidden.detach().reshape(-1, width).float()
    routed, k, shared = module.num_experts, module.top_k, module.n_shared_experts
    dy = dy.reshape(rows.shape[0], -1).float()
    scale = per_example_copies(module.global_scale, batch)  # (b, 1)
    with torch.enable_grad():
        logits = F.linear(rows, module.weight.detach().float()).requires_grad_()
        choice = logits[:, :routed].sigmoid() + module.e_score_correction_bias.float()
        index = torch.topk(choice, k, dim=-1, sorted=False)[1]
        chosen = torch.cat([logits[:, :routed].gather(-1, index), logits[:, routed:]], dim=-1)
        log_probs = F.logsigmoid(chosen)
        weights = torch.exp(log_probs - torch.logsumexp(log_probs, dim=-1, keepdim=True))
        scaled = weights.view(batch, -1, k + shared) * module.route_scale * scale.float()[:, None]
        outputs = (logits[:, :routed], scaled.view_as(weights))
        grads = (dy[:, :routed], dy[:, routed:])
        d_logits, d_scale = torch.autograd.grad(outputs, (logits, scale), grads)
    return {
        "weight": Outer(
            d_logits.view(batch, -1, routed + shared),
            rows.view(batch, -1, width),
            module.weight.shape,
            routed + shared,
        ),
        "global_scale": Dense(d_scale.to(module.global_scale.dtype)),
    }


def _check_shared(module: nn.Module) -> None:
    reason = unfollowed(module, {"gate_proj", "up_proj", "down_proj"}, {})
    activation = activation_refusal(module.act_fn, "its", "freeze the shared experts")
    if reason is None and activation is not None:
        reason = activation[0]
    refuse(module, "Inkling shared-experts", "experts module", reason, _FIX)


def shared_inputs(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple:
    """``(hidden_states (N, d), gammas (N, S), compute dtype)``: the rows every shared expert reads, their
    weights, and the dtype of the call's matmuls."""
    call = forward_arguments(module, args, kwargs)
    hidden, gammas = call["hidden_states"], call["gammas"]
    width = hidden.shape[-1]
    if gammas.numel() != hidden.numel() // width * module.n_shared_experts:
        raise ValueError(
            f"got hidden_states {tuple(hidden.shape)} and gammas {tuple(gammas.shape)}; the rule needs one "
            "gamma per row and shared expert. Call the shared experts as InklingMoE does."
        )
    return hidden.reshape(-1, width), gammas.reshape(-1, module.n_shared_experts), compute_dtype(hidden)


def shared_output_grad(module: nn.Module, grads: list[torch.Tensor | None]) -> torch.Tensor:
    """The output's gradient as the (N, d) rows of the inputs."""
    return grads[0].reshape(-1, grads[0].shape[-1])


def _stacked(left: torch.Tensor, experts: int) -> torch.Tensor:
    """(b, S, T, L) per-expert left factors as (b, S*T, S*L), expert s's rows in column block s: one
    ``Outer`` whose (S*L, R) sum reshapes to the (S, L, R) parameter."""
    if experts == 1:
        return left[:, 0]
    batch, _, length, width = left.shape
    out = left.new_zeros(batch, experts, length, experts, width)
    for s in range(experts):
        out[:, s, :, s] = left[:, s]
    return out.view(batch, experts * length, experts * width)


def _repeated(right: torch.Tensor, experts: int) -> torch.Tensor:
    """(b, T, R) shared by every expert, or (b, S, T, R) per expert, as the (b, S*T, R) right factor."""
    if right.dim() == 3:
        right = right[:, None].expand(-1, experts, -1, -1)
    return right.reshape(right.shape[0], -1, right.shape[-1])


@register_rule(
    f"{_INKLING}.InklingSharedExperts",
    check=_check_shared,
    position_wise=True,
    call=CallLayout(shared_inputs, shared_output_grad, rows=(0, 1)),
)
def shared_experts_grads(module: nn.Module, x: tuple, dy: torch.Tensor) -> dict[str, PerExampleGrad]:
    """``gate_proj``, ``up_proj``, ``down_proj`` of one call (module docstring); ``x`` the (b, T, ...)
    folded rows and gammas (or (b, ...)) and the compute dtype, ``dy`` likewise. The sum over experts is
    taken in float32, as the module."""
    hidden, gammas, dtype = x
    batch, width, experts = hidden.shape[0], hidden.shape[-1], module.n_shared_experts
    rows = hidden.detach().reshape(batch, -1, width).to(dtype)  # (b, T, d)
    gammas = gammas.detach().reshape(batch, -1, experts).transpose(1, 2)[..., None].to(dtype)  # (b, S, T, 1)
    dy = dy.reshape(batch, -1, width).float().to(dtype)  # through the module's float32 sum
    gate_w, up_w, down_w = (
        p.detach().to(dtype) for p in (module.gate_proj, module.up_proj, module.down_proj)
    )
    with torch.enable_grad():
        gate = torch.einsum("btd,sid->bsti", rows, gate_w).requires_grad_()
        up = torch.einsum("btd,sid->bsti", rows, up_w).requires_grad_()
        hidden_act = module.act_fn(gate) * up * gammas  # (b, S, T, I)
        d_hidden = torch.einsum("btd,sdi->bsti", dy, down_w)
        d_gate, d_up = torch.autograd.grad(hidden_act, (gate, up), d_hidden)
    hidden_act = hidden_act.detach()
    right_rows = _repeated(rows, experts)
    return {
        "gate_proj": Outer(
            _stacked(d_gate, experts), right_rows, module.gate_proj.shape, experts * d_gate.shape[-1]
        ),
        "up_proj": Outer(_stacked(d_up, experts), right_rows, module.up_proj.shape, experts * d_up.shape[-1]),
        "down_proj": Outer(
            _stacked(dy[:, None].expand(-1, experts, -1, -1), experts),
            _repeated(hidden_act, experts),
            module.down_proj.shape,
            experts * width,
        ),
    }
