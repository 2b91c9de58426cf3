"""Generic layers that dpexp models use and the privacy engine has exact rules for."""

from __future__ import annotations

import torch
from torch import nn


def weight_standardization(weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Weight standardisation (Qiao et al. 2019), per output channel: ``(w_hat, s)``.

    ``weight`` has shape (C_out, ...); each row w (flattened, p entries) becomes ``w_hat = (w - mean(w)) / s``
    with ``s = sqrt(var(w) + eps)`` and the population variance. Shapes: ``w_hat`` (C_out, p), ``s``
    (C_out, 1). The variance is the mean of the squared centred row (two passes; on CPU ``Tensor.var``
    over rows is ~6x slower).
    """
    flat = weight.flatten(1)
    centred = flat - flat.mean(dim=1, keepdim=True)
    s = torch.sqrt(centred.square().mean(dim=1, keepdim=True) + eps)
    return centred / s, s


def standardize_weight(weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The standardised weight ``w_hat`` of :func:`weight_standardization`, in ``weight``'s shape."""
    return weight_standardization(weight, eps)[0].view_as(weight)


class WSConv2d(nn.Conv2d):
    """Conv2d with weight standardisation, used with GroupNorm in the DP WRN of De et al. (2022).

    The raw ``weight`` is the trainable parameter; the convolution uses ``standardize_weight(weight)``.
    Its per-example gradient is therefore the vector-Jacobian product of the standardisation applied to
    the per-example gradient of the standardised weight, not the plain convolution gradient.
    """

    def __init__(self, *args, eps: float = 1e-5, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # through nn.Conv2d's own path, which applies a padding_mode other than zeros
        return self._conv_forward(x, standardize_weight(self.weight, self.eps), self.bias)
