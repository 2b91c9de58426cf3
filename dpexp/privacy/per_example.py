"""Per-example gradients of one parameter, kept in factored form.

Every layer rule (``dpexp.privacy.rules``) describes the per-example gradients of a parameter for one use of
the layer as one of these objects. The three operations the clipping engine needs are the same for every
layer type and live here:

* ``norm_sq()``: the squared per-example norms ``||g_i||^2``, shape (B,);
* ``dot(other)``: the per-example inner products ``<g_i, g'_i>`` of two uses of one shared parameter
  (e.g. GPT-2's tied ``wte``/``lm_head``), shape (B,);
* ``weighted_sum(c)``: ``sum_i c_i g_i`` in the parameter's shape, the clipped sum when ``c_i`` are the
  clipping factors.

:class:`Outer` is the book-keeping form of Bu et al. (2023, Algorithm 1): a linear layer's per-example
gradient is ``g_i = sum_t left_{i,t} (x) right_{i,t}``. Its norm is computed either by the ghost norm
(Goodfellow 2015; Li et al. 2022, eq. 2): ``||g_i||^2 = <L_i L_i^T, R_i R_i^T>`` in O(T^2) memory, or by
instantiating ``g_i``; ``mode="auto"`` picks the cheaper one per layer, as BK-MixOpt does (Bu et al. section
3.2). BK-MixOpt compares the two by space (ghost iff ``2 T^2 < L R``); we compare them by time, the
quantity the benchmark measures: the ghost norm costs ``T^2 (L + R)`` multiply-adds per example, instantiation
``T L R`` (:func:`ghost_is_cheaper`), and instantiation is only allowed while its memory stays within 4x of
the ghost norm's. The two rules agree on long sequences with wide layers (ghost) and on
large feature maps with few channels (instantiation); in between, e.g. a 16x16 map with 128 channels, the
space rule picks the ghost norm at twice the cost of instantiation. Either way the memory stays O(B T^2)
or O(B L R) for one layer at a time, and both forms are exact.
"""

from __future__ import annotations

import copy
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

import torch

NormMode = Literal["auto", "ghost", "instantiate"]


def joined(chunks: list[torch.Tensor]) -> torch.Tensor:
    """Chunks of examples as one (B, ...) tensor (a single chunk as it is, without a copy)."""
    return chunks[0] if len(chunks) == 1 else torch.cat(chunks)


def accurate(x: torch.Tensor) -> torch.Tensor:
    """Half-precision factors promoted to float32 (exactly): norms, instantiations and clipped sums are all
    formed from them in float32.

    Under autocast the factors are bf16 (a layer's saved input may stay float32). A clipped sum formed in
    bf16, as autograd forms the non-private weight gradient, rounds the factor ``c_i`` and each scaled
    value (relative error 2^-8 each) and the sum itself: one example's released contribution then measured
    up to 1.0026 C against the float32 norm (GPT-2, OPT, RoBERTa, ViT; ``scripts/device_oracle.py``), an
    under-clipping the accountant does not know of. In float32 the contribution is ``c_i g_i`` of the very
    ``g_i`` that was normed, up to float32 rounding."""
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x


def _accurate_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype :func:`accurate` gives ``x``, without converting it."""
    return torch.promote_types(x.dtype, torch.float32)


def zeroed(x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """``x`` (B, ...) with the rows of the examples where ``keep`` (B,) is false set to 0, not scaled by 0
    (``0 * inf`` is NaN)."""
    return torch.where(keep.view(-1, *[1] * (x.dim() - 1)), x, 0)


def _coef(coef: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Clipping factors (float64 from the norms) in the dtype the products are formed in, never below
    float32 (a bf16 factor would be rounded by up to 2^-8, relatively)."""
    return coef.to(_accurate_dtype(like))


