"""Batch sampling for DP training: which examples form each logical step, and how a step is split.

Poisson subsampling (Abadi et al. 2016; the accountants in :mod:`dpexp.privacy.accounting` assume it): at
every step each of the N examples joins the batch independently with probability q = B/N, so the realised
batch size is Binomial(N, q) (possibly 0) and its expectation is B. The privacy backends therefore divide the
summed clipped gradients by the expected B, never by the realised size.

Shuffle sampling: fixed-size batches of exactly B from a fresh permutation each epoch (the incomplete tail is
dropped). Common in practice, but the accountants' subsampling analysis does not strictly apply.

Both samplers are single-pass iterators over their ``steps`` batches whose position and generator state are
saved and restored with ``state_dict`` / ``load_state_dict``: a resumed run draws the very batches the
interrupted one would have drawn.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, Literal

import torch

SamplingKind = Literal["poisson", "shuffle"]
SAMPLING_KINDS: tuple[str, ...] = ("poisson", "shuffle")


class PoissonBatchSampler:
    """``steps`` logical batches of indices in [0, N); each index is in a batch with prob. ``sample_rate``,
    or, with one rate per example (a tensor of shape (N,)), index i with probability ``sample_rate[i]``
    (individualized privacy, sampling variant: :mod:`dpexp.privacy.individual`)."""

    def __init__(
        self, sample_size: int, sample_rate: float | torch.Tensor, steps: int, generator: torch.Generator
    ) -> None:
        if torch.is_tensor(sample_rate):
            if tuple(sample_rate.shape) != (sample_size,):
                raise ValueError(
                    f"per-example sample rates need one rate per example ({sample_size}), got shape "
                    f"{tuple(sample_rate.shape)}"
                )
            if not bool(((sample_rate > 0) & (sample_rate <= 1)).all()):
                raise ValueError("every per-example sample rate must be in (0, 1]")
        elif not 0.0 < sample_rate <= 1.0:
            raise ValueError(f"sample_rate must be in (0, 1], got {sample_rate}; use batch_size <= N.")
        self.sample_size = sample_size
        self.sample_rate = sample_rate
        self.steps = steps
        self.generator = generator
        self.done = 0  # batches drawn so far

    def __len__(self) -> int:
        return self.steps

    def __iter__(self) -> Iterator[list[int]]:
        while self.done < self.steps:
            mask = torch.rand(self.sample_size, generator=self.generator) < self.sample_rate
            self.done += 1
            yield mask.nonzero().flatten().tolist()

    def state_dict(self) -> dict[str, Any]:
        return {"done": self.done, "generator": self.generator.get_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.done = int(state["done"])
        self.generator.set_state(state["generator"])


class ShuffleBatchSampler:
    """``steps`` batches of exactly ``batch_size`` indices, walking through successive random permutations."""

    def __init__(self, sample_size: int, batch_size: int, steps: int, generator: torch.Generator) -> None:
        if not 0 < batch_size <= sample_size:
            raise ValueError(f"batch_size must be in [1, N={sample_size}], got {batch_size}.")
        self.sample_size = sample_size
        self.batch_size = batch_size
        self.steps = steps
        self.generator = generator
        self.done = 0  # batches drawn so far
        self._epoch_start: torch.Tensor | None = None  # generator state before this epoch's permutation

    def __len__(self) -> int:
        return self.steps

    def __iter__(self) -> Iterator[list[int]]:
        per_epoch = self.sample_size // self.batch_size
        order: list[int] | None = None
        while self.done < self.steps:
            position = self.done % per_epoch
            if position == 0:
                self._epoch_start = self.generator.get_state()
            if position == 0 or order is None:  # a new epoch, or the current one again after a restore
                self.generator.set_state(self._epoch_start)
                order = torch.randperm(self.sample_size, generator=self.generator).tolist()
            self.done += 1
            yield order[position * self.batch_size : (position + 1) * self.batch_size]

    def state_dict(self) -> dict[str, Any]:
        return {"done": self.done, "generator": self.generator.get_state(), "epoch_start": self._epoch_start}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.done = int(state["done"])
        self.generator.set_state(state["generator"])
        self._epoch_start = state["epoch_start"]


def build_batch_sampler(
    kind: str,
    *,
    sample_size: int,
    batch_size: int,
    steps: int,
    generator: torch.Generator,
    example_rates: torch.Tensor | None = None,
) -> PoissonBatchSampler | ShuffleBatchSampler:
    """The logical-batch sampler for ``kind`` in :data:`SAMPLING_KINDS`; q = batch_size / sample_size, or
    ``example_rates`` (N,), every example's own Poisson rate (Poisson sampling only)."""
    if example_rates is not None and kind != "poisson":
        raise ValueError(f"sampling={kind}: per-example sample rates need sampling=poisson")
    if kind == "poisson":
        rate = batch_size / sample_size if example_rates is None else example_rates
        return PoissonBatchSampler(sample_size, rate, steps, generator)
    if kind == "shuffle":
        return ShuffleBatchSampler(sample_size, batch_size, steps, generator)
    raise ValueError(f"Unknown sampling {kind!r}; valid choices: {', '.join(SAMPLING_KINDS)}.")


def split_micro_batches(
    indices: list[int], physical_batch_size: int, lengths: Sequence[int] | None = None
) -> list[list[int]]:
    """Chunks of at most ``physical_batch_size`` indices (none for an empty logical batch).

    With ``lengths`` (the size of every training example, e.g. its token count) the logical batch is first
    ordered by length, so that each micro-batch pads to a similar length. This changes neither which examples
    a step uses nor its clipped sum (a sum over examples), so the privacy analysis is untouched; it only
    removes padding work (about 3x on SST-2 phrases with micro-batches of 128).
    """
    if physical_batch_size < 1:
        raise ValueError(f"physical_batch_size must be >= 1, got {physical_batch_size}.")
    if lengths is not None:
        indices = sorted(indices, key=lengths.__getitem__)
    return [indices[i : i + physical_batch_size] for i in range(0, len(indices), physical_batch_size)]
