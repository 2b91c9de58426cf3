"""Noise: the right standard deviation per group for each allocation strategy, once per logical step."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from dpexp.privacy import PrivacyEngine
from dpexp.privacy import noise as noise_module


class ThreeLayers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(40, 50, bias=False)  # d = 2000
        self.b = nn.Linear(50, 20, bias=False)  # d = 1000
        self.c = nn.Linear(20, 10, bias=False)  # d = 200

    def forward(self, x):
        return self.c(self.b(self.a(x)))


def _noise_only_grads(allocation: str, thresholds, sigma=2.0, batch_size=8, micro_batches=1, steps=20):
    """Gradients with the clipped sums made zero (loss * 0), so p.grad is pure noise / B."""
    torch.manual_seed(0)
    model = ThreeLayers()
    engine = PrivacyEngine(
        model,
        batch_size=batch_size,
        sample_size=100,
        max_grad_norm=1.0,
        noise_multiplier=sigma,
        clipping="per_layer",
        thresholds=thresholds,
        noise_allocation=allocation,
        generator=torch.Generator().manual_seed(1),
    )
    optimizer = engine.attach(torch.optim.SGD(model.parameters(), lr=0.0))
    samples = {name: [] for name in ("a.weight", "b.weight", "c.weight")}
    for _ in range(steps):
        for _ in range(micro_batches):
            out = model(torch.randn(batch_size // micro_batches, 40))
            engine.backward(out.sum(1) * 0.0)
        optimizer.step()
        for name, p in engine.trainable_parameters().items():
            samples[name].append(p.grad.flatten().clone())
        optimizer.zero_grad()
    return {n: torch.cat(v) for n, v in samples.items()}, engine


def _expected_stds(allocation, thresholds, dims, sigma, batch_size):
    c = torch.tensor(thresholds, dtype=torch.float64)
    d = torch.tensor(dims, dtype=torch.float64)
    gamma = {"global": torch.ones(3, dtype=torch.float64), "equal_budget": c, "weighted": c / d.sqrt()}[
        allocation
    ]
    s = (c.pow(2) / gamma.pow(2)).sum().sqrt()
    return (sigma * s * gamma / batch_size).tolist()


@pytest.mark.parametrize("allocation", ["global", "equal_budget", "weighted"])
def test_noise_std_per_group(allocation):
    thresholds = [0.5, 1.0, 2.0]
    samples, _ = _noise_only_grads(allocation, thresholds)
    want = _expected_stds(allocation, thresholds, [2000, 1000, 200], 2.0, 8)
    for (name, values), std in zip(samples.items(), want, strict=True):
        # over >= 4000 draws the sample std is within ~3.5% at 3 sigma
        assert abs(values.mean()) < 4 * std / math.sqrt(values.numel())
        assert values.std().item() == pytest.approx(std, rel=0.05), name


def test_allocations_differ_as_the_paper_says():
    """Global: same std everywhere; equal budget: proportional to C_k (He et al. 3.3)."""
    thresholds = [0.5, 1.0, 2.0]
    glob = _expected_stds("global", thresholds, [2000, 1000, 200], 1.0, 1)
    equal = _expected_stds("equal_budget", thresholds, [2000, 1000, 200], 1.0, 1)
    assert glob[0] == pytest.approx(glob[2]) and glob[0] == pytest.approx(math.sqrt(0.25 + 1 + 4))
    assert equal[2] / equal[0] == pytest.approx(4.0) and equal[0] == pytest.approx(math.sqrt(3) * 0.5)


def test_noise_added_once_per_logical_step():
    """Four micro-batches give the same noise level as one batch: noise is not added per micro-batch."""
    single, _ = _noise_only_grads("global", [1.0, 1.0, 1.0], micro_batches=1)
    split, _ = _noise_only_grads("global", [1.0, 1.0, 1.0], micro_batches=4)
    for name in single:
        assert split[name].std().item() == pytest.approx(single[name].std().item(), rel=0.06)


def test_noise_is_drawn_exactly_once_per_step(monkeypatch):
    """Count the noise draws: one per parameter per optimizer.step(), none in engine.backward()."""
    import dpexp.privacy.engine as engine_module

    model = ThreeLayers()
    engine = PrivacyEngine(model, batch_size=4, sample_size=40, max_grad_norm=1.0, noise_multiplier=1.0)
    optimizer = engine.attach(torch.optim.SGD(model.parameters(), lr=0.1))
    calls = []
    real = engine_module.add_gaussian_noise_

    def counting(tensor, std, generator=None, secure=False):
        calls.append(tensor.shape)
        return real(tensor, std, generator, secure)

    monkeypatch.setattr(engine_module, "add_gaussian_noise_", counting)
    for _ in range(3):
        engine.backward(model(torch.randn(2, 40)).sum(1))
    assert calls == []
    optimizer.step()
    assert sorted(calls) == sorted(p.shape for p in model.parameters())
    assert engine.steps == 1


@pytest.mark.parametrize("device_path", ["chunked", "whole"])
def test_gaussian_noise_is_independent_in_every_chunk(monkeypatch, device_path):
    """CPU noise is drawn chunk by chunk: every element (also in the last, partial chunk) gets its own draw
    of the right std, and chunks are not copies of each other."""
    monkeypatch.setattr(noise_module, "CPU_NOISE_CHUNK", 1000)
    base = torch.arange(10_500, dtype=torch.float64)
    tensor = base.clone() if device_path == "chunked" else base.clone().view(105, 100).t()  # non-contiguous
    noise_module.add_gaussian_noise_(tensor, 3.0, torch.Generator().manual_seed(0))
    z = (tensor - (base if device_path == "chunked" else base.view(105, 100).t())).flatten()
    assert (z != 0).all()
    chunks = z[:10_000].view(10, 1000)
    for chunk in [*chunks, z[10_000:]]:
        assert chunk.std().item() == pytest.approx(3.0, rel=0.15)
    corr = torch.corrcoef(chunks)
    assert (corr - torch.eye(10, dtype=corr.dtype)).abs().max() < 0.15


def test_empty_poisson_batch_still_gets_noise():
    model = ThreeLayers()
    engine = PrivacyEngine(model, batch_size=4, sample_size=40, max_grad_norm=1.0, noise_multiplier=1.0)
    optimizer = engine.attach(torch.optim.SGD(model.parameters(), lr=0.1))
    optimizer.step()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in engine.trainable_parameters().values())


def test_zero_noise_reports_infinite_epsilon():
    with pytest.warns(UserWarning, match="epsilon = inf"):
        engine = PrivacyEngine(
            ThreeLayers(), batch_size=4, sample_size=40, max_grad_norm=1.0, noise_multiplier=0.0
        )
    engine.steps = 5
    assert engine.get_epsilon(1e-5) == math.inf


class UnusedBranch(nn.Module):
    """A layer whose output the loss never reads (as a pooler an HF head skips): its group is finished after
    autograd's backward, when gradient mode is on again."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.unused, self.head = nn.Linear(4, 6), nn.Linear(6, 2), nn.Linear(6, 3)

    def forward(self, x):
        h = torch.tanh(self.fc(x))
        self.unused(h)
        return self.head(h)


@pytest.mark.parametrize("clipping", ["flat", "per_layer"])
def test_sums_finished_after_backward_carry_no_graph_and_take_noise(clipping):
    """The clipped sums finished after the backward are plain tensors: noise is added in place (this failed
    with 'Output 0 of Split is a view' on Hugging Face CLIP) and the released gradients hold no graph."""
    torch.manual_seed(0)
    model = UnusedBranch()
    engine = PrivacyEngine(
        model, batch_size=4, sample_size=40, max_grad_norm=1.0, noise_multiplier=1.0, clipping=clipping
    )
    optimizer = engine.attach(torch.optim.SGD(model.parameters(), lr=0.1))
    x = torch.randn(4, 4)
    engine.backward(nn.functional.cross_entropy(model(x), torch.tensor([0, 1, 2, 0]), reduction="none"))
    optimizer.step()
    assert all(p.grad is not None and not p.grad.requires_grad for p in model.parameters())
    assert float(model.unused.weight.grad.abs().sum()) > 0  # noise reached the unused layer too
