"""How the processes of a data-parallel job combine one logical step's privatised statistics.

DP-SGD releases ``sum_i clip(g_i) + z`` per logical step, ``z ~ N(0, sigma^2 C^2 I)`` (Abadi et al. 2016,
Algorithm 1; per group with group-wise clipping, He et al. 2023, section 3.3). When P processes each clip a
disjoint share S_p of the step's examples, the same release is ``sum_p (sum_{i in S_p} clip(g_i) + z_p)``
with ``z_p = z`` in exactly one process and ``z_p = 0`` in the others: one draw, then one sum over the
processes. The engine adds its draw only where :attr:`StepAggregation.draws_noise` holds and hands every
statistic it releases to :meth:`StepAggregation.sum_` before using it; the adaptive thresholds' clip counts
(He et al. Algorithm 1, line 10) go the same way, so every process moves its thresholds identically.

A single process (:class:`SingleProcess`) draws and sums over itself; an implementation over
``torch.distributed`` lives with the trainer (:mod:`dpexp.training.distributed`), so the engine never
communicates itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch


class StepAggregation(Protocol):
    """The processes that share a logical step; exactly one of them has ``draws_noise``."""

    @property
    def draws_noise(self) -> bool:
        """Whether this process adds the step's noise (the only one in the job that does)."""

    def sum_(self, tensors: Sequence[torch.Tensor]) -> None:
        """Replace every tensor, in place, by its sum over the processes (every process gets the same)."""


class SingleProcess:
    """One process: it draws the noise, and its sums are already complete."""

    draws_noise = True

    def sum_(self, tensors: Sequence[torch.Tensor]) -> None:
        """Nothing to add."""
