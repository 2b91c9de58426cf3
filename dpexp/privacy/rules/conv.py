"""``nn.Conv1d`` and ``nn.Conv2d`` as linear layers over unfolded patches (Bu et al. 2023, section 3.1).

With ``a_{i,t}`` the t-th input patch (C_in * k_h * k_w values, ``F.unfold``) and ``dy_{i,t}`` the output
gradient at position t, ``dW_i = sum_t dy_{i,t} (x) a_{i,t}``; T is the number of output positions.

Only the ghost norm needs the unfolded patches (and it is only chosen where it is cheaper, i.e. deep layers
with small feature maps). Everything else runs on the convolution's own backward kernel, as non-private
training
does: the clipped sum ``sum_i c_i dW_i`` is the weight gradient for output gradients ``c_i dy_i``, and the
per-example gradients are the weight gradient of the same convolution with the batch folded into the
channels (``groups = B``), which avoids materialising the (B, T, p) patch tensor.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dpexp.privacy.per_example import Dense, NormMode, Outer, PerExampleGrad, ghost_is_cheaper
from dpexp.privacy.rules import register_rule


def check_conv(module: nn.Conv1d | nn.Conv2d) -> None:
    if module.groups != 1:
        raise ValueError(
            f"{module!r}: grouped convolutions (groups={module.groups}) have no privacy rule yet."
        )
    if module.padding_mode != "zeros" or isinstance(module.padding, str):
        raise ValueError(
            f"{module!r}: only numeric zero padding is supported; give padding as numbers "
            "(e.g. padding=1 instead of 'same') and padding_mode='zeros'."
        )


def unfold_patches(module: nn.Conv1d | nn.Conv2d, x: torch.Tensor) -> torch.Tensor:
    """Input patches, shape (B, T, C_in * prod(kernel)), in the order of ``weight.flatten(1)``."""
    if isinstance(module, nn.Conv1d):  # a 1-D signal is an image of height 1
        x = x.unsqueeze(2)
        kernel, dilation = (1, module.kernel_size[0]), (1, module.dilation[0])
        padding, stride = (0, module.padding[0]), (1, module.stride[0])
    else:
        kernel, dilation, padding, stride = module.kernel_size, module.dilation, module.padding, module.stride
    return F.unfold(x, kernel, dilation=dilation, padding=padding, stride=stride).transpose(1, 2)


def _weight_grad(
    module: nn.Conv1d | nn.Conv2d, x: torch.Tensor, dy: torch.Tensor, groups: int, shape
) -> torch.Tensor:
    """The convolution's weight gradient for input ``x`` and output gradient ``dy`` (native kernel)."""
    weight = dy.new_zeros(1).as_strided(shape, (0,) * len(shape))  # only its shape is read
    x = x.to(dy.dtype)
    return torch.ops.aten.convolution_backward(
        dy, x, weight, None, module.stride, module.padding, module.dilation, False,
        [0] * len(module.stride), groups, [False, True, False],
    )[1]  # fmt: skip


class ConvWeightGrads(PerExampleGrad):
    """Per-example gradients of a convolution's weight, from its input ``x`` and output gradient ``dy``."""

    def __init__(self, module: nn.Conv1d | nn.Conv2d, x: torch.Tensor, dy: torch.Tensor) -> None:
        self.module, self.x, self.dy, self.shape = module, x, dy, module.weight.shape
        self._batch_size = dy.shape[0]

    @property
    def batch_size(self) -> int:
        return self._batch_size

    def outer(self) -> Outer:
        """The book-keeping form over unfolded patches (for the ghost norm)."""
        g = self.dy.flatten(2).transpose(1, 2)  # (B, T, C_out)
        return Outer(g, unfold_patches(self.module, self.x), self.shape, g.shape[-1])

    def ghost_is_cheaper(self) -> bool:
        c_out = self.shape[0]
        return ghost_is_cheaper(self.dy[0].numel() // c_out, c_out, self.shape.numel() // c_out)

    def instantiate(self) -> torch.Tensor:
        b, c_out = self.dy.shape[:2]
        x = self.x.reshape(1, -1, *self.x.shape[2:])
        dy = self.dy.reshape(1, -1, *self.dy.shape[2:])
        grads = _weight_grad(self.module, x, dy, b, (b * c_out, *self.shape[1:]))
        return grads.view(b, *self.shape)

    def _weighted_sum(self, coef: torch.Tensor) -> torch.Tensor:
        scaled = self.dy * coef.to(self.dy.dtype).view(-1, *[1] * (self.dy.dim() - 1))
        return _weight_grad(self.module, self.x, scaled, 1, self.shape)

    def held_extra_values(self) -> int | None:
        """Kept only where smaller than the feature maps: a batch-grouped per-example convolution is slower on
        CPU than the second weight-gradient pass it would save."""
        extra = self.batch_size * (self.shape.numel() - self.x[0].numel() - self.dy[0].numel())
        return extra if extra <= 0 else None

    def _release_factors(self) -> None:
        self.x = self.dy = None  # type: ignore[assignment]

    def uses_ghost_norm(self, mode: NormMode) -> bool:
        """Ghost norm when forced, or in ``auto`` mode when cheaper and the factors are not to be released."""
        return mode == "ghost" or (mode == "auto" and not self._release and self.ghost_is_cheaper())

    def norm_sq(self, mode: NormMode = "auto") -> torch.Tensor:
        if self.uses_ghost_norm(mode):
            return self.outer().norm_sq("ghost")
        return super().norm_sq()

    def dot(self, other: PerExampleGrad) -> torch.Tensor:
        return self.outer().dot(other.outer() if isinstance(other, ConvWeightGrads) else other)


@register_rule(nn.Conv1d, nn.Conv2d, check=check_conv)
def conv_grads(module: nn.Conv1d | nn.Conv2d, x: torch.Tensor, dy: torch.Tensor) -> dict[str, PerExampleGrad]:
    grads: dict[str, PerExampleGrad] = {"weight": ConvWeightGrads(module, x, dy)}
    if module.bias is not None:
        grads["bias"] = Dense(dy.flatten(2).sum(2))
    return grads