class PerExampleGrad(ABC):
    """Per-example gradients ``g_1..g_B`` of one parameter (of shape ``shape``) from one use of a layer.

    When the clipped sum follows right away (fused per-layer clipping), :meth:`retain` keeps per-example
    gradients that were instantiated for the norm, and the sum becomes ``tensordot(c, g)`` instead of a second
    pass over the layer's activations. ``retain(release=True)`` also drops the factors once the gradients are
    instantiated: worth it in flat clipping, where a layer waits for the whole backward pass, when the
    per-example gradients are smaller than the activation and output gradient they are formed from (e.g. a
    convolution with few channels on a large feature map) or the extra values fit the engine's budget
    (:meth:`held_extra_values`).
    """

    shape: torch.Size
    _retain: bool = False
    _release: bool = False
    _max_kept: int = 0
    _kept: list[torch.Tensor] | None = None  # the instantiation's chunks (examples in order), once retained

    @property
    @abstractmethod
    def batch_size(self) -> int: ...

    @abstractmethod
    def instantiate(self) -> torch.Tensor:
        """All per-example gradients, shape (B, *shape)."""

    def instantiate_chunks(self) -> list[torch.Tensor]:
        """:meth:`instantiate` as consecutive chunks of examples, shapes (B_k, *shape) with ``sum B_k = B``,
        where the rule forms them in chunks anyway: norms and sums then read the chunks, and no
        concatenated copy is ever written (for a WRN stage-2 convolution at B = 64, 38 MB a layer)."""
        return [self.instantiate()]

    @abstractmethod
    def _weighted_sum(self, coef: torch.Tensor) -> torch.Tensor:
        """``sum_i coef_i g_i`` computed from the factors."""

    @abstractmethod
    def _masked(self, keep: torch.Tensor) -> PerExampleGrad:
        """The same per-example gradients with those of the examples where ``keep`` (B,) is false zeroed in
        the factors (:func:`zeroed`), shapes unchanged."""

    def retain(self, release: bool = False, max_values: int = 0) -> None:
        """Keep instantiated per-example gradients for :meth:`weighted_sum` (costs B x |param| memory);
        with ``release``, drop the factors once they are instantiated (no cross term may follow).
        ``max_values`` bounds the B x |param| values of an instantiation made only to be kept
        (:meth:`Outer.retained_instantiation_fits`)."""
        self._retain, self._release, self._max_kept = True, release, max_values

    def held_extra_values(self) -> int | None:
        """Values held beyond the factors if the per-example gradients replace them until the group finishes
        (negative: fewer); None where that does not pay (no factors, or an instantiation slower than the
        second pass it saves)."""
        return None

    def _release_factors(self) -> None:
        """Drop the references to the activation and output gradient (see :meth:`retain`)."""
        return None  # explicit per-example gradients have no factors

    def per_example_chunks(self) -> list[torch.Tensor]:
        """:meth:`instantiate_chunks`, remembered after :meth:`retain`."""
        if self._kept is not None:
            return self._kept
        chunks = self.instantiate_chunks()
        if self._retain:
            self._kept = chunks
            if self._release:
                self._release_factors()
        return chunks

    def weighted_sum(self, coef: torch.Tensor) -> torch.Tensor:
        """``sum_i coef_i g_i``, shape ``shape``; ``coef`` has shape (B,)."""
        if self._kept is None:
            return self._weighted_sum(coef)
        coefs = _coef(coef, self._kept[0]).split([len(chunk) for chunk in self._kept])
        return sum(
            torch.tensordot(c, accurate(chunk), dims=1) for c, chunk in zip(coefs, self._kept, strict=True)
        )

    def masked(self, keep: torch.Tensor) -> PerExampleGrad:
        """The examples where ``keep`` (B,) is false set to zero: the clipper drops an example whose norm is
        not finite this way, since multiplying it by 0 could still give NaN (``0 * inf``). Shapes do not
        depend on ``keep``, so nothing waits for the device."""
        if self._kept is not None:
            return Dense(zeroed(joined(self._kept), keep))
        return self._masked(keep)

    def norm_sq(self, mode: NormMode = "auto") -> torch.Tensor:
        """``||g_i||^2`` for each example, shape (B,) (a fused reduction per chunk: no squared temporary)."""
        return joined(
            [
                torch.linalg.vector_norm(accurate(chunk).reshape(len(chunk), -1), dim=1).square()
                for chunk in self.per_example_chunks()
            ]
        )

    def dot(self, other: PerExampleGrad) -> torch.Tensor:
        """``<g_i, g'_i>`` for each example, shape (B,): the cross term of a parameter used twice."""
        a, b = accurate(self.instantiate()), accurate(other.instantiate())
        return (a.reshape(len(a), -1) * b.reshape(len(b), -1)).sum(1)  # (B,): a scalar parameter's too


