"""Convolutions (``nn.Conv1d/2d/3d`` and ``nn.ConvTranspose1d/2d/3d``, any ``groups``) as linear layers over
patches (Bu et al. 2023, section 3.1).

With ``a_{i,t}`` the t-th input patch (C_in * prod(kernel) values, ``F.unfold``) and ``dy_{i,t}`` the output
gradient at position t, ``dW_i = sum_t dy_{i,t} (x) a_{i,t}``; T is the number of output positions.

Everything runs on the convolution's own backward kernel, as non-private training does: the clipped sum
``sum_i c_i dW_i`` is the weight gradient for output gradients ``c_i dy_i``, and the per-example gradients
are the weight gradient of the same convolution with the batch folded into the channels (``groups = B g``
for a convolution of g groups: example b's group j is group ``b g + j``), which avoids materialising the
(B, T, p) patch tensor. That holds on CPU; on a GPU cuDNN ran such convolutions one group (one example) at a
time for some shapes, so there the per-example gradients of 1-D and 2-D convolutions are a batched product
over unfolded patches, a bounded chunk of examples at a time (:func:`patch_weight_grads`). Grouped and
depthwise convolutions (ConvNeXt, MobileNet, EfficientNet, ResNeXt, NFNet) have per-example gradients of
only ``C_out * C_in / g * prod(kernel)`` values, which may be instantiated.

The norm has two ghost forms, ``||dW_i||^2 = sum_{t,s} <a_t, a_s> <dy_t, dy_s>``, for 1-D and 2-D
convolutions (3-D and transposed ones instantiate their per-example gradients for the norm): over unfolded
patches (``F.unfold``, ``T^2 (C_in K + C_out)`` multiply-adds per example for K kernel offsets; for g groups
the sum of the groups' norms over their slices of patches and output gradients, ``T^2 (C_in K + C_out)`` as
well), or, ungrouped, over pixels (:func:`patch_gram_norm_sq`): a patch is the padded input at
``stride t + dilation o`` for the offsets o, so ``<a_t, a_s> = sum_o P[stride t + dilation o, stride s +
dilation o]`` with P the Gram of the input's pixels over channels, a sum of K shifted blocks of P
(``N^2 C_in`` for N input pixels, plus the output gradients' ``T^2 C_out``). Each layer takes the cheapest
by a measured cost model (:func:`norm_costs`). Padding modes other than zeros, and ``padding="same"``, are
applied to the input explicitly, exactly as the module does.
"""

from __future__ import annotations

import itertools
from typing import Literal, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.conv import _ConvNd

from dpexp.privacy.per_example import (
    CACHED_VALUES,
    WRITE_COST,
    Dense,
    NormMode,
    Outer,
    PerExampleGrad,
    accurate,
    joined,
    zeroed,
)
from dpexp.privacy.rules import register_rule

CONVOLUTIONS = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)


def check_conv(module: _ConvNd) -> None:
    if module.transposed and module.padding_mode != "zeros":
        raise ValueError(f"{module!r}: transposed convolutions support only padding_mode='zeros'.")


