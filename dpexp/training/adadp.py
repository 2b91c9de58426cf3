"""ADADP: step-size adaptation for DP-SGD by comparing one step with two half steps (Koskela & Honkela 2020;
reviewed in Monir et al. 2024, section 3.3, Figure 5).

Each ADADP iteration uses two noisy gradients, each a full DP-SGD release on its own Poisson batch (the
trainer's logical steps): G_1 at theta_0, then G_2 at the half step theta_1/2 = theta_0 - (eta/2) G_1::

    theta_1   = theta_0 - eta G_1                        (one step)
    theta_hat = theta_1/2 - (eta/2) G_2                  (two half steps)
    err       = || (theta_1 - theta_hat) / max(1, |theta_1|) ||_2      (element-wise, then the l2 norm)
    theta     = theta_hat if err <= tau, else theta_0    (the iteration is discarded)
    eta      <- min(max(tau / err, alpha_min), alpha_max) eta

Everything after the two releases is post-processing of noisy gradients, so the privacy cost is that of the
releases, which the accountant counts like any other step (two per iteration, same q and sigma). The step
size is ``lr * lr_scale``: ``lr`` follows the config's schedule, ``lr_scale`` (in each parameter group, saved
with the optimizer's state) is what ADADP adapts.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch


class ADADP(torch.optim.Optimizer):
    """SGD whose step size is adapted by the one-step / two-half-steps error estimate (module docstring).

    Args:
        params: the trainable parameters.
        lr: initial step size eta (times the schedule's factor).
        tolerance: tau, the accepted local error.
        alpha_min, alpha_max: bounds of the step-size factor per iteration (alpha_min < 1 < alpha_max).
    """

    def __init__(
        self,
        params: Iterable[torch.nn.Parameter],
        lr: float,
        tolerance: float,
        alpha_min: float = 0.9,
        alpha_max: float = 1.1,
    ) -> None:
        if not (tolerance > 0 and math.isfinite(tolerance)):
            raise ValueError(f"optim.tolerance (tau of ADADP) must be a finite number > 0, got {tolerance}.")
        if not 0 < alpha_min < 1 < alpha_max < math.inf:
            raise ValueError(
                f"ADADP needs 0 < optim.alpha_min < 1 < optim.alpha_max, got {alpha_min} and {alpha_max}."
            )
        defaults = {"lr": lr, "tolerance": tolerance, "alpha_min": alpha_min, "alpha_max": alpha_max}
        super().__init__(params, defaults)
        for group in self.param_groups:  # saved with the optimizer's state: a resumed run continues them
            group.setdefault("lr_scale", 1.0)
            group.setdefault("iterations", 0)
            group.setdefault("accepted", 0)

    @torch.no_grad()
    def step(self, closure: None = None) -> None:
        """First call of an iteration: remember theta_0 and G_1, go to the half step. Second call: the other
        half step, the error estimate, accept or discard, adapt the step size."""
        if closure is not None:
            raise ValueError("ADADP does not take a closure: every gradient is a separate private release")
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            eta = group["lr"] * group["lr_scale"]
            first = not any("theta0" in self.state[p] for p in params)
            if first:
                for p in params:
                    self.state[p]["theta0"] = p.detach().clone()
                    self.state[p]["grad1"] = p.grad.detach().clone()
                    p.add_(p.grad, alpha=-eta / 2)
                continue
            err_sq = 0.0
            for p in params:
                state = self.state[p]
                one_step = state["theta0"] - eta * state["grad1"]
                p.add_(p.grad, alpha=-eta / 2)  # theta_hat
                err_sq += float(((one_step - p) / one_step.abs().clamp_min(1.0)).pow(2).sum())
            err = math.sqrt(err_sq)
            accept = err <= group["tolerance"]
            for p in params:
                state = self.state.pop(p)
                if not accept:
                    p.copy_(state["theta0"])
            factor = group["alpha_max"] if err == 0 else group["tolerance"] / err
            group["lr_scale"] *= min(max(factor, group["alpha_min"]), group["alpha_max"])
            group["iterations"] += 1
            group["accepted"] += int(accept)
