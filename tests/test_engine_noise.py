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
    real = engine_module.add_gaussian_noises_

    def counting(pieces, generator=None, secure=False):
        calls.append([tensor.shape for tensor, _ in pieces])
        return real(pieces, generator, secure)

    monkeypatch.setattr(engine_module, "add_gaussian_noises_", counting)
    for _ in range(3):
        engine.backward(model(torch.randn(2, 40)).sum(1))
    assert calls == []
    optimizer.step()
    assert len(calls) == 1 and sorted(calls[0]) == sorted(p.shape for p in model.parameters())
    assert engine.steps == 1


def _stream_case() -> list[torch.Tensor]:
    """Tensors of one step whose values (10,500 + 7 + 3,000) cross the stream boundaries mid-tensor."""
    return [torch.zeros(10_500, dtype=torch.float64), torch.zeros(7, dtype=torch.float64),
            torch.zeros(60, 50, dtype=torch.float64)]  # fmt: skip


@pytest.mark.parametrize("parallel", [False, True])
def test_streamed_noise_has_every_std_and_independent_streams(monkeypatch, parallel):
    """A step's CPU noise in NOISE_STREAMS streams (the values in order cut into contiguous ranges that cross
    tensors): every tensor gets its own std, every value its own draw, the streams are uncorrelated and not
    copies of each other; drawn in threads or in turn, the same values."""
    monkeypatch.setattr(noise_module, "PARALLEL_NOISE_MIN", 1 if parallel else 1 << 40)
    tensors, stds = _stream_case(), [3.0, 2.0, 0.5]
    noise_module.add_gaussian_noises_(list(zip(tensors, stds, strict=True)), torch.Generator().manual_seed(0))
    for tensor, std in zip(tensors, stds, strict=True):
        assert (tensor != 0).all()
        if tensor.numel() > 100:
            assert tensor.std().item() == pytest.approx(std, rel=0.1)
    values = torch.cat([t.flatten() / s for t, s in zip(tensors, stds, strict=True)])
    n = noise_module.NOISE_STREAMS
    per_stream = values[: (values.numel() // n) * n].view(n, -1)  # the streams' ranges, up to rounding
    corr = torch.corrcoef(per_stream)
    assert (corr - torch.eye(n, dtype=corr.dtype)).abs().max() < 0.1
    sequential = _stream_case()
    monkeypatch.setattr(noise_module, "PARALLEL_NOISE_MIN", 1 << 40)
    noise_module.add_gaussian_noises_(
        list(zip(sequential, stds, strict=True)), torch.Generator().manual_seed(0)
    )
    assert all(torch.equal(a, b) for a, b in zip(tensors, sequential, strict=True))


def test_streamed_noise_depends_on_the_generator_only(monkeypatch):
    """The same generator state gives the same noise with 1 or 2 threads; the next step (the generator
    advanced) and another seed give other noise; the generator's state is what a checkpoint keeps."""
    monkeypatch.setattr(noise_module, "PARALLEL_NOISE_MIN", 1)

    def draw(generator: torch.Generator, threads: int) -> torch.Tensor:
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            tensors = _stream_case()
            noise_module.add_gaussian_noises_([(t, 1.0) for t in tensors], generator)
        finally:
            torch.set_num_threads(before)
        return torch.cat([t.flatten() for t in tensors])

    generator = torch.Generator().manual_seed(5)
    state = generator.get_state()
    one = draw(generator, 1)
    generator.set_state(state)
    assert torch.equal(draw(generator, 2), one)
    assert not torch.equal(draw(generator, 2), one)  # the generator moved on
    assert not torch.equal(draw(torch.Generator().manual_seed(6), 2), one)


def test_noise_of_other_tensors_is_drawn_per_tensor():
    """Secure noise and non-contiguous tensors take add_gaussian_noise_ (per tensor); the others stream."""
    base = torch.zeros(100, 30)
    strided = base.t()  # not contiguous
    contiguous = torch.zeros(500)
    noise_module.add_gaussian_noises_([(strided, 2.0), (contiguous, 1.0)], torch.Generator().manual_seed(0))
    assert (base != 0).all() and (contiguous != 0).all()
    assert base.std().item() == pytest.approx(2.0, rel=0.1)
    secure = torch.zeros(2000)
    noise_module.add_gaussian_noises_([(secure, 1.5)], None, secure=True)
    assert secure.std().item() == pytest.approx(1.5, rel=0.1)
    with pytest.raises(ValueError, match=r"secure noise .* cannot use a seeded generator"):
        noise_module.add_gaussian_noises_([(torch.zeros(3), 1.0)], torch.Generator(), secure=True)


@pytest.mark.parametrize("limit", [1 << 26, 3_000], ids=["one_bucket", "buckets"])
def test_device_noise_has_every_std_and_independent_draws(monkeypatch, limit):
    """An accelerator's noise (run here on CPU tensors, which the function does not mind): one draw per
    bucket of whole tensors, split, scaled and added by multi-tensor kernels; every tensor its own std,
    non-contiguous ones too, every value its own draw, tensors and buckets uncorrelated; the same generator
    state gives the same noise, and dtypes are drawn apart."""
    monkeypatch.setattr(noise_module, "DEVICE_NOISE_VALUES", limit)

    def case() -> list[tuple[torch.Tensor, float]]:
        strided = torch.zeros(40, 50, dtype=torch.float64).t()  # not contiguous
        return [(torch.zeros(2_000, dtype=torch.float64), 3.0), (torch.zeros(7, dtype=torch.float64), 2.0),
                (strided, 0.5), (torch.zeros(2_500), 1.5)]  # fmt: skip

    pieces = case()
    noise_module.add_device_noises_(pieces, torch.Generator().manual_seed(0))
    for tensor, std in pieces:
        assert (tensor != 0).all()
        if tensor.numel() > 100:
            assert tensor.std().item() == pytest.approx(std, rel=0.1)
    assert pieces[3][0].dtype == torch.float32
    rows = torch.stack([pieces[0][0][:1_000] / 3.0, pieces[2][0].flatten()[:1_000] / 0.5,
                        pieces[3][0][:1_000].double() / 1.5])  # fmt: skip
    corr = torch.corrcoef(rows)
    assert (corr - torch.eye(3, dtype=corr.dtype)).abs().max() < 0.15
    again = case()
    noise_module.add_device_noises_(again, torch.Generator().manual_seed(0))
    assert all(torch.equal(a, b) for (a, _), (b, _) in zip(pieces, again, strict=True))


def test_buckets_hold_whole_tensors_up_to_the_limit():
    sizes = [5, 3, 4, 20, 1, 1]
    pieces = [(torch.zeros(n), 1.0) for n in sizes]
    runs = [[t.numel() for t, _ in bucket] for bucket in noise_module._buckets(pieces, 8)]
    assert runs == [[5, 3], [4], [20], [1, 1]]


def test_accelerator_tensors_take_the_device_noise(monkeypatch):
    """add_gaussian_noises_ hands tensors off the CPU to add_device_noises_ (meta tensors stand in for an
    accelerator's), keeps CPU tensors on its streams, and secure noise per tensor wherever they are."""
    seen = []
    monkeypatch.setattr(noise_module, "add_device_noises_", lambda pieces, generator: seen.append(pieces))
    meta, cpu = torch.empty(3, device="meta"), torch.zeros(4)
    noise_module.add_gaussian_noises_([(meta, 2.0), (cpu, 1.0)], torch.Generator().manual_seed(0))
    assert len(seen) == 1 and [(t is meta, std) for t, std in seen[0]] == [(True, 2.0)]
    assert (cpu != 0).all()


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
