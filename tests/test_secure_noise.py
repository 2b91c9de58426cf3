"""The secure noise sampler (engine ``secure_mode``): N(0, 1) from the OS CSPRNG as normalised sums of
Box-Muller Gaussians, never from torch's seeded generators; the engine uses it for both noise releases.

Statistical tolerances are at least 6 standard errors (or a KS bound with false-alarm rate < 1e-8)."""

from __future__ import annotations

import math

import pytest
import torch
from scipy import stats
from torch import nn

from dpexp.privacy import PrivacyEngine
from dpexp.privacy import noise as noise_module
from dpexp.privacy.adaptive import release_statistics
from dpexp.privacy.noise import add_gaussian_noise_, secure_standard_normal, secure_uniform, standard_normal

N = 1 << 20


def test_secure_uniform_lies_on_the_open_grid():
    u = secure_uniform(N)
    assert u.dtype == torch.float64 and u.shape == (N,)
    assert u.min() > 0 and u.max() < 1
    cells = u * 2.0**52 - 0.5  # (m + 1/2) 2^-52: integers m in [0, 2^52)
    assert torch.equal(cells, cells.round())
    assert abs(u.mean().item() - 0.5) < 6 * math.sqrt(1 / 12 / N)
    assert secure_uniform(0).shape == (0,)


def test_secure_standard_normal_is_standard_normal():
    z = secure_standard_normal(N)
    assert z.dtype == torch.float64 and z.shape == (N,)
    se = 1 / math.sqrt(N)
    assert abs(z.mean().item()) < 6 * se
    assert abs(z.var().item() - 1) < 6 * math.sqrt(2) * se
    assert abs(z.pow(4).mean().item() - 3) < 6 * math.sqrt(96) * se  # kurtosis: Var(z^4) = 105 - 9
    # Kolmogorov-Smirnov distance: sqrt(-log(1e-8 / 2) / (2N)) = 0.0029 is crossed with probability 1e-8
    assert stats.kstest(z.numpy(), "norm").statistic < 0.0029
    assert torch.corrcoef(torch.stack([z[:-1], z[1:]]))[0, 1].abs() < 6 * se  # neighbours independent


def test_each_value_sums_distinct_box_muller_pairs(monkeypatch):
    """The layout: summand j of every value comes from row j's own uniforms, and the two outputs of one
    Box-Muller pair go to two different values (summed together they would be a single sample)."""
    u1 = torch.tensor([[0.1, 0.2], [0.3, 0.4]], dtype=torch.float64)  # (summands, pairs)
    u2 = torch.tensor([[0.15, 0.25], [0.35, 0.45]], dtype=torch.float64)
    monkeypatch.setattr(noise_module, "secure_uniform", lambda n: torch.cat([u1.flatten(), u2.flatten()]))
    z = secure_standard_normal(3, summands=2)
    r, t = (-2 * u1.log()).sqrt(), 2 * math.pi * u2
    rows = torch.cat([r * t.cos(), r * t.sin()], dim=1)  # (summands, 2 * pairs)
    torch.testing.assert_close(z, rows[:, :3].sum(0) / math.sqrt(2), rtol=1e-12, atol=0)


def test_secure_noise_ignores_torch_seeds_and_leaves_their_state_alone():
    torch.manual_seed(0)
    seeded = torch.get_rng_state()
    first = add_gaussian_noise_(torch.zeros(1000), 1.0, secure=True)
    assert torch.equal(torch.get_rng_state(), seeded)  # nothing was drawn from torch's generator
    torch.manual_seed(0)
    second = add_gaussian_noise_(torch.zeros(1000), 1.0, secure=True)
    assert not torch.equal(first, second)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("layout", ["contiguous", "strided", "scalar"])
