"""Per-example gradients of the forget gates of the Kimi Delta Attention (Kimi Team 2025, "Kimi Linear"):
``KimiLinearForgetGate``, Bailing-hybrid's ``BailingHybridForgetGate`` and GLM-5-Next's
``Glm5NextTextForgetGate``, the per-channel decay of their delta attentions. Each owns ``A_log`` (one per
head) and ``dt_bias`` (heads * d,); its projections (``f_a_proj`` and ``f_b_proj``, low rank, or ``f_proj``)
are layers of their own. For one example, with ``f`` the projections' output (T, heads * d) viewed per head:

    g = -exp(A_log) * softplus(f + dt_bias)                  (softplus(z) = z above 20)
    g = lower_bound * sigmoid(exp(A_log) * (f + dt_bias))    (Bailing's ``safe_gate``, GLM-5-Next's bound)

The rule keeps the gate's output and what its last projection returns in the call (``f``, as the forward
formed it: under autocast too, where the projections run in autocast's dtype), computes ``g`` from ``f`` with
one copy of ``A_log`` and ``dt_bias`` per example in the module's own precisions, checks it against the
output, and takes the copies' gradients of ``<g, dy>`` in one backward: example i's copy enters only example
i's gate.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dpexp.privacy.per_example import Dense, PerExampleGrad
from dpexp.privacy.rules import (
    CallLayout,
    first_output,
    forward_arguments,
    per_example_copies,
    qualified_name,
    refuse,
    register_rule,
)
from dpexp.privacy.rules.submodule_values import once, reproduced, unfollowed

_HF = "transformers.models"
_FIX = "Otherwise freeze A_log and dt_bias (requires_grad=False)."


def _shifted(module: nn.Module, f: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``f + dt_bias`` (B, T, heads, d) in float32 for the projections' output ``f`` (B, T, heads * d)."""
    return (f.float() + b.float()[:, None]).view(*f.shape[:2], -1, module.head_dim)


def _softplus(z: torch.Tensor) -> torch.Tensor:
    return torch.where(z > 20.0, z, torch.log(1.0 + torch.exp(z)))  # as Kimi's and GLM-5-Next's modules


def _kimi(
    module: nn.Module, f: torch.Tensor, a: torch.Tensor, b: torch.Tensor, _: torch.dtype
) -> torch.Tensor:
    """Kimi Linear's gate (float32) for the copies ``a`` (B, 1, 1, heads, 1) and ``b`` (B, heads * d)."""
    return -a[:, 0].float().exp() * _softplus(_shifted(module, f, b))


def _glm5_next(
    module: nn.Module, f: torch.Tensor, a: torch.Tensor, b: torch.Tensor, _: torch.dtype
) -> torch.Tensor:
    """GLM-5-Next's gate (float32; sigmoid-bounded where it has ``safe_gate_lower_bound``) for the copies
    ``a`` (B, heads) and ``b`` (B, heads * d)."""
    z = _shifted(module, f, b)
    decay = a.float().exp()[:, None, :, None]
    if module.safe_gate_lower_bound is not None:
        return module.safe_gate_lower_bound * torch.sigmoid(decay * z)
    return -decay * _softplus(z)


def _bailing(
    module: nn.Module, f: torch.Tensor, a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """Bailing-hybrid's gate for the copies ``a`` (B, heads) and ``b`` (B, heads * d), cast to the dtype of
    the gate's input ``dtype`` as the module's."""
    z = f.float().view(*f.shape[:2], -1, module.head_dim) + b.view(b.shape[0], 1, -1, module.head_dim)
    decay = a.exp()[:, None, :, None]
    gate = module.lower_bound * torch.sigmoid(decay * z) if module.safe_gate else -decay * F.softplus(z)
    return gate.to(dtype)


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


def _inputs(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple:
    """``(hidden_states (B, T, d_model),)``, to which the capture appends the gate's output and ``f``."""
    (hidden,) = forward_arguments(module, args, kwargs).values()  # the gate's one argument
    return (hidden,)


def _keeps(module: nn.Module) -> dict[str, tuple[str, str]]:
    return {"f": (_form(module)[1][-1], "output")}  # the last projection's output


@register_rule(*GATES, check=_check, call=CallLayout(_inputs, first_output, output=True, keeps=_keeps))
def forget_gate_grads(module: nn.Module, call: tuple, dy: torch.Tensor) -> dict[str, PerExampleGrad]:
    """``d A_log`` and ``d dt_bias`` (B, *shape) by the module docstring's recomputation from ``f``; ``dy``
    (B, T, heads, d) the gradient of the gate's output."""
    gate, _ = _form(module)
    x, output, kept = call
    f = once(module, kept, _keeps(module), f"register a rule for its type. {_FIX}")["f"].detach()
    batch = x.shape[0]
    copies = {
        "A_log": per_example_copies(module.A_log, batch),
        "dt_bias": per_example_copies(module.dt_bias, batch),
    }
    with torch.enable_grad():
        g = gate(module, f, copies["A_log"], copies["dt_bias"], x.dtype)
    reproduced(module, "the gate", output, g, _FIX)
    grads = torch.autograd.grad(g, list(copies.values()), dy.to(g.dtype))
    return {name: Dense(grad) for name, grad in zip(copies, grads, strict=True)}
