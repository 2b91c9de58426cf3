"""Per-example gradients of Kimi Linear's forget gate (``KimiLinearForgetGate``: the per-channel decay of its
delta attention; Kimi Team 2025, "Kimi Linear"). The gate owns ``A_log`` (1, 1, heads, 1) and ``dt_bias``
(heads * d,); its low-rank projections ``f_a_proj``, ``f_b_proj`` are layers of their own. For one example,
with ``f = f_b_proj(f_a_proj(x))`` (T, heads * d) viewed per head:

    g = -exp(A_log) * softplus(f + dt_bias)        (softplus(z) = z above 20, as the module computes it)

so ``d dt_bias = sum_t dy * -exp(A_log) * sigmoid(f + dt_bias)`` (1 above 20) and ``d A_log = sum_{t, d} dy *
g`` (the gate is its own derivative in ``A_log``). The rule keeps the gate's output, recomputes ``f`` from the
input with the projections' weights (read, not called: no second use of theirs is recorded) and checks ``g``
against the output.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dpexp.privacy.per_example import Dense, PerExampleGrad
from dpexp.privacy.rules import refuse, register_rule
from dpexp.privacy.rules.functional import reproduces

KIMI_GATE = "transformers.models.kimi_linear.modeling_kimi_linear.KimiLinearForgetGate"
_FIX = "Otherwise freeze A_log and dt_bias (requires_grad=False)."


def _check(module: nn.Module) -> None:
    own = {name for name, p in module.named_parameters(recurse=False) if p.requires_grad}
    wrapped = [
        name for name in ("f_a_proj", "f_b_proj") if type(getattr(module, name, None)) is not nn.Linear
    ]
    reason = None
    if own - {"A_log", "dt_bias"}:
        reason = f"it owns parameters {sorted(own - {'A_log', 'dt_bias'})} the rule does not know"
    elif wrapped:
        reason = f"{wrapped} are not the plain nn.Linear whose weights the rule reads"
    refuse(module, "forget-gate", "gate", reason, _FIX)


def _keep(module: nn.Module, x: torch.Tensor, output: torch.Tensor) -> bool:
    return True  # g: the gradient of A_log, and the check of the recomputation


@register_rule(KIMI_GATE, check=_check, keep_output=_keep)
def forget_gate_grads(
    module: nn.Module, x: torch.Tensor, dy: torch.Tensor, output: torch.Tensor | None = None
) -> dict[str, PerExampleGrad]:
    """``d A_log`` (B, 1, 1, heads, 1) and ``d dt_bias`` (B, heads * d) by the module docstring's formulas;
    ``x`` (B, T, d_model) the gate's input, ``dy`` (B, T, heads, d) the gradient of its output."""
    with torch.no_grad():
        f = F.linear(F.linear(x, module.f_a_proj.weight, module.f_a_proj.bias), module.f_b_proj.weight)
        if module.f_b_proj.bias is not None:
            f = f + module.f_b_proj.bias
        z = (f.float() + module.dt_bias.float()).view(*x.shape[:2], -1, module.head_dim)
        decay = module.A_log.float().exp()
        g = -decay * torch.where(z > 20.0, z, torch.log(1.0 + torch.exp(z)))
        if output is not None and not reproduces(output, g):
            raise RuntimeError(
                f"{type(module).__name__}: the rule's recomputation of the gate does not reproduce its "
                "output (its forward differs from the one the rule follows); register a rule for its type "
                f"(dpexp.privacy.rules.register_rule). {_FIX}"
            )
        dy = dy.float()
        slope = torch.where(z > 20.0, torch.ones_like(z), torch.sigmoid(z))
        d_bias = (dy * -decay * slope).flatten(2).sum(1)  # (B, heads * d)
        d_log = (dy * g).sum((1, 3))  # (B, heads)
    return {
        "A_log": Dense(d_log.view(-1, *module.A_log.shape).to(module.A_log.dtype)),
        "dt_bias": Dense(d_bias.to(module.dt_bias.dtype)),
    }
