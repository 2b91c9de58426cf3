"""Per-example gradients of the forget gates of the Kimi Delta Attention (Kimi Team 2025, "Kimi Linear"):
``KimiLinearForgetGate``, Bailing-hybrid's ``BailingHybridForgetGate`` and GLM-5-Next's
``Glm5NextTextForgetGate``, the per-channel decay of their delta attentions. Each owns ``A_log`` (one per
head) and ``dt_bias`` (heads * d,); its projections (``f_a_proj`` and ``f_b_proj``, low rank, or ``f_proj``)
are layers of their own. For one example, with ``f`` the projections' output (T, heads * d) viewed per head:

    g = -exp(A_log) * softplus(f + dt_bias)                  (softplus(z) = z above 20)
    g = lower_bound * sigmoid(exp(A_log) * (f + dt_bias))    (Bailing's ``safe_gate``, GLM-5-Next's bound)

The rule keeps the gate's output, recomputes ``f`` from the input with the projections' weights (read, not
called: no second use of theirs is recorded), computes ``g`` with one copy of ``A_log`` and ``dt_bias`` per
example in the module's own precisions, checks it against the output, and takes the copies' gradients of
``<g, dy>`` in one backward: example i's copy enters only example i's gate.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from dpexp.privacy.per_example import Dense, PerExampleGrad
from dpexp.privacy.rules import per_example_copies, qualified_name, refuse, register_rule
from dpexp.privacy.rules.submodule_values import reproduced, unfollowed

_HF = "transformers.models"
_FIX = "Otherwise freeze A_log and dt_bias (requires_grad=False)."


def _linear(layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return F.linear(x, layer.weight, layer.bias)


def _low_rank(module: nn.Module, x: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``f + dt_bias`` (B, T, heads, d) in float32 through the low-rank ``f_b_proj(f_a_proj(x))``."""
    f = _linear(module.f_b_proj, _linear(module.f_a_proj, x))
    return (f.float() + b.float()[:, None]).view(*x.shape[:2], -1, module.head_dim)


def _softplus(z: torch.Tensor) -> torch.Tensor:
    return torch.where(z > 20.0, z, torch.log(1.0 + torch.exp(z)))  # as Kimi's and GLM-5-Next's modules


def _kimi(module: nn.Module, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Kimi Linear's gate (float32) for the copies ``a`` (B, 1, 1, heads, 1) and ``b`` (B, heads * d)."""
    return -a[:, 0].float().exp() * _softplus(_low_rank(module, x, b))


def _glm5_next(module: nn.Module, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """GLM-5-Next's gate (float32; sigmoid-bounded where it has ``safe_gate_lower_bound``) for the copies
    ``a`` (B, heads) and ``b`` (B, heads * d)."""
    z = _low_rank(module, x, b)
    decay = a.float().exp()[:, None, :, None]
    if module.safe_gate_lower_bound is not None:
        return module.safe_gate_lower_bound * torch.sigmoid(decay * z)
    return -decay * _softplus(z)


def _bailing(module: nn.Module, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Bailing-hybrid's gate for the copies ``a`` (B, heads) and ``b`` (B, heads * d), cast to ``x``'s
    dtype as the module's."""
    z = _linear(module.f_proj, x).float().view(*x.shape[:2], -1, module.head_dim)
    z = z + b.view(b.shape[0], 1, -1, module.head_dim)
    decay = a.exp()[:, None, :, None]
    gate = module.lower_bound * torch.sigmoid(decay * z) if module.safe_gate else -decay * F.softplus(z)
    return gate.to(x.dtype)


GATES: dict[str, tuple[Callable[..., torch.Tensor], tuple[str, ...]]] = {  # type -> (gate, projections)
    f"{_HF}.kimi_linear.modeling_kimi_linear.KimiLinearForgetGate": (_kimi, ("f_a_proj", "f_b_proj")),
    f"{_HF}.bailing_hybrid.modeling_bailing_hybrid.BailingHybridForgetGate": (_bailing, ("f_proj",)),
    f"{_HF}.glm5_next.modeling_glm5_next.Glm5NextTextForgetGate": (_glm5_next, ("f_a_proj", "f_b_proj")),
}


def _form(module: nn.Module) -> tuple[Callable[..., torch.Tensor], tuple[str, ...]]:
    return GATES[qualified_name(type(module))]


def _check(module: nn.Module) -> None:
    _, projections = _form(module)
    reason = unfollowed(module, {"A_log", "dt_bias"}, dict.fromkeys(projections, nn.Linear))
    refuse(module, "forget-gate", "gate", reason, _FIX)


def _keep(module: nn.Module, x: torch.Tensor, output: torch.Tensor) -> bool:
    return True  # g: the check of the recomputation


@register_rule(*GATES, check=_check, keep_output=_keep)
def forget_gate_grads(
    module: nn.Module, x: torch.Tensor, dy: torch.Tensor, output: torch.Tensor | None = None
) -> dict[str, PerExampleGrad]:
    """``d A_log`` and ``d dt_bias`` (B, *shape) by the module docstring's recomputation; ``x``
    (B, T, d_model) the gate's input, ``dy`` (B, T, heads, d) the gradient of its output."""
    gate, _ = _form(module)
    batch = x.shape[0]
    copies = {
        "A_log": per_example_copies(module.A_log, batch),
        "dt_bias": per_example_copies(module.dt_bias, batch),
    }
    with torch.enable_grad():
        g = gate(module, x.detach(), copies["A_log"], copies["dt_bias"])
    if output is not None:
        reproduced(module, "the gate", output, g, _FIX)
    grads = torch.autograd.grad(g, list(copies.values()), dy.to(g.dtype))
    return {name: Dense(grad) for name, grad in zip(copies, grads, strict=True)}