class Dense(PerExampleGrad):
    """Per-example gradients that are cheap to hold explicitly (biases, normalisation weights)."""

    def __init__(self, grads: torch.Tensor) -> None:
        self.grads = grads
        self.shape = grads.shape[1:]

    @property
    def batch_size(self) -> int:
        return self.grads.shape[0]

    def instantiate(self) -> torch.Tensor:
        return self.grads

    def _weighted_sum(self, coef: torch.Tensor) -> torch.Tensor:
        return torch.tensordot(_coef(coef, self.grads), accurate(self.grads), dims=1)

    def _masked(self, keep: torch.Tensor) -> Dense:
        return Dense(zeroed(self.grads, keep))


class OneHot(PerExampleGrad):
    """``g_i = value_i e_{index_i}``: one coordinate per example (the audit's Dirac gradient canaries,
    Steinke et al. 2023, section 6); ``index`` and ``value`` have shape (B,), indices into the flattened
    parameter."""

    def __init__(self, index: torch.Tensor, value: torch.Tensor, shape: torch.Size) -> None:
        self.index, self.value, self.shape = index, value, torch.Size(shape)

    @property
    def batch_size(self) -> int:
        return self.index.shape[0]

    def instantiate(self) -> torch.Tensor:
        out = self.value.new_zeros(self.batch_size, self.shape.numel())
        out[torch.arange(self.batch_size, device=self.index.device), self.index] = self.value
        return out.view(self.batch_size, *self.shape)

    def _weighted_sum(self, coef: torch.Tensor) -> torch.Tensor:
        value = _coef(coef, self.value) * accurate(self.value)
        return value.new_zeros(self.shape.numel()).index_add_(0, self.index, value).view(self.shape)

    def norm_sq(self, mode: NormMode = "auto") -> torch.Tensor:
        return accurate(self.value).square()

    def _masked(self, keep: torch.Tensor) -> OneHot:
        return OneHot(self.index, zeroed(self.value, keep), self.shape)


