"""Seeded index subsets of a training set: the tuning split and documented subsamples.

``split="full"`` trains on the whole training set and evaluates on the official held-out split(s).
``split="tune"`` shuffles the training set once with ``seed`` and holds out ``heldout_fraction`` of it as a
validation set, the 80/20 protocol He et al. (2023, appendix A.2) use to tune hyperparameters without touching
the dev set. ``subsample`` then keeps a seeded random subset of the training part, for quick offline runs;
N of the privacy accounting is the size after both steps.
"""

from __future__ import annotations

from typing import Literal

import numpy as np

SplitKind = Literal["full", "tune"]
SPLITS: tuple[str, ...] = ("full", "tune")


def check_split_options(split: str, heldout_fraction: float, subsample: int | None) -> None:
    """Raise ValueError for an unknown split, a fraction outside (0, 1) or a non-positive subsample."""
    if split not in SPLITS:
        raise ValueError(f"Unknown split {split!r}; valid choices: {', '.join(SPLITS)}.")
    if not 0.0 < heldout_fraction < 1.0:
        raise ValueError(f"tune_fraction must be in (0, 1), got {heldout_fraction}.")
    if subsample is not None and subsample < 1:
        raise ValueError(
            f"subsample must be a positive number of training examples or null, got {subsample}."
        )


def training_indices(
    n: int, split: str, heldout_fraction: float, subsample: int | None, seed: int
) -> tuple[np.ndarray, np.ndarray | None]:
    """Indices into a training set of size ``n``: (training part, held-out part or None for ``split="full"``).

    Deterministic in ``seed``; the held-out part never overlaps the training part, and ``subsample`` (if set)
    selects that many training indices without replacement. The training indices are sorted.
    """
    check_split_options(split, heldout_fraction, subsample)
    rng = np.random.default_rng(seed)
    train = np.arange(n)
    heldout = None
    if split == "tune":
        order = rng.permutation(n)
        cut = n - round(heldout_fraction * n)
        if cut < 1 or cut == n:
            raise ValueError(f"tune_fraction={heldout_fraction} of {n} examples leaves an empty part.")
        train, heldout = np.sort(order[:cut]), np.sort(order[cut:])
    if subsample is not None:
        if subsample > len(train):
            raise ValueError(
                f"subsample={subsample} exceeds the {len(train)} available training examples; "
                "lower task.subsample or set it to null to use them all."
            )
        train = np.sort(rng.choice(train, size=subsample, replace=False))
    return train, heldout
