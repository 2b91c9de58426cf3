"""Convolutions (``nn.Conv1d/2d/3d`` and ``nn.ConvTranspose1d/2d/3d``, any ``groups``) as linear layers over
patches (Bu et al. 2023, section 3.1).

With ``a_{i,t}`` the t-th input patch (C_in * prod(kernel) values, ``F.unfold``) and ``dy_{i,t}`` the output
gradient at position t, ``dW_i = sum_t dy_{i,t} (x) a_{i,t}``; T is the number of output positions.

Everything runs on the convolution's own backward kernel, as non-private training does: the clipped sum
``sum_i c_i dW_i`` is the weight gradient for output gradients ``c_i dy_i``, and the per-example gradients
are the weight gradient of the same convolution with the batch folded into the channels (``groups = B g``
for a convolution of g groups: example b's group j is group ``b g + j``), which avoids materialising the
(B, T, p) patch tensor. Grouped and depthwise convolutions (ConvNeXt, MobileNet, EfficientNet, ResNeXt) have
per-example gradients of only ``C_out * C_in / g * prod(kernel)`` values, which are instantiated.

Only the ghost norm needs the unfolded patches, and it is only chosen where it is cheaper (deep layers with
small feature maps); it is available for ungrouped 1-D and 2-D convolutions (``F.unfold`` has no 3-D or
transposed form), every other convolution instantiates its per-example gradients for the norm. Padding modes
other than zeros, and ``padding="same"``, are applied to the input explicitly, exactly as the module does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.conv import _ConvNd

from dpexp.privacy.per_example import Dense, NormMode, Outer, PerExampleGrad, ghost_is_cheaper
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


def unfold_patches(module: nn.Conv1d | nn.Conv2d, x: torch.Tensor) -> torch.Tensor:
    """Input patches, shape (B, T, C_in * prod(kernel)), in the order of ``weight.flatten(1)``."""
    x, padding = explicitly_padded(module, x)
    if isinstance(module, nn.Conv1d):  # a 1-D signal is an image of height 1
        x = x.unsqueeze(2)
        kernel, dilation = (1, module.kernel_size[0]), (1, module.dilation[0])
        padding, stride = (0, padding[0]), (1, module.stride[0])
    else:
        kernel, dilation, stride = module.kernel_size, module.dilation, module.stride
    return F.unfold(x, kernel, dilation=dilation, padding=padding, stride=stride).transpose(1, 2)


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
        """Ungrouped 1-D and 2-D convolutions: patches by ``F.unfold``."""
        return isinstance(self.module, nn.Conv1d | nn.Conv2d) and self.module.groups == 1

    def outer(self) -> Outer:
        """The book-keeping form over unfolded patches (for the ghost norm)."""
        g = self.dy.flatten(2).transpose(1, 2)  # (B, T, C_out)
        return Outer(g, unfold_patches(self.module, self.x), self.shape, g.shape[-1])

    def ghost_is_cheaper(self) -> bool:
        c_out = self.shape[0]
        return ghost_is_cheaper(self.dy[0].numel() // c_out, c_out, self.shape.numel() // c_out)

    def instantiate(self) -> torch.Tensor:
        b, groups = self.batch_size, self.module.groups
        x = self.x.reshape(1, -1, *self.x.shape[2:])
        dy = self.dy.reshape(1, -1, *self.dy.shape[2:])
        grads = _weight_grad(self.module, x, dy, b * groups, (b * self.shape[0], *self.shape[1:]))
        return grads.view(b, *self.shape)

    def _weighted_sum(self, coef: torch.Tensor) -> torch.Tensor:
        scaled = self.dy * coef.to(self.dy.dtype).view(-1, *[1] * (self.dy.dim() - 1))
        return _weight_grad(self.module, self.x, scaled, self.module.groups, self.shape)

    def _select(self, keep: torch.Tensor) -> ConvWeightGrads:
        return ConvWeightGrads(self.module, self.x[keep], self.dy[keep])

    def held_extra_values(self) -> int | None:
        """Kept only where smaller than the feature maps: a batch-grouped per-example convolution is slower on
        CPU than the second weight-gradient pass it would save."""
        extra = self.batch_size * (self.shape.numel() - self.x[0].numel() - self.dy[0].numel())
        return extra if extra <= 0 else None

    def _release_factors(self) -> None:
        self.x = self.dy = None  # type: ignore[assignment]

    def uses_ghost_norm(self, mode: NormMode) -> bool:
        """Ghost norm where the convolution has one, when forced or (``auto``) cheaper and the factors are not
        to be released."""
        if not self.has_ghost_form:
            return False
        return mode == "ghost" or (mode == "auto" and not self._release and self.ghost_is_cheaper())

    def norm_sq(self, mode: NormMode = "auto") -> torch.Tensor:
        if self.uses_ghost_norm(mode):
            return self.outer().norm_sq("ghost")
        return super().norm_sq()

    def dot(self, other: PerExampleGrad) -> torch.Tensor:
        if self.has_ghost_form and (not isinstance(other, ConvWeightGrads) or other.has_ghost_form):
            return self.outer().dot(other.outer() if isinstance(other, ConvWeightGrads) else other)
        return super().dot(other)


@register_rule(*CONVOLUTIONS, check=check_conv)
def conv_grads(module: _ConvNd, x: torch.Tensor, dy: torch.Tensor) -> dict[str, PerExampleGrad]:
    grads: dict[str, PerExampleGrad] = {"weight": ConvWeightGrads(module, x, dy)}
    if module.bias is not None:
        grads["bias"] = Dense(dy.flatten(2).sum(2))
    return grads