def test_secure_noise_in_place(dtype, layout, monkeypatch):
    monkeypatch.setattr(noise_module, "CPU_NOISE_CHUNK", 1000)  # several chunks and a partial one
    base = (torch.arange(2 * 10_500) % 3 - 1).to(dtype).view(210, 100)
    if layout == "contiguous":
        tensor = base.clone()
    elif layout == "strided":
        tensor = base.clone().t()[::2]  # (50, 210), not contiguous: every other row of the transpose
    else:
        tensor = torch.tensor(5.0, dtype=dtype)
    original = tensor.clone()
    result = add_gaussian_noise_(tensor, 3.0, secure=True)
    assert result is tensor and tensor.dtype == dtype and tensor.shape == original.shape
    z = (tensor - original).double().flatten()
    assert (z != 0).all() if dtype == torch.float64 else (z != 0).float().mean() > 0.99  # float32 may round
    if layout != "scalar":
        assert abs(z.std().item() / 3.0 - 1) < 6 / math.sqrt(2 * z.numel())
        assert abs(z.mean().item()) < 6 * 3.0 / math.sqrt(z.numel())


def test_secure_noise_writes_through_a_view_only():
    base = torch.zeros(300, 40)
    add_gaussian_noise_(base[:, ::2], 1.0, secure=True)
    assert (base[:, ::2] != 0).all() and (base[:, 1::2] == 0).all()


def test_secure_sampling_refuses_a_generator():
    generator = torch.Generator().manual_seed(0)
    with pytest.raises(ValueError, match="cannot use a seeded generator"):
        add_gaussian_noise_(torch.zeros(3), 1.0, generator, secure=True)
    with pytest.raises(ValueError, match="cannot use a seeded generator"):
        standard_normal((3,), generator, secure=True)


def test_secure_count_release():
    counts = torch.full((N // 16,), 5.0, dtype=torch.float64)
    torch.manual_seed(0)
    released = release_statistics(counts, 2.0, secure=True)
    torch.manual_seed(0)
    assert not torch.equal(released, release_statistics(counts, 2.0, secure=True))
    z = (released - 5.0) / 2.0
    assert abs(z.mean().item()) < 6 / math.sqrt(z.numel())
    assert abs(z.std().item() - 1) < 6 / math.sqrt(2 * z.numel())


class TwoLayers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(40, 50, bias=False)  # d = 2000
        self.b = nn.Linear(50, 20, bias=False)  # d = 1000

    def forward(self, x):
        return self.b(self.a(x))


@pytest.mark.parametrize("adaptive", [None, {"budget_fraction": 0.1, "rescale_to_global": True}])
def test_engine_draws_both_releases_from_the_secure_sampler(adaptive, monkeypatch):
    """Zero gradients (loss * 0): p.grad is the noise / B, of std sigma_grad C / B (global allocation over
    K = 2 groups with sqrt(sum_k C_k^2) = C); every draw, the clip counts' too, comes from the secure
    sampler."""
    drawn = []
    real = noise_module.secure_standard_normal
    monkeypatch.setattr(noise_module, "secure_standard_normal", lambda n: drawn.append(n) or real(n))
    model = TwoLayers()
    engine = PrivacyEngine(
        model,
        batch_size=8,
        sample_size=100,
        max_grad_norm=1.0,
        noise_multiplier=2.0,
        clipping="per_layer",
        adaptive=adaptive,
        secure_mode=True,
    )
    optimizer = engine.attach(torch.optim.SGD(model.parameters(), lr=0.0))
    values = []
    torch.manual_seed(0)
    for _ in range(10):
        x = torch.randn(8, 40)
        rng_state = torch.get_rng_state()
        engine.backward(model(x).sum(1) * 0.0)
        optimizer.step()
        assert torch.equal(torch.get_rng_state(), rng_state)  # the step drew nothing from torch
        values.append(torch.cat([p.grad.flatten() for p in engine.trainable_parameters().values()]))
        optimizer.zero_grad()
    per_step = [2000, 1000] + ([2] if adaptive else [])  # gradient noise per parameter, then the K counts
    assert drawn == per_step * 10
    z = torch.cat(values).double()
    std = engine.gradient_noise_multiplier * 1.0 / 8
    assert abs(z.std().item() / std - 1) < 6 / math.sqrt(2 * z.numel())
    if adaptive:  # He et al. Prop. 3.1: the counts take a share r of the budget
        assert engine.gradient_noise_multiplier == pytest.approx(2.0 / math.sqrt(0.9))
