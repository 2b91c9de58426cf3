"""Gaussian noise: allocation across clipping groups, and the samplers that draw it.

Allocation (He et al. 2023, section 3.3 and appendix E): group k's clipped sum is scaled by ``1/gamma_k``
before the Gaussian mechanism and rescaled after, so it receives noise of standard deviation
``sigma * S * gamma_k`` with ``S = sqrt(sum_k C_k^2 / gamma_k^2)``, the L2 sensitivity of the scaled vector
(Algorithm 1, line 13).

Samplers: torch's generator (fast, reproducible from a seed), or the secure sampler
(:func:`secure_standard_normal`, the engine's ``secure_mode``). torch's generators are not cryptographic,
and a floating-point Gaussian sample can betray the value it was added to: the floating-point numbers that
``x + z`` can take depend on x (Mironov 2012 for the Laplace mechanism; Jin et al. 2022, "Are We There
Yet?", for the Gaussian samplers of DP libraries, Opacus' included). The secure sampler draws its bits from
the operating system's CSPRNG (never from a user seed) and returns the normalised sum of several
independent Gaussians, which makes inverting a sample exponentially costly in the number of summands
(Holohan & Braghin 2021, "Secure Random Sampling in Differential Privacy", section 5.1).
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

import torch

Allocation = Literal["global", "equal_budget", "weighted"]

CPU_NOISE_CHUNK = 1 << 18  # values drawn at a time on CPU (1 MiB in float32: stays in cache)
SECURE_SUMMANDS = 4  # k: Gaussians summed per secure value (Holohan & Braghin's 2n with n = 2, as Opacus)
# a step's CPU noise is drawn as this many independent streams, each from its own generator; fixed (not the
# thread count), so that the noise of a seed is the same on every machine
NOISE_STREAMS = 8
PARALLEL_NOISE_MIN = 1 << 22  # values from which the streams are drawn in threads (below: a pool costs more)
# a step's noise on an accelerator is drawn in buckets of whole tensors of at most this many values (256 MiB
# in float32; a larger tensor alone), one draw and two multi-tensor kernels each, not two launches a tensor
DEVICE_NOISE_VALUES = 1 << 26


def allocation_weights(thresholds: torch.Tensor, dims: torch.Tensor, allocation: Allocation) -> torch.Tensor:
    """``gamma_k``: 1 (global), ``C_k`` (equal budget) or ``C_k / sqrt(d_k)`` (weighted)."""
    if allocation == "global":
        return torch.ones_like(thresholds)
    if allocation == "equal_budget":
        return thresholds.clone()
    if allocation == "weighted":
        return thresholds / dims.to(thresholds.dtype).sqrt()
    raise ValueError(f"unknown noise allocation {allocation!r}; valid: 'global', 'equal_budget', 'weighted'")


def noise_stds(
    thresholds: torch.Tensor, dims: torch.Tensor, noise_multiplier: float, allocation: Allocation
) -> torch.Tensor:
    """Per-group noise standard deviations ``sigma * S * gamma_k``, shape (K,)."""
    gamma = allocation_weights(thresholds, dims, allocation)
    sensitivity = (thresholds.pow(2) / gamma.pow(2)).sum().sqrt()
    return noise_multiplier * sensitivity * gamma


def add_gaussian_noise_(
    tensor: torch.Tensor, std: float, generator: torch.Generator | None = None, secure: bool = False
) -> torch.Tensor:
    """``tensor += z``, ``z ~ N(0, std^2 I)``, in place; returns ``tensor``.

    On CPU the noise is drawn chunk by chunk into one small buffer and added while it is still in cache: a
    tensor-sized temporary (64 MB for a 50k x 256 embedding) would be page-faulted in afresh at every step and
    read back from memory. Every element still gets its own independent draw. ``secure``: z from
    :func:`secure_standard_normal` (``generator`` must then be None).
    """
    if secure:
        _check_no_generator(generator)
        return _add_secure_gaussian_noise_(tensor, std)
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        noise = torch.randn(tensor.shape, generator=generator, device=tensor.device, dtype=tensor.dtype)
        return tensor.add_(noise, alpha=std)
    flat = tensor.view(-1)
    buffer = torch.empty(min(CPU_NOISE_CHUNK, flat.numel()), dtype=tensor.dtype)
    for piece in flat.split(CPU_NOISE_CHUNK):
        piece.add_(buffer[: piece.numel()].normal_(generator=generator), alpha=std)
    return tensor


def add_gaussian_noises_(
    pieces: Sequence[tuple[torch.Tensor, float]],
    generator: torch.Generator | None = None,
    secure: bool = False,
) -> None:
    """``t += z_t``, ``z_t ~ N(0, std_t^2 I)``, in place, for every ``(t, std_t)`` of ``pieces`` (one step's
    noise, every element its own independent draw).

    torch's CPU sampler is sequential (one Mersenne Twister per generator), about a second for GPT-2's 124M
    values, so on CPU the values of the contiguous tensors, taken in order, are split into ``NOISE_STREAMS``
    contiguous ranges, each drawn chunk by chunk from its own generator, seeded by one draw of
    ``NOISE_STREAMS`` 63-bit seeds from ``generator``; from ``PARALLEL_NOISE_MIN`` values on, the ranges
    are drawn in parallel threads (torch's kernels release the GIL). The noise depends on ``generator``'s
    state only, not on the threads. Tensors on an accelerator: :func:`add_device_noises_`. Others
    (``secure``, or on CPU and not contiguous): :func:`add_gaussian_noise_` each.
    """
    streamed = [(t, std) for t, std in pieces if not secure and t.device.type == "cpu" and t.is_contiguous()]
    on_device = [(t, std) for t, std in pieces if not secure and t.device.type != "cpu"]
    ids = {id(t) for t, _ in streamed + on_device}
    for tensor, std in pieces:
        if id(tensor) not in ids:
            add_gaussian_noise_(tensor, std, generator, secure)
    add_device_noises_(on_device, generator)
    total = sum(t.numel() for t, _ in streamed)
    if total == 0:
        return
    seeds = torch.randint(0, 2**63 - 1, (NOISE_STREAMS,), generator=generator).tolist()
    bounds = [total * s // NOISE_STREAMS for s in range(NOISE_STREAMS + 1)]
    ranges: list[list[tuple[torch.Tensor, float]]] = [[] for _ in range(NOISE_STREAMS)]
    start = 0  # of the current tensor, in the values taken in order
    for tensor, std in streamed:
        flat, end = tensor.view(-1), start + tensor.numel()
        for s in range(NOISE_STREAMS):
            lo, hi = max(bounds[s], start), min(bounds[s + 1], end)
            if lo < hi:
                ranges[s].append((flat[lo - start : hi - start], std))
        start = end

    def draw(stream: int) -> None:
        own = torch.Generator().manual_seed(seeds[stream])
        for piece, std in ranges[stream]:
            add_gaussian_noise_(piece, std, own)

    workers = min(torch.get_num_threads(), NOISE_STREAMS)
    if total < PARALLEL_NOISE_MIN or workers < 2:
        for stream in range(NOISE_STREAMS):
            draw(stream)
        return
    with ThreadPoolExecutor(max_workers=workers) as pool:
        list(pool.map(draw, range(NOISE_STREAMS)))  # list(): re-raises a worker's error


def add_device_noises_(
    pieces: Sequence[tuple[torch.Tensor, float]], generator: torch.Generator | None = None
) -> None:
    """``t += std_t z_t``, ``z_t ~ N(0, I)``, in place, for tensors on an accelerator, where every kernel
    launch costs host time: by device and dtype, in buckets of whole tensors of at most
    ``DEVICE_NOISE_VALUES`` values (:func:`_buckets`), each one ``randn`` split into the tensors' shapes,
    scaled by ``std_t`` and added by two multi-tensor kernels. Every element still gets its own draw."""
    kinds: dict[tuple[torch.device, torch.dtype], list[tuple[torch.Tensor, float]]] = {}
    for tensor, std in pieces:
        kinds.setdefault((tensor.device, tensor.dtype), []).append((tensor, std))
    for (device, dtype), kind in kinds.items():
        for bucket in _buckets(kind, DEVICE_NOISE_VALUES):
            tensors, sizes = [t for t, _ in bucket], [t.numel() for t, _ in bucket]
            noise = torch.randn(sum(sizes), generator=generator, device=device, dtype=dtype)
            draws = [z.view(t.shape) for z, t in zip(noise.split(sizes), tensors, strict=True)]
            torch._foreach_mul_(draws, [std for _, std in bucket])
            torch._foreach_add_(tensors, draws)


def _buckets(
    pieces: list[tuple[torch.Tensor, float]], limit: int
) -> Iterator[list[tuple[torch.Tensor, float]]]:
    """``pieces`` in order, in runs of at most ``limit`` values (a larger tensor alone)."""
    bucket: list[tuple[torch.Tensor, float]] = []
    values = 0
    for tensor, std in pieces:
        if bucket and values + tensor.numel() > limit:
            yield bucket
            bucket, values = [], 0
        bucket.append((tensor, std))
        values += tensor.numel()
    if bucket:
        yield bucket


def standard_normal(
    shape: torch.Size | tuple[int, ...], generator: torch.Generator | None = None, secure: bool = False
) -> torch.Tensor:
    """N(0, I) of the given shape in float64 on CPU, from ``generator`` or (``secure``) the secure sampler."""
    if secure:
        _check_no_generator(generator)
        return secure_standard_normal(math.prod(shape)).view(shape)
    return torch.randn(shape, generator=generator, dtype=torch.float64)


def secure_uniform(n: int) -> torch.Tensor:
    """n values uniform on the open interval (0, 1), float64, from the operating system's CSPRNG.

    ``u = (m + 1/2) 2^-52`` with m the low 52 of 64 bits from ``os.urandom``: the midpoints of the 2^52
    cells of [0, 1), each exact in float64 (53-bit significand), so ``log u`` is finite and the grid is
    symmetric under ``u -> 1 - u``.
    """
    if n == 0:
        return torch.empty(0, dtype=torch.float64)
    bits = torch.frombuffer(bytearray(os.urandom(8 * n)), dtype=torch.int64)
    return (bits & ((1 << 52) - 1)).double().add_(0.5).mul_(2.0**-52)


def box_muller(u1: torch.Tensor, u2: torch.Tensor) -> torch.Tensor:
    """Box & Muller (1958): independent uniforms u1, u2 of shape (..., m) -> 2m independent N(0, 1) values
    ``[R cos(2 pi u2), R sin(2 pi u2)]`` along the last dimension, ``R = sqrt(-2 log u1)``."""
    radius = u1.log().mul_(-2.0).sqrt_()
    angle = u2 * (2 * math.pi)
    return torch.cat([radius * angle.cos(), radius * angle.sin()], dim=-1)


def secure_standard_normal(n: int, summands: int = SECURE_SUMMANDS) -> torch.Tensor:
    """n independent N(0, 1) values, float64, for noise that must resist floating-point attacks.

    Each value is ``(z_1 + ... + z_k) / sqrt(k)``, k = ``summands``, which is again N(0, 1) (Holohan &
    Braghin 2021, section 5.1). The z_j are Box-Muller normals from :func:`secure_uniform`, row j of a
    (k, n) draw; a Box-Muller pair goes to two different values of one row, never to two summands of one
    value (the two outputs of a pair share their uniforms: ``R cos t + R sin t = sqrt(2) R cos(t - pi/4)``
    would be one sample, not two). No rejection loop: the work depends on n only.
    """
    pairs = (n + 1) // 2
    uniforms = secure_uniform(2 * summands * pairs).view(2, summands, pairs)
    normals = box_muller(uniforms[0], uniforms[1])[:, :n]
    return normals.sum(dim=0).div_(math.sqrt(summands))


def _add_secure_gaussian_noise_(tensor: torch.Tensor, std: float) -> torch.Tensor:
    """``tensor += std * z`` with z from :func:`secure_standard_normal`, scaled in float64 and then cast to
    the tensor's dtype and device, chunk by chunk (``CPU_NOISE_CHUNK`` values); returns ``tensor``."""
    work = tensor if tensor.is_contiguous() else tensor.contiguous()
    for piece in work.view(-1).split(CPU_NOISE_CHUNK):
        piece.add_(secure_standard_normal(piece.numel()).mul_(std).to(piece))
    return tensor if work is tensor else tensor.copy_(work)


def _check_no_generator(generator: torch.Generator | None) -> None:
    if generator is not None:
        raise ValueError(
            "secure noise is drawn from the operating system's CSPRNG and cannot use a seeded generator: "
            "pass generator=None, or secure=False for reproducible noise."
        )
