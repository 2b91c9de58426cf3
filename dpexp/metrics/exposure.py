"""Exposure of inserted canaries: how much a trained model has memorised a random secret (the "secret sharer"
test of Carlini, Liu, Erlingsson, Kos & Song, USENIX Security 2019; used by Li et al. 2022, app. M, Table 9).

A canary is a prefix followed by a secret suffix ``s`` drawn uniformly from a space ``R`` of candidates (here:
every sequence of ``l`` words of a sub-vocabulary of ``V`` words, ``|R| = V^l``). The model's log-perplexity
of a candidate ``r`` is ``Px(r) = -log Pr(r | prefix)``, the summed negative log-likelihood of its tokens (any
logarithm base: exposure depends only on the order of the values, or on a distribution fitted to them).

- **Exact exposure** (Carlini et al., sec. 4.1, Definition 4): with ``rank(s)`` the position of ``s`` when all
  of ``R`` is sorted by log-perplexity (1 = the most likely),

      exposure(s) = log2 |R| - log2 rank(s),

  between 0 (the canary is the least likely candidate) and ``log2 |R|`` (the most likely: extractable).
  :func:`rank_exposure` counts ties against the canary (rank = 1 + the candidates at most as perplexing), so a
  model that scores every candidate alike gets exposure 0.
- **Sampled rank**: ``rank(s) / |R|`` estimated by the fraction of a uniform sample of ``R`` at most as
  perplexing as ``s`` (:func:`sampled_exposure`); it cannot exceed ``log2`` of the sample size.
- **Approximation by distribution model** (Carlini et al., sec. 4.3): for spaces too large to enumerate, the
  log-perplexities of many random candidates are fitted by a skew-normal density ``rho`` (their Figure 4
  shows the fit), and

      exposure(s) ~= -log2 integral_{-inf}^{Px(s)} rho(x) dx = -log2 CDF(Px(s)),

  which can exceed ``log2`` of the sample size and even ``log2 |R|`` (Li et al.'s non-private r = 100 cell,
  17.78 > log2 10^5 = 16.6). :func:`skewnorm_exposure` fits ``scipy.stats.skewnorm`` by maximum likelihood
  and evaluates the log-CDF (no underflow for canaries far in the tail). This is what Table 9 reports.

Li et al. read exposure against ``log2(V^l)`` (~17 for V = 10, l = 5): a canary near it "can likely be
extracted". Pure functions of numbers; the model's log-perplexities are computed by the task
(:meth:`dpexp.tasks.generation.GenerationTask.canary_metrics`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np
from scipy import stats

LN2 = math.log(2.0)


def _values(values: Sequence[float] | np.ndarray, what: str) -> np.ndarray:
    array = np.asarray(values, dtype=np.float64).ravel()
    if array.size == 0:
        raise ValueError(f"{what} is empty")
    if not np.all(np.isfinite(array)):
        raise ValueError(f"{what} holds non-finite log-perplexities")
    return array


def rank(canary: float, others: Sequence[float] | np.ndarray) -> int:
    """Rank of the canary among itself and ``others`` by log-perplexity, 1 for the lowest; ties count
    against the canary (every other candidate with ``Px <= Px(canary)`` is ranked ahead of it)."""
    return 1 + int(np.count_nonzero(_values(others, "the other candidates") <= canary))


def rank_exposure(canary: float, others: Sequence[float] | np.ndarray) -> float:
    """Exact exposure ``log2 |R| - log2 rank`` (Carlini et al. 2019, Definition 4), where ``others`` are the
    log-perplexities of every candidate of ``R`` except the canary itself (``|R| = len(others) + 1``)."""
    others = _values(others, "the other candidates")
    return math.log2(others.size + 1) - math.log2(rank(canary, others))


def sampled_exposure(canary: float, sample: Sequence[float] | np.ndarray) -> float:
    """``-log2`` of the fraction of a uniform ``sample`` of candidates at most as perplexing as the canary,
    the fraction counted as ``(1 + #{x <= Px(canary)}) / (1 + n)`` (the canary among the sample), so at most
    ``log2(n + 1)``: an unbiased-rank estimate of exact exposure while the canary's rank is not far beyond
    ``|R| / n``."""
    sample = _values(sample, "the candidate sample")
    return -math.log2(rank(canary, sample) / (sample.size + 1))


def fit_skewnorm(sample: Sequence[float] | np.ndarray) -> tuple[float, float, float]:
    """Maximum-likelihood skew-normal ``(a, loc, scale)`` of the log-perplexities in ``sample`` (Carlini et
    al. 2019, sec. 4.3); a sample without spread (every candidate alike) gets a tiny scale, not a failure."""
    sample = _values(sample, "the candidate sample")
    if sample.size < 3:
        raise ValueError(f"a skew-normal fit needs at least 3 candidates, got {sample.size}")
    spread = float(np.std(sample))
    if spread <= 1e-12 * max(1.0, abs(float(np.mean(sample)))):
        return 0.0, float(np.mean(sample)), 1e-12 * max(1.0, abs(float(np.mean(sample))))
    a, loc, scale = stats.skewnorm.fit(sample)
    return float(a), float(loc), float(scale)


def skewnorm_exposure(
    canary: float, sample: Sequence[float] | np.ndarray, fit: tuple[float, float, float] | None = None
) -> float:
    """Exposure by the distribution-model approximation: ``-log2 CDF(Px(canary))`` of the skew-normal fitted
    to the candidates' log-perplexities (``fit``: a precomputed :func:`fit_skewnorm`, e.g. shared by canaries
    scored against the same sample). Not capped: a canary far below every candidate can exceed
    ``log2 |R|``; at least 0."""
    a, loc, scale = fit if fit is not None else fit_skewnorm(sample)
    log_cdf = float(stats.skewnorm.logcdf(canary, a, loc, scale))
    return max(0.0, -log_cdf / LN2)


def mean_std(values: Sequence[float]) -> tuple[float, float]:
    """Mean and (population, ``ddof = 0``) standard deviation, as Table 9's "mean ± std" over canaries."""
    array = np.asarray(values, dtype=np.float64)
    if array.size == 0:
        raise ValueError("no values")
    return float(array.mean()), float(array.std())


def exposure_summary(exposures: Mapping[int, Sequence[float]], name: str = "exposure") -> dict[str, float]:
    """Record fields of canary exposures grouped by repetition count ``r``: ``<name>_r<r>`` and
    ``<name>_r<r>_std`` per group, ``<name>`` and ``<name>_std`` over every canary of the run."""
    out: dict[str, float] = {}
    every: list[float] = []
    for repetitions, values in sorted(exposures.items()):
        out[f"{name}_r{repetitions}"], out[f"{name}_r{repetitions}_std"] = mean_std(values)
        every.extend(values)
    out[name], out[f"{name}_std"] = mean_std(every)
    return out
