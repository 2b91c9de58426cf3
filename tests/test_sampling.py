"""Poisson and shuffle batch samplers, and the split of logical batches into micro-batches."""

from __future__ import annotations

import math

import pytest
import torch

from dpexp.training.sampling import (
    PoissonBatchSampler,
    ShuffleBatchSampler,
    build_batch_sampler,
    split_micro_batches,
)


def _generator(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_poisson_batch_sizes_are_binomial():
    n, q, steps = 2000, 0.05, 2000
    sizes = torch.tensor(
        [len(b) for b in PoissonBatchSampler(n, q, steps, _generator())], dtype=torch.float64
    )
    mean, var = n * q, n * q * (1 - q)
    assert abs(sizes.mean() - mean) < 4 * math.sqrt(var / steps)
    # sample variance of a Binomial: relative standard error about sqrt(2 / steps)
    assert abs(sizes.var() / var - 1) < 4 * math.sqrt(2 / steps)


def test_poisson_includes_every_example_independently_with_probability_q():
    n, q, steps = 50, 0.2, 4000
    counts = torch.zeros(n)
    pair = 0  # how often examples 0 and 1 are sampled together
    for batch in PoissonBatchSampler(n, q, steps, _generator(1)):
        counts[batch] += 1
        pair += {0, 1} <= set(batch)
    freq = counts / steps
    assert (freq - q).abs().max() < 5 * math.sqrt(q * (1 - q) / steps)
    assert abs(pair / steps - q * q) < 5 * math.sqrt(q * q / steps)


def test_poisson_batches_are_sorted_unique_indices_and_can_be_empty():
    batches = list(PoissonBatchSampler(10, 0.05, 200, _generator(2)))
    assert len(batches) == 200
    assert all(b == sorted(set(b)) and all(0 <= i < 10 for i in b) for b in batches)
    empty = sum(not b for b in batches)
    assert 0.45 < empty / 200 < 0.75  # P(empty) = 0.95^10 = 0.60


def test_samplers_are_reproducible_from_the_generator_seed():
    first = list(PoissonBatchSampler(100, 0.1, 5, _generator(3)))
    assert first == list(PoissonBatchSampler(100, 0.1, 5, _generator(3)))
    assert first != list(PoissonBatchSampler(100, 0.1, 5, _generator(4)))


def test_shuffle_gives_fixed_size_batches_covering_each_epoch_once():
    n, b = 10, 3  # three batches per epoch, one example dropped each epoch
    batches = list(ShuffleBatchSampler(n, b, 7, _generator()))
    assert len(batches) == 7 and all(len(x) == b for x in batches)
    for epoch in range(2):
        seen = [i for x in batches[3 * epoch : 3 * epoch + 3] for i in x]
        assert len(set(seen)) == 9
    assert batches[:3] != batches[3:6]


def test_build_batch_sampler():
    assert isinstance(
        build_batch_sampler("poisson", sample_size=10, batch_size=2, steps=3, generator=_generator()),
        PoissonBatchSampler,
    )
    shuffle = build_batch_sampler("shuffle", sample_size=10, batch_size=2, steps=3, generator=_generator())
    assert isinstance(shuffle, ShuffleBatchSampler) and len(shuffle) == 3
    with pytest.raises(ValueError, match="poisson, shuffle"):
        build_batch_sampler("uniform", sample_size=10, batch_size=2, steps=3, generator=_generator())
    with pytest.raises(ValueError, match="sample_rate"):
        PoissonBatchSampler(10, 1.5, 3, _generator())
    with pytest.raises(ValueError, match="batch_size"):
        ShuffleBatchSampler(10, 11, 3, _generator())


@pytest.mark.parametrize(
    ("size", "physical", "expected"), [(0, 4, []), (3, 4, [3]), (8, 4, [4, 4]), (9, 4, [4, 4, 1])]
)
def test_split_micro_batches(size, physical, expected):
    indices = list(range(100, 100 + size))
    micro = split_micro_batches(indices, physical)
    assert [len(m) for m in micro] == expected
    assert [i for m in micro for i in m] == indices


def test_split_micro_batches_rejects_nonpositive_size():
    with pytest.raises(ValueError, match="physical_batch_size"):
        split_micro_batches([1, 2], 0)


def test_split_micro_batches_groups_by_length_without_changing_the_step():
    lengths = [9, 1, 5, 3, 7, 2, 8, 4]
    indices = [0, 2, 3, 5, 6, 7]
    micro = split_micro_batches(indices, 2, lengths)
    assert micro == [[5, 3], [7, 2], [6, 0]]  # lengths (2, 3), (4, 5), (8, 9)
    assert sorted(i for m in micro for i in m) == indices
    assert split_micro_batches([], 2, lengths) == []


@pytest.mark.parametrize(
    "make",
    [
        lambda: PoissonBatchSampler(20, 0.3, 9, _generator(5)),
        lambda: ShuffleBatchSampler(
            10, 3, 9, _generator(5)
        ),  # 3 batches per epoch: resumes mid-epoch and at its end
    ],
    ids=["poisson", "shuffle"],
)
def test_sampler_state_resumes_the_same_batches(make):
    expected = list(make())
    for done in (0, 2, 3, 7, 9):
        sampler = make()
        batches = iter(sampler)
        drawn = [next(batches) for _ in range(done)]
        state = sampler.state_dict()
        resumed = make()
        resumed.load_state_dict(state)
        assert drawn + list(resumed) == expected, done