class Outer(PerExampleGrad):
    """``g_i = sum_t left_{i,t} (x) right_{i,t}``, an (L, R) matrix reshaped (C order) to ``shape``.

    ``left`` is either dense, shape (B, T, L), or an index tensor of shape (B, T) standing for one-hot rows of
    width L (the gradient of an embedding table). ``right`` is dense, shape (B, T, R).
    """

    def __init__(self, left: torch.Tensor, right: torch.Tensor, shape: torch.Size, left_size: int) -> None:
        self.left, self.right, self.shape, self.left_size = left, right, torch.Size(shape), left_size
        self.is_index = not left.is_floating_point()
        self._batch_size = right.shape[0]

    @property
    def batch_size(self) -> int:
        return self._batch_size

    def instantiate(self) -> torch.Tensor:
        b, _, r = self.right.shape
        if self.is_index:
            flat = (self.left + self.left_size * torch.arange(b, device=self.left.device)[:, None]).flatten()
            right = accurate(self.right)
            out = right.new_zeros(b * self.left_size, r).index_add_(0, flat, right.reshape(-1, r))
            return out.view(b, *self.shape)
        left, right = accurate(self.left), accurate(self.right)
        return torch.einsum("btl,btr->blr", left, right).reshape(b, *self.shape)

    def _weighted_sum(self, coef: torch.Tensor) -> torch.Tensor:
        r = self.right.shape[-1]
        if self.is_index:
            right = accurate(self.right) * _coef(coef, self.right)[:, None, None]
            out = right.new_zeros(self.left_size, r).index_add_(0, self.left.flatten(), right.reshape(-1, r))
            return out.view(self.shape)
        left, right = accurate(self.left), accurate(self.right)
        scale = _coef(coef, left)[:, None, None]
        if left.shape[-1] < r:  # scale the narrower factor
            left = left * scale
        else:
            right = right * scale
        return (left.reshape(-1, left.shape[-1]).T @ right.reshape(-1, r)).view(self.shape)

    def _masked(self, keep: torch.Tensor) -> Outer:
        left = self.left if self.is_index else zeroed(self.left, keep)  # indices: their rows' values are 0
        return Outer(left, zeroed(self.right, keep), self.shape, self.left_size)

    def ghost_is_cheaper(self) -> bool:
        t, r = self.right.shape[1], self.right.shape[-1]
        if self.is_index:  # one-hot rows: the Gram is a comparison, instantiation a scatter into (L, R)
            table = self.left_size * r
            return t * t * (1 + r) < t * r + table or table > 8 * t * t
        return ghost_is_cheaper(t, self.left_size, r)

    def held_extra_values(self) -> int | None:
        """``B (L R - T (L + R))`` where keeping pays: where the per-example gradients are smaller than the
        factors, or where instantiating them (``T L R``) and the ``tensordot`` beat the ghost norm's
        ``T^2 (L + R)`` plus the clipped sum's matmul (``T L R``). A per-example gradient larger than a core's
        cache (:data:`CACHED_VALUES`) is written out at memory speed, about :data:`WRITE_COST` multiply-adds
        per value. Measured on CPU: RoBERTa-sized 256 x 1024 layers (B = 16, T = 128) are kept (0.47x the
        time of the ghost norm plus matmul); an untied GPT-2 small head (T = 100, 768 x 50257, B = 4) takes
        the ghost norm (0.50 s against 0.82 s, and 0.6 GB less held until the input layer)."""
        if self.is_index:
            return None
        t, r = self.right.shape[1], self.right.shape[-1]
        values = self.left_size * r
        extra = self.batch_size * (values - t * (self.left_size + r))
        write_bound = values > CACHED_VALUES and t * t * (self.left_size + r) <= WRITE_COST * values
        return extra if extra <= 0 or not write_bound else None

    def retained_instantiation_fits(self) -> bool:
        """Whether instantiating for a fused clipped sum holds at most 4x the layer's own activation and
        output gradient (``L R <= 4 T (L + R)`` values per example, which autograd keeps anyway) and at most
        the ``max_values`` given to :meth:`retain` (``B L R``; the engine allows one more parameter-sized
        tensor, which keeps e.g. an untied 50k-vocabulary LM head on the ghost norm)."""
        t, r = self.right.shape[1], self.right.shape[-1]
        values = self.left_size * r
        return (
            not self.is_index
            and values <= 4 * t * (self.left_size + r)
            and self.batch_size * values <= self._max_kept
        )

    def _release_factors(self) -> None:
        self.left = self.right = None  # type: ignore[assignment]

    def norm_sq(self, mode: NormMode = "auto") -> torch.Tensor:
        """Ghost or instantiated by cost in ``auto`` mode. Instantiated if the factors are to be released, and
        for a retained (fused per-layer) gradient whenever that fits: its sum is then ``tensordot(c, g)``
        (``B L R``), whereas the ghost norm still needs the clipped sum's matmul (``B T L R``) on top of its
        own ``T^2 (L + R)``."""
        if mode == "auto" and (self._release or (self._retain and self.retained_instantiation_fits())):
            return super().norm_sq()
        if mode == "instantiate" or (mode == "auto" and not self.ghost_is_cheaper()):
            return super().norm_sq()
        return self._ghost_dot(self)

    def dot(self, other: PerExampleGrad) -> torch.Tensor:
        if isinstance(other, Outer) and other.left_size == self.left_size:
            return self._ghost_dot(other)
        return super().dot(other)

    def _ghost_dot(self, other: Outer) -> torch.Tensor:
        """``sum_{t,s} <l_t, l'_s> <r_t, r'_s>`` per example (Li et al. 2022, eq. 2, with two factors)."""
        right_gram = torch.bmm(accurate(self.right), accurate(other.right).transpose(1, 2))
        return (_left_gram(self, other, right_gram.dtype) * right_gram).sum((1, 2))


