"""``nn.Conv1d`` and ``nn.Conv2d`` as linear layers over unfolded patches (Bu et al. 2023, section 3.1).

With ``a_{i,t}`` the t-th input patch (C_in * k_h * k_w values, ``F.unfold``) and ``dy_{i,t}`` the output
gradient at position t, ``dW_i = sum_t dy_{i,t} (x) a_{i,t}``; T is the number of output positions.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dpexp.privacy.per_example import Dense, Outer, PerExampleGrad
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


def conv_weight_grads(module: nn.Conv1d | nn.Conv2d, x: torch.Tensor, dy: torch.Tensor) -> Outer:
    g = dy.flatten(2).transpose(1, 2)  # (B, T, C_out)
    return Outer(g, unfold_patches(module, x), module.weight.shape, g.shape[-1])


@register_rule(nn.Conv1d, nn.Conv2d, check=check_conv)
def conv_grads(module: nn.Conv1d | nn.Conv2d, x: torch.Tensor, dy: torch.Tensor) -> dict[str, PerExampleGrad]:
    grads: dict[str, PerExampleGrad] = {"weight": conv_weight_grads(module, x, dy)}
    if module.bias is not None:
        grads["bias"] = Dense(dy.flatten(2).sum(2))
    return grads