def explicitly_padded(module: _ConvNd, x: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
    """The input as the convolution kernel sees it, and the padding left for the kernel: a padding mode
    other than zeros, or a string padding, is applied to ``x`` first (as ``_ConvNd._conv_forward`` does)."""
    n = len(module.kernel_size)
    if module.padding_mode == "zeros" and not isinstance(module.padding, str):
        return x, list(module.padding)
    mode = "constant" if module.padding_mode == "zeros" else module.padding_mode
    return F.pad(x, module._reversed_padding_repeated_twice, mode=mode), [0] * n


def _output_padding(module: _ConvNd, x: torch.Tensor, dy: torch.Tensor) -> list[int]:
    """A transposed convolution's output padding, read off the sizes (it can be set per call)."""
    if not module.transposed:
        return [0] * len(module.kernel_size)
    return [
        out - ((size - 1) * s - 2 * p + d * (k - 1) + 1)
        for out, size, s, p, d, k in zip(
            dy.shape[2:],
            x.shape[2:],
            module.stride,
            module.padding,
            module.dilation,
            module.kernel_size,
            strict=True,
        )
    ]


def _weight_grad(module: _ConvNd, x: torch.Tensor, dy: torch.Tensor, groups: int, shape) -> torch.Tensor:
    """The convolution's weight gradient for input ``x`` and output gradient ``dy`` (native kernel)."""
    weight = dy.new_zeros(1).as_strided(shape, (0,) * len(shape))  # only its shape is read
    x, padding = explicitly_padded(module, x.to(dy.dtype))
    return torch.ops.aten.convolution_backward(
        dy, x, weight, None, module.stride, padding, module.dilation, module.transposed,
        _output_padding(module, x, dy) if module.transposed else [0] * len(padding), groups,
        [False, True, False],
    )[1]  # fmt: skip


def as_image(module: nn.Conv1d | nn.Conv2d, x: torch.Tensor) -> tuple[torch.Tensor, Geometry]:
    """The input as a (B, C_in, H, W) image with the geometry of a 2-D convolution (a 1-D signal is an image
    of height 1), after :func:`explicitly_padded`."""
    x, padding = explicitly_padded(module, x)
    if isinstance(module, nn.Conv1d):
        return x.unsqueeze(2), Geometry(
            (1, module.kernel_size[0]), (1, module.stride[0]), (0, padding[0]), (1, module.dilation[0])
        )
    return x, Geometry(module.kernel_size, module.stride, tuple(padding), module.dilation)


class Axis(NamedTuple):
    """One dimension of a phase component ``x_r`` of the zero-padded input (positions ``r + stride i``): the
    ``pixels`` input indices ``start, start + stride, ...`` that it holds sit at its positions ``offset, ...``
    (the rest is padding), and the kernel offsets of this phase read it at ``shifts``."""

    start: int
    pixels: int
    offset: int
    shifts: list[int]


class Geometry(NamedTuple):
    """A 2-D convolution's kernel size, stride, zero padding and dilation, (height, width) each."""

    kernel: tuple[int, ...]
    stride: tuple[int, ...]
    padding: tuple[int, ...]
    dilation: tuple[int, ...]

    def components(self, out: tuple[int, int], size: tuple[int, int]) -> list[tuple[Axis, Axis]]:
        """For output size ``out`` and input size ``size`` (before padding), the phase components of the
        padded input that the kernel reads, an :class:`Axis` per dimension. Kernel offset
        ``dilation u = stride q + r`` of output position t reads the padded input at ``stride (t + q) + r``:
        position ``t + q`` of the component ``x_pad[r::stride]``, which is read up to ``out + max(q)``."""
        per_dim = []
        for k, s, p, d, n, length in zip(
            self.kernel, self.stride, self.padding, self.dilation, out, size, strict=True
        ):
            phases: dict[int, list[int]] = {}
            for u in range(k):
                q, r = divmod(d * u, s)
                phases.setdefault(r, []).append(q)
            axes = []
            for r, shifts in phases.items():
                first = max(0, -((r - p) // s))  # the first position inside the input: r + s i >= p
                end = min(n + max(shifts), -((r - p - length) // s))  # past the last: r + s i < p + length
                axes.append(Axis(r + s * first - p, max(0, end - first), first, shifts))
            per_dim.append(axes)
        return list(itertools.product(*per_dim))


def unfold_patches(module: nn.Conv1d | nn.Conv2d, x: torch.Tensor) -> torch.Tensor:
    """Input patches, shape (B, T, C_in * prod(kernel)), in the order of ``weight.flatten(1)``: the values and
    layout of ``F.unfold(...).transpose(1, 2)``, read as windows (strided views) of the zero-padded input and
    copied once. On CUDA ``F.unfold`` launches one kernel per example (WRN-16-4's bk step at B = 256 ran 1024
    of them, H200, ``results/bench/gpu_stop57/kernels.log``); on CPU the copy also took 0.1-0.7x its time
    (WRN shapes, B = 16, one thread)."""
    x, (kernel, stride, padding, dilation) = as_image(module, x)
    if any(padding):
        x = F.pad(x, (padding[1], padding[1], padding[0], padding[0]))
    for dim, (k, s, d) in enumerate(zip(kernel, stride, dilation, strict=True), start=2):
        x = x.unfold(dim, d * (k - 1) + 1, s)  # each window spans the dilated kernel
    x = x[..., :: dilation[0], :: dilation[1]]  # (B, C_in, H_out, W_out, k_h, k_w)
    b, t = x.shape[0], x.shape[2] * x.shape[3]
    return x.permute(0, 1, 4, 5, 2, 3).reshape(b, -1, t).transpose(1, 2)


def patch_weight_grads(module: nn.Conv1d | nn.Conv2d, x: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
    """Per-example weight gradients ``dW_i = sum_t dy_{i,t} (x) a_{i,t}``, shape (B, *weight.shape), as one
    batched product of the output gradients (B, G, C_out / G, T) with the unfolded patches (B, G, T,
    C_in K / G) (group j's output channels read its input channels, contiguous in both)."""
    patches = unfold_patches(module, x.to(dy.dtype)).transpose(1, 2)  # (B, C_in K, T), contiguous
    b, t, groups = dy.shape[0], patches.shape[-1], module.groups
    grads = torch.matmul(dy.reshape(b, groups, -1, t), patches.view(b, groups, -1, t).transpose(-1, -2))
    return grads.view(b, *module.weight.shape)


PATCH_VALUES = 2**24
"""Patch values (64 MiB in float32) that one chunk of :func:`patch_weight_grads` may unfold."""

GROUPED_INSTANTIATION = frozenset({"cpu"})
"""Device types on which :meth:`ConvWeightGrads.instantiate_chunks` runs the batch-grouped convolution: on
CPU (one thread, chunks of 32) it took 0.4-1.0x the time of :func:`patch_weight_grads` where T >= 256 output
positions, the layers whose norm instantiates (larger ones have a cheaper ghost form)."""


GRAM_VALUES = {"cpu": 2**19, "other": 2**22}
"""Values that the pixel and output-gradient Grams of one chunk of examples may take in
:func:`patch_gram_norm_sq`, by device (``"other"``: not a CPU). On CPU 2 MiB in float32, a core's L2 cache, so
that the shifted blocks are added in cache: a WRN stage-2 layer (128 channels, 16 x 16, B = 64: 256K values
an example) took 26-28 ms at one thread in chunks of one or two examples against 41-44 ms in chunks of 4 to
16; stage-3 layers (8 x 8, 16K an example) ran as fast in chunks of 32 as of 64. Elsewhere 16 MiB (fewer,
larger kernel launches)."""


def patch_gram_norm_sq(module: nn.Conv1d | nn.Conv2d, x: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
    """``sum_{t,s} <a_t, a_s> <dy_t, dy_s>`` per example, shape (B,), without unfolding the patches ``a_t``.

    With the zero-padded input split into phase components ``x_r = x[r::stride]`` (one for stride 1),
    ``<a_t, a_s> = sum_o P_r(o)[t + q(o), s + q(o)]``, where ``P_r = x_r^T x_r`` is the Gram of the
    component's pixels over channels and kernel offset o reads component r(o) at shift q(o)
    (:meth:`Geometry.components`). The Gram is formed over the pixels inside the input only (padding adds
    zeros), and the shifted blocks are added in place one dimension at a time (a component's offsets are a
    product of per-dimension shifts), each clipped to the pixels it covers, into the (T, T) patch Gram, whose
    inner product with the output gradients' Gram ``dY^T dY`` is the norm. Chunked over examples
    (:data:`GRAM_VALUES`).
    """
    x, geo = as_image(module, accurate(x))
    out = (1, dy.shape[2]) if isinstance(module, nn.Conv1d) else (dy.shape[2], dy.shape[3])
    dy = accurate(dy).flatten(2)  # (B, C_out, T)
    components = geo.components(out, x.shape[2:])
    per_example = 2 * dy.shape[2] ** 2 + max(  # the Grams, the component's Gram and its row sums
        a.pixels**2 * (b.pixels**2 + out[1] ** 2) for a, b in components
    )
    chunk = max(1, GRAM_VALUES["cpu" if x.device.type == "cpu" else "other"] // per_example)
    chunks = zip(x.split(chunk), dy.split(chunk), strict=True)
    return torch.cat([_patch_gram_dot(xs, gs, out, geo, components) for xs, gs in chunks])


def _patch_gram_dot(x, dy, out, geo: Geometry, components) -> torch.Tensor:
    """:func:`patch_gram_norm_sq` of one chunk: x (b, C_in, H, W) before zero padding, dy (b, C_out, T)."""
    (n1, n2), b = out, x.shape[0]
    patch_gram = None
    for rows, cols in components:
        if rows.pixels and cols.pixels:
            pixels = x[:, :, rows.start :: geo.stride[0], cols.start :: geo.stride[1]]
            flat = pixels[:, :, : rows.pixels, : cols.pixels].reshape(b, -1, rows.pixels * cols.pixels)
            gram = torch.bmm(flat.transpose(1, 2), flat)
            gram = gram.view(b, rows.pixels, cols.pixels, rows.pixels, cols.pixels)
            patch_gram = _add_shifted(_add_shifted(gram, cols, (2, 4), n2), rows, (1, 3), n1, patch_gram)
    if patch_gram is None:  # the kernel reads only padding
        return dy.new_zeros(b)
    grad_gram = torch.bmm(dy.transpose(1, 2), dy)
    pairs = zip(patch_gram.view(b, -1), grad_gram.view(b, -1), strict=True)
    return torch.stack([torch.dot(p, g) for p, g in pairs])  # on CPU faster than one batched product


def _add_shifted(
    gram: torch.Tensor, axis: Axis, dims: tuple[int, int], n: int, into: torch.Tensor | None = None
) -> torch.Tensor:
    """``into[t, s] += sum_q gram[t + q - offset, s + q - offset]`` on dimensions ``dims`` (of size n in
    ``into``; a new tensor if None), over the shifts q of ``axis`` and where the indices are inside."""
    blocks = []  # (first target index, length, first source index) per shift
    for q in axis.shifts:
        lo, hi = max(0, axis.offset - q), min(n, axis.pixels + axis.offset - q)
        if lo < hi:
            blocks.append((lo, hi - lo, lo + q - axis.offset))

    def block(t: torch.Tensor, start: int, length: int) -> torch.Tensor:
        return t.narrow(dims[0], start, length).narrow(dims[1], start, length)

    if into is None:
        whole = next((b for b in blocks if b[1] == n), None)
        if whole is not None:  # a shift covering every index is copied, not added to zeros
            blocks.remove(whole)
            into = block(gram, whole[2], n).clone(memory_format=torch.contiguous_format)
        else:
            shape = list(gram.shape)
            shape[dims[0]] = shape[dims[1]] = n
            into = gram.new_zeros(shape)
    for lo, length, src in blocks:
        block(into, lo, length).add_(block(gram, src, length))
    return into


NormMethod = Literal["instantiate", "unfold", "pixels"]

INSTANTIATE_CHUNK = 32
"""Examples per batch-grouped convolution in :meth:`ConvWeightGrads.instantiate`: on CPU (one thread) a WRN
stage-2 layer (128 channels, 16 x 16) took 125-134 ms at batch 64 in one call and 83-105 ms in two of 32,
a strided 64 -> 128 layer 44-55 against 35-42 ms (``scripts/conv_norm_bench.py`` shapes)."""

WEIGHT_GRAD_RATE = 0.75
"""The batch weight-gradient convolution's cost per multiply-add in :func:`norm_costs`' units (those of the
instantiation): on CPU at one thread it formed a WRN stage-2 layer's gradient (2.4 G multiply-adds at
B = 64) in 28 ms, where the instantiation took 44.5 ms for its modelled 2.8 G
(``scripts/conv_norm_bench.py``). With it and the instantiation's write cost, fused per-layer clipping takes
the pixel Gram and the convolution for those layers: 162-163 ms a WRN-16-4 training step for the three of
them, against 201-203 ms for instantiating and keeping their gradients."""

ELEMENT_COST = 15
"""Multiply-adds that one elementwise pass over one value costs (memory-bound: a shifted block's add, an
unfolded patch's copy)."""
GROUP_PRODUCT_COST = 30_000
"""Multiply-adds that the grouped ghost norm pays per example and group beyond its arithmetic: the patches
copied again group-major and one small Gram product each (on CPU at one thread, ConvNeXt-T's 7 x 7
depthwise layers at B = 16 over 2 x 2 and 4 x 4 maps took 11-13 ms by this form against 3-6 ms by the
batch-grouped instantiation, which its multiply-adds alone ranked the other way; stop 60)."""

INSTANTIATE_MIN_POSITIONS = 300
"""The batch-grouped convolution takes as long per per-example gradient value as if the map had at least this
many output positions: on CPU at batch 64 it ran at 25-32 G multiply-adds/s for T = 1024, but as if at
T = 300 for T = 64 and T = 256 (``scripts/conv_norm_bench.py``)."""


def norm_costs(
    geo: Geometry, c_in: int, c_out: int, out: tuple[int, int], size: tuple[int, int]
) -> dict[NormMethod, float]:
    """Time per example of each way to the norm of an ungrouped convolution with output size ``out`` and
    input size ``size``, in multiply-adds of a matmul (measured on CPU at one thread,
    ``scripts/conv_norm_bench.py``), with T output positions and K kernel offsets: instantiation
    ``K C_in C_out max(T, INSTANTIATE_MIN_POSITIONS)``, plus :data:`~dpexp.privacy.per_example.WRITE_COST`
    a value where a chunk of :data:`INSTANTIATE_CHUNK` gradients outgrows the cache (``CACHED_VALUES``);
    unfolded patches ``T^2 (K C_in + C_out)`` plus the unfolding; pixels ``sum_r N_r^2 C_in + T^2 C_out``
    for the N_r pixels of component r inside the input, plus the shifted blocks' adds
    (:func:`patch_gram_norm_sq`)."""
    t, k = out[0] * out[1], geo.kernel[0] * geo.kernel[1]
    values = k * c_in * c_out
    written = WRITE_COST * values if INSTANTIATE_CHUNK * values > CACHED_VALUES else 0
    grad_gram = t * t * c_out
    blocks = sum(
        (rows.pixels * cols.pixels) ** 2 * c_in
        + ELEMENT_COST * (len(cols.shifts) * rows.pixels**2 * out[1] ** 2 + len(rows.shifts) * t * t)
        for rows, cols in geo.components(out, size)
    )
    return {
        "instantiate": values * max(t, INSTANTIATE_MIN_POSITIONS) + written,
        "unfold": t * t * k * c_in + grad_gram + ELEMENT_COST * t * k * c_in,
        "pixels": blocks + grad_gram + ELEMENT_COST * t * t,
    }


class ConvWeightGrads(PerExampleGrad):
    """Per-example gradients of a convolution's weight, from its input ``x`` and output gradient ``dy``."""

    def __init__(self, module: _ConvNd, x: torch.Tensor, dy: torch.Tensor) -> None:
        self.module, self.x, self.dy, self.shape = module, x, dy, module.weight.shape
        self._batch_size = dy.shape[0]

    @property
    def batch_size(self) -> int:
        return self._batch_size

    @property
    def has_ghost_form(self) -> bool:
        """1-D and 2-D convolutions (patches as by ``F.unfold``; grouped ones group by group)."""
        return isinstance(self.module, nn.Conv1d | nn.Conv2d)

    def outer(self) -> Outer:
        """The book-keeping form over unfolded patches, for cross terms (:attr:`has_outer_form`)."""
        g = self.dy.flatten(2).transpose(1, 2)  # (B, T, C_out)
        return Outer(g, unfold_patches(self.module, self.x), self.shape, g.shape[-1])

    def norm_costs(self) -> dict[NormMethod, float]:
        """:func:`norm_costs` of this layer; where the instantiation is kept for a fused clipped sum
        (:meth:`retain` without release), the ghost forms also pay for that sum (a weight-gradient
        convolution, ``T K C_in C_out`` at :data:`WEIGHT_GRAD_RATE`), the kept gradients' ``tensordot``
        costing next to nothing."""
        x, geo = as_image(self.module, self.x[:1])
        out, size, groups = self._out_size(), tuple(x.shape[2:]), self.module.groups
        costs = norm_costs(geo, self.shape[1], self.shape[0], out, size)
        if groups > 1:  # the ghost norm group by group over its patches; the pixel Grams are not grouped
            per_group = norm_costs(geo, self.shape[1], self.shape[0] // groups, out, size)["unfold"]
            costs = {"instantiate": costs["instantiate"], "unfold": groups * (per_group + GROUP_PRODUCT_COST)}
        if self._retain and not self._release:
            total = WEIGHT_GRAD_RATE * self.dy[0, 0].numel() * self.shape.numel()
            costs = {m: c + (total if m != "instantiate" else 0) for m, c in costs.items()}
        return costs

    def _out_size(self) -> tuple[int, int]:
        return (1, self.dy.shape[2]) if isinstance(self.module, nn.Conv1d) else tuple(self.dy.shape[2:4])

    def norm_method(self, mode: NormMode, ghost_extra: float = 0) -> NormMethod:
        """How :meth:`norm_sq` computes the norm: instantiated where the convolution has no ghost form, when
        forced, or (``auto``) when the factors are to be released; otherwise (``auto``, or the cheaper ghost
        form when forced) the cheapest of :meth:`norm_costs`, with ``ghost_extra`` multiply-adds per example
        on the ghost forms (the weight-standardised rule's responses). As for linear layers
        (:func:`~dpexp.privacy.per_example.ghost_is_cheaper`), instantiation is ruled out where its
        ``K C_in C_out / G`` values per example exceed ``8 G T^2`` (the ghost form's G Grams of ``T^2``).

        The costs are CPU measurements. On a GPU the pixel Grams (many small blocks) were the slowest way on
        every WRN-16-4 shape, 2-60x the others (H200, B = 256: ``results/bench/gpu_h200_stop45/
        conv_norms.md``), so off the CPU only instantiation and unfolded patches compete; the CPU model
        then picks the faster of those two on 9 of the 10 shapes."""
        if not self.has_ghost_form or mode == "instantiate" or (mode == "auto" and self._release):
            return "instantiate"
        costs = {m: c + (ghost_extra if m != "instantiate" else 0) for m, c in self.norm_costs().items()}
        if self.dy.device.type != "cpu":
            costs.pop("pixels", None)
        if mode == "ghost" or self.shape.numel() > 8 * self.module.groups * self.dy[0, 0].numel() ** 2:
            del costs["instantiate"]
        return min(costs, key=costs.__getitem__)

    def ghost_norm_sq(self, dy: torch.Tensor, method: NormMethod) -> torch.Tensor:
        """``sum_{t,s} <a_t, a_s> <dy_t, dy_s>`` per example for output gradients ``dy`` (the layer's, or
        scaled), over unfolded patches or pixels (:func:`patch_gram_norm_sq`). A grouped convolution's
        gradient is block-diagonal over its G groups (group g's output channels read only its input
        channels, contiguous in both), so its squared norm is the sum of G such norms, each over the group's
        slice of the patches and of ``dy``: the B examples' G groups as one batch of B G."""
        if method == "pixels":
            return patch_gram_norm_sq(self.module, self.x, dy)
        g = dy.flatten(2).transpose(1, 2)  # (B, T, C_out)
        patches = unfold_patches(self.module, self.x)  # (B, T, C_in K)
        groups = self.module.groups
        if groups == 1:
            return Outer(g, patches, self.shape, g.shape[-1]).norm_sq("ghost")
        b, t = g.shape[:2]

        def by_group(z: torch.Tensor) -> torch.Tensor:  # (B, T, G w) -> (B G, T, w)
            return z.reshape(b, t, groups, -1).transpose(1, 2).reshape(b * groups, t, -1)

        left = by_group(g)
        shape = (left.shape[-1], patches.shape[-1] // groups)
        return Outer(left, by_group(patches), shape, left.shape[-1]).norm_sq("ghost").view(b, groups).sum(1)

    def instantiate(self) -> torch.Tensor:
        return joined(self.instantiate_chunks())

    def instantiate_chunks(self) -> list[torch.Tensor]:
        """On CPU the batch-grouped weight gradient, :data:`INSTANTIATE_CHUNK` examples at a time. Elsewhere,
        for 1-D and 2-D convolutions, :func:`patch_weight_grads` in chunks of at most :data:`PATCH_VALUES`
        patch values: cuDNN ran the batch-grouped convolution of some WRN-16-4 layers as one kernel per
        group (256 launches a layer at B = 256, H200, ``results/bench/gpu_stop57/kernels.log``)."""
        if self.has_ghost_form and self.dy.device.type not in GROUPED_INSTANTIATION:
            per_example = self.dy[0, 0].numel() * self.shape[1:].numel() * self.module.groups
            size = max(1, PATCH_VALUES // per_example)
            chunks = zip(self.x.split(size), self.dy.split(size), strict=True)
            return [patch_weight_grads(self.module, accurate(x), accurate(dy)) for x, dy in chunks]
        chunks = zip(self.x.split(INSTANTIATE_CHUNK), self.dy.split(INSTANTIATE_CHUNK), strict=True)
        return [self._instantiate(x, dy) for x, dy in chunks]

    def _instantiate(self, x: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
        """The per-example gradients of examples ``x``, ``dy`` as the weight gradient of one convolution with
        the batch folded into the channels and groups (module docstring)."""
        b, groups = x.shape[0], self.module.groups
        x, dy = accurate(x).reshape(1, -1, *x.shape[2:]), accurate(dy).reshape(1, -1, *dy.shape[2:])
        grads = _weight_grad(self.module, x, dy, b * groups, (b * self.shape[0], *self.shape[1:]))
        return grads.view(b, *self.shape)

    def _weighted_sum(self, coef: torch.Tensor) -> torch.Tensor:
        dy = accurate(self.dy)  # summed in float32 under autocast, as normed (per_example.accurate)
        scaled = dy * coef.to(dy.dtype).view(-1, *[1] * (dy.dim() - 1))
        return _weight_grad(self.module, accurate(self.x), scaled, self.module.groups, self.shape)

    def _masked(self, keep: torch.Tensor) -> ConvWeightGrads:
        return ConvWeightGrads(self.module, zeroed(self.x, keep), zeroed(self.dy, keep))

    def held_extra_values(self) -> int | None:
        """Kept where smaller than the feature maps, or where the norm instantiates them anyway (a depthwise
        7 x 7 convolution over a small map: keeping them saves the clipped sum's second weight-gradient
        pass). Elsewhere not: a batch-grouped per-example convolution is slower on CPU than the second pass
        it would save."""
        extra = self.batch_size * (self.shape.numel() - self.x[0].numel() - self.dy[0].numel())
        return extra if extra <= 0 or self.norm_method("auto") == "instantiate" else None

    def _release_factors(self) -> None:
        self.x = self.dy = None  # type: ignore[assignment]

    def norm_sq(self, mode: NormMode = "auto") -> torch.Tensor:
        method = self.norm_method(mode)
        return super().norm_sq() if method == "instantiate" else self.ghost_norm_sq(self.dy, method)

    @property
    def has_outer_form(self) -> bool:
        """Ungrouped 1-D and 2-D convolutions: :meth:`outer`, one factor pair for all output channels."""
        return self.has_ghost_form and self.module.groups == 1

    def dot(self, other: PerExampleGrad) -> torch.Tensor:
        if self.has_outer_form and (not isinstance(other, ConvWeightGrads) or other.has_outer_form):
            return self.outer().dot(other.outer() if isinstance(other, ConvWeightGrads) else other)
        return super().dot(other)


@register_rule(*CONVOLUTIONS, check=check_conv)
def conv_grads(module: _ConvNd, x: torch.Tensor, dy: torch.Tensor) -> dict[str, PerExampleGrad]:
    grads: dict[str, PerExampleGrad] = {"weight": ConvWeightGrads(module, x, dy)}
    if module.bias is not None:
        grads["bias"] = Dense(dy.flatten(2).sum(2))
    return grads