@dataclass
class _Pairs:
    """:class:`Routed`'s rows grouped by (example, expert) pair, pairs largest first."""

    sizes: list[int]  # rows of each pair (on the host: chunk sizes and padding)
    example: torch.Tensor  # (P,) each pair's example
    expert: torch.Tensor  # (P,) each pair's expert
    row_rank: torch.Tensor  # (n,) the rank of each row's pair
    position: torch.Tensor  # (n,) each row's position within its pair
    order: torch.Tensor  # (n,) the rows in pair order


class Routed(PerExampleGrad):
    """A mixture-of-experts weight W (E, L, R): ``G_i[e] = sum_r left_r (x) right_r`` over the rows r of
    example i routed to expert e, one row per (token, slot) of top-k routing (Shazeer et al. 2017; Outer's
    factorisation, Bu et al. 2023, eq. 2, expert by expert). A bias (E, R) is the case L = 1 with
    ``left_r = 1``: ``G_i[e] = sum_r right_r``.

    ``left`` (n, L) and ``right`` (n, R) are the rows' factors, ``expert`` and ``example`` (n,) their expert
    and example; rows are kept sorted by (expert, example). The norm groups the rows by *pair* (example,
    expert): pair p's block of the gradient is ``L_p^T R_p``, its squared norm the ghost norm
    ``<L_p L_p^T, R_p R_p^T>`` (``m^2 (L + R)`` for m rows) or ``||L_p^T R_p||^2`` instantiated (``m L R``),
    whichever is cheaper (:func:`ghost_is_cheaper` at m), i.e. the masked Gram
    ``sum_{r,r'} [e_r = e_r'] <l_r, l_r'> <x_r, x_r'>`` without the E-fold waste of masking. Pairs are
    padded to the longest of their chunk (sorted by size, so the padding stays small) and processed in
    chunks that hold at most the factors' own ``n (L + R)`` values (or one pair); no dense one-hot (E L)
    factor is formed. The clipped sum is one matmul per expert over its rows scaled by their examples'
    factors, ``n L R``: what the non-private weight gradient costs. Nothing is retained (no
    :meth:`held_extra_values`): the sum is formed from the factors.
    """

    def __init__(
        self,
        left: torch.Tensor,
        right: torch.Tensor,
        expert: torch.Tensor,
        example: torch.Tensor,
        batch_size: int,
        shape: torch.Size | tuple[int, ...],
        experts: int | None = None,
    ) -> None:
        """``shape`` is the weight's; ``experts``: E, where it is not ``shape[0]`` (DBRX stores its experts'
        weights stacked as (E L, R))."""
        self.shape, self._batch_size = torch.Size(shape), batch_size
        self.experts = self.shape[0] if experts is None else experts
        key = expert * batch_size + example
        self._order: torch.Tensor | None = None  # the permutation that sorted the rows given, if any
        if key.numel() > 1 and not bool((key[1:] >= key[:-1]).all()):
            self._order = order = torch.argsort(key, stable=True)
            left, right, expert, example, key = (
                left[order],
                right[order],
                expert[order],
                example[order],
                key[order],
            )
        self.left, self.right, self.expert, self.example = left, right, expert, example
        self.counts = torch.bincount(key, minlength=self.experts * batch_size)  # rows per (expert, example)
        self._routing: dict[str, _Pairs] = {}  # the pairs, once computed; shared with siblings

    def sibling(self, left: torch.Tensor, right: torch.Tensor, shape: torch.Size | tuple[int, ...]) -> Routed:
        """Another weight's gradient in the same call (``down_proj`` beside ``gate_up_proj``): rows in the
        order given to this one's constructor, the same routing, whose pairs are then grouped once."""
        if self._order is not None:
            left, right = left[self._order], right[self._order]
        other = copy.copy(self)
        other.left, other.right, other.shape = left, right, torch.Size(shape)
        return other

    @property
    def batch_size(self) -> int:
        return self._batch_size

    def _pairs(self) -> _Pairs:
        """The (example, expert) pairs that have rows, largest first (computed once)."""
        if "pairs" not in self._routing:
            keys = self.counts.nonzero().squeeze(1)
            sizes = self.counts[keys]
            device = sizes.device
            row_pair = torch.repeat_interleave(torch.arange(len(keys), device=device), sizes)
            position = torch.arange(len(row_pair), device=device) - (sizes.cumsum(0) - sizes)[row_pair]
            by_size = torch.argsort(sizes, descending=True, stable=True)
            rank = torch.empty_like(by_size)
            rank[by_size] = torch.arange(len(by_size), device=device)
            row_rank = rank[row_pair]
            keys = keys[by_size]
            self._routing["pairs"] = _Pairs(
                sizes[by_size].tolist(),
                keys % self.batch_size,
                keys // self.batch_size,
                row_rank,
                position,
                torch.argsort(row_rank, stable=True),
            )
        return self._routing["pairs"]

    def _pair_blocks(self, mode: NormMode) -> Iterator[tuple[slice, torch.Tensor, torch.Tensor, bool]]:
        """Chunks of pairs (a slice of the largest-first order) with their rows padded to the chunk's
        longest, ``(pairs, m, L)`` and ``(pairs, m, R)``, and whether the chunk takes the ghost norm."""
        pairs = self._pairs()
        sizes, row_rank, position, order = pairs.sizes, pairs.row_rank, pairs.position, pairs.order
        left_size, right_size = self.left.shape[1], self.right.shape[1]
        budget = len(order) * (left_size + right_size)
        starts = [0]
        for size in sizes:
            starts.append(starts[-1] + size)
        first = 0
        while first < len(sizes):
            m = sizes[first]
            ghost = mode == "ghost" or (mode == "auto" and ghost_is_cheaper(m, left_size, right_size))
            per_pair = m * (left_size + right_size) + (2 * m * m if ghost else left_size * right_size)
            last = min(len(sizes), first + max(1, budget // per_pair))
            rows = order[starts[first] : starts[last]]
            at = (row_rank[rows] - first, position[rows])
            padded = []
            for factor in (self.left, self.right):
                block = factor.new_zeros(last - first, m, factor.shape[1])
                block[at] = factor[rows]
                padded.append(block)
            yield slice(first, last), padded[0], padded[1], ghost
            first = last

    def norm_sq(self, mode: NormMode = "auto") -> torch.Tensor:
        """``||G_i||^2 = sum_e ||G_i[e]||^2``, pair by pair (ghost or instantiated, see the class)."""
        example = self._pairs().example
        out = None
        for chunk, left, right, ghost in self._pair_blocks(mode):
            left, right = accurate(left), accurate(right)
            if ghost:
                grams = torch.bmm(left, left.transpose(1, 2)) * torch.bmm(right, right.transpose(1, 2))
                value = grams.sum((1, 2))
            else:
                blocks = torch.bmm(left.transpose(1, 2), right)
                value = torch.linalg.vector_norm(blocks.flatten(1), dim=1).square()
            if out is None:
                out = value.new_zeros(self.batch_size)
            out.index_add_(0, example[chunk], value)
        return accurate(self.left.new_zeros(self.batch_size)) if out is None else out

    @property
    def _blocks(self) -> tuple[int, int, int]:
        """(E, L, R): the weight as its factors make it (a bias (E, R) is (E, 1, R), its left factor 1)."""
        return self.experts, self.left.shape[1], self.right.shape[1]

    def instantiate(self) -> torch.Tensor:
        pairs = self._pairs()
        out = self.right.new_zeros(self.batch_size, *self._blocks, dtype=_accurate_dtype(self.right))
        for chunk, block_left, block_right, _ in self._pair_blocks("instantiate"):
            out[pairs.example[chunk], pairs.expert[chunk]] = torch.bmm(
                accurate(block_left).transpose(1, 2), accurate(block_right)
            )
        return out.view(self.batch_size, *self.shape)

    def _weighted_sum(self, coef: torch.Tensor) -> torch.Tensor:
        """``sum_i c_i G_i``: per expert, its rows (contiguous) scaled by their examples' ``c_i``."""
        left, right = accurate(self.left), accurate(self.right)
        scale = _coef(coef, left)[self.example][:, None]
        if left.shape[1] < right.shape[1]:  # scale the narrower factor
            left = left * scale
        else:
            right = right * scale
        out = left.new_zeros(self._blocks)
        per_expert = self.counts.view(self.experts, self.batch_size).sum(1).tolist()
        for e, (rows_left, rows_right) in enumerate(
            zip(left.split(per_expert), right.split(per_expert), strict=True)
        ):
            if len(rows_left):
                out[e] = rows_left.T @ rows_right
        return out.view(self.shape)

    def _masked(self, keep: torch.Tensor) -> Routed:
        rows = keep[self.example]  # rows already sorted: the same routing and pairs
        other = copy.copy(self)
        other.left, other.right = zeroed(self.left, rows), zeroed(self.right, rows)
        return other

    def dot(self, other: PerExampleGrad) -> torch.Tensor:
        """``<G_i, G'_i> = (||G_i + G'_i||^2 - ||G_i||^2 - ||G'_i||^2) / 2`` for another use of the same
        weight (a layer called twice), the sum's rows being both uses' rows: no instantiation."""
        if not (
            isinstance(other, Routed) and other.shape == self.shape and other.batch_size == self.batch_size
        ):
            return super().dot(other)
        both = Routed(
            *(torch.cat(pair) for pair in zip(self._factors(), other._factors(), strict=True)),
            self.batch_size,
            self.shape,
            self.experts,
        )
        return (both.norm_sq() - self.norm_sq() - other.norm_sq()) / 2

    def _factors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.left, self.right, self.expert, self.example


CACHED_VALUES = 2**20
"""Values of one per-example gradient (4 MB in float32) beyond which its instantiation is bound by writing it
out: on CPU, 256 x 1024 layers are instantiated at the matmul's speed, 768 x 3072 ones at half of it."""
WRITE_COST = 100
"""Multiply-adds that writing one value of such a per-example gradient costs: on CPU, 768 x 3072 layers at
T = 64..512 were instantiated at 21-38 G multiply-adds/s against 47 for the sum's matmul over B T, i.e.
``T L R + ~100 L R``."""


def ghost_is_cheaper(t: int, left: int, right: int) -> bool:
    """Ghost norm ``T^2 (L + R)`` vs instantiation ``T L R`` multiply-adds per example; instantiation is also
    ruled out when its ``L R`` values per example exceed 4x the ghost norm's ``2 T^2``."""
    return t * (left + right) < left * right or left * right > 8 * t * t


def _left_gram(a: Outer, b: Outer, dtype: torch.dtype) -> torch.Tensor:
    """``<l_t, l'_s>`` for all t, s, shape (B, T, T'), with one-hot (index) factors handled sparsely."""
    if a.is_index and b.is_index:
        return (a.left[:, :, None] == b.left[:, None, :]).to(dtype)
    if a.is_index:  # <e_{idx_t}, l'_s> = l'_s[idx_t]
        return (
            torch.gather(accurate(b.left), 2, a.left[:, None, :].expand(-1, b.left.shape[1], -1))
            .transpose(1, 2)
            .to(dtype)
        )
    if b.is_index:
        return _left_gram(b, a, dtype).transpose(1, 2)
    return torch.bmm(accurate(a.left), accurate(b.left).transpose(1, 2)).to(dtype)
