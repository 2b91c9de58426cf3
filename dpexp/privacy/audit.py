"""One-run privacy auditing (Steinke, Nasr & Jagielski 2023, "Privacy auditing with one (1) training run"):
the statistics, and the gradient canaries that enter the clipping engine.

m canaries are each included in the run independently with probability 1/2 (``S_j = +1``) or not
(``S_j = -1``). After the run the auditor scores every canary from what the run released, guesses "included"
for the k+ highest scores and "excluded" for the k- lowest (abstaining on the others), and counts the correct
guesses v among the r = k+ + k- guesses. If the run is (epsilon, delta)-DP, each guess is right with
probability at most ``e^eps / (1 + e^eps)`` as for randomized response, so v is stochastically dominated by
``Binomial(r, e^eps / (1 + e^eps))`` (their Theorem 3.1, for delta = 0); delta > 0 adds at most
``2 m delta`` times the largest average point mass below v (their analysis of approximate DP, section 5).
:func:`p_value` is that bound; the empirical lower bound (:func:`epsilon_lower_bound`) is the largest epsilon
that the observed v rejects at the chosen confidence. It bounds the epsilon the implementation actually
achieves in this run from below: a bound above the accountant's epsilon shows a bug (or a wrong analysis);
a bound below it proves nothing (one-run audits are loose, most of all under subsampling). The guesses k+,
k- must be fixed before the scores are seen, or the confidence does not hold.

White-box canaries (:class:`DiracCanaries`, their section 6): "Dirac" gradients ``g_j = M e_{c_j}``, one
coordinate of one trainable parameter each, with a magnitude M above the clipping threshold, so that the
engine's clipping (not the canary) sets what each contributes. An included canary takes part in each logical
step like a data example, with the run's sampling rate q (so the accountant's analysis applies to it), and
enters the engine with :meth:`dpexp.privacy.PrivacyEngine.add_per_example_gradients`; its score is the sum
over the steps of the privatised gradient at its coordinate (times B) minus the data's clipped sum there,
which a white-box auditor knows (:meth:`~dpexp.privacy.PrivacyEngine.clipped_sum_so_far`): what remains is
the canaries' clipped contribution and the noise, the part of the mechanism's output the audit tests.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch
from scipy import stats

from dpexp.privacy.per_example import OneHot


def p_value(m: int, r: int, v: int, epsilon: float, delta: float) -> float:
    """Upper bound on ``P[W >= v]`` for W correct guesses out of r, among m canaries, under
    (``epsilon``, ``delta``)-DP: ``P[Binomial(r, p) >= v] + 2 m delta max_{1 <= i <= v} P[v - i <= Binomial(r,
    p) < v] / i`` with ``p = e^eps / (1 + e^eps)``."""
    if not 0 <= v <= r <= m:
        raise ValueError(f"need 0 <= v <= r <= m, got m={m}, r={r}, v={v}")
    if epsilon < 0 or not 0 <= delta <= 1:
        raise ValueError(f"need epsilon >= 0 and delta in [0, 1], got {epsilon}, {delta}")
    p = 1 / (1 + math.exp(-epsilon))
    tail = float(stats.binom.sf(v - 1, r, p))  # P[W >= v]
    if delta == 0 or v == 0:
        return min(1.0, tail)
    mass = np.cumsum(stats.binom.pmf(np.arange(v - 1, -1, -1), r, p))  # i-th entry: P[v - i <= W < v]
    below = float(np.max(mass / np.arange(1, v + 1)))
    return min(1.0, tail + 2 * m * delta * below)


def epsilon_lower_bound(m: int, r: int, v: int, delta: float, confidence: float = 0.95) -> float:
    """The largest epsilon whose :func:`p_value` is below ``1 - confidence`` (0 if none): with that
    confidence the run is not (epsilon', delta)-DP for any epsilon' below it. Bisection to 1e-6."""
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    beta = 1 - confidence
    if p_value(m, r, v, 0.0, delta) >= beta:
        return 0.0
    lo, hi = 0.0, 1.0
    while p_value(m, r, v, hi, delta) < beta:
        lo, hi = hi, 2 * hi
        if hi > 1e3:
            return math.inf  # only reachable with delta = 0 and every guess right
    while hi - lo > 1e-6:
        mid = (lo + hi) / 2
        if p_value(m, r, v, mid, delta) < beta:
            lo = mid
        else:
            hi = mid
    return lo


def correct_guesses(
    scores: torch.Tensor, included: torch.Tensor, k_plus: int, k_minus: int = 0
) -> tuple[int, int]:
    """(r, v): guess "included" for the ``k_plus`` highest scores and "excluded" for the ``k_minus`` lowest;
    ``scores`` and the boolean ``included`` have shape (m,)."""
    m = scores.shape[0]
    if k_plus < 0 or k_minus < 0 or k_plus + k_minus > m:
        raise ValueError(f"need k_plus, k_minus >= 0 and k_plus + k_minus <= m = {m}")
    order = torch.argsort(scores, descending=True, stable=True)
    right = int(included[order[:k_plus]].sum()) + int((~included[order[m - k_minus :]]).sum())
    return k_plus + k_minus, right


@dataclass
class DiracCanaries:
    """m gradient canaries ``g_j = magnitude * e_{c_j}``: canary j is coordinate ``index[j]`` of the
    flattened parameter ``names[j]``; ``included`` (m,) says which take part in the run."""

    names: list[str]
    index: torch.Tensor
    included: torch.Tensor
    magnitude: float

    @classmethod
    def draw(
        cls, shapes: Mapping[str, torch.Size], m: int, magnitude: float, generator: torch.Generator
    ) -> DiracCanaries:
        """m distinct coordinates, uniformly over all trainable coordinates; each canary included with
        probability 1/2."""
        names = list(shapes)
        sizes = torch.tensor([math.prod(shapes[n]) for n in names])
        total = int(sizes.sum())
        if not 0 < m <= total:
            raise ValueError(f"audit.canaries={m}: need between 1 and {total} (the trainable coordinates)")
        flat = torch.randperm(total, generator=generator)[:m]
        offsets = torch.cumsum(sizes, 0)
        owner = torch.searchsorted(offsets, flat, right=True)
        index = flat - (offsets - sizes)[owner]
        included = torch.rand(m, generator=generator) < 0.5
        return cls([names[int(k)] for k in owner], index, included, float(magnitude))

    def step_gradients(
        self, sample_rate: float, params: Mapping[str, torch.Tensor], generator: torch.Generator
    ) -> dict[str, OneHot]:
        """This step's participants among the included canaries (each with probability q, Poisson), as
        per-example gradients by parameter, all in one batch (a parameter a canary does not touch is 0)."""
        takes_part = self.included & (torch.rand(len(self.names), generator=generator) < sample_rate)
        chosen = takes_part.nonzero().flatten().tolist()
        grads: dict[str, OneHot] = {}
        for slot, j in enumerate(chosen):
            name = self.names[j]
            if name not in grads:
                param = params[name]
                index = torch.zeros(len(chosen), dtype=torch.long, device=param.device)
                value = torch.zeros(len(chosen), dtype=param.dtype, device=param.device)
                grads[name] = OneHot(index, value, param.shape)
            grads[name].index[slot] = self.index[j]
            grads[name].value[slot] = self.magnitude
        return grads

    def read(self, grads: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """Each canary's coordinate of the released gradients ``grads`` (by parameter name), shape (m,)."""
        return torch.stack(
            [
                grads[name].detach().reshape(-1)[int(i)].double().cpu()
                for name, i in zip(self.names, self.index, strict=True)
            ]
        )
