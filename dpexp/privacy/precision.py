"""How closely two exact computations of the same value agree in a given floating-point precision."""

from __future__ import annotations

import torch
from torch import nn

_TOLERANCE = {torch.float64: 1e-9, torch.float32: 1e-4}
_TF32_TOLERANCE = 1e-2  # float32 products in TF32 (a 10-bit mantissa, unit roundoff 2^-11) on CUDA
_LOW_PRECISION_TOLERANCE = 3e-2  # bfloat16 / float16 (autocast)


def tolerance(dtype: torch.dtype, tf32: bool = False) -> float:
    """Relative agreement expected between two exact computations of the same value in ``dtype``; ``tf32``:
    float32 products may run in TF32 (:func:`runs_tf32`)."""
    if tf32 and dtype == torch.float32:
        return _TF32_TOLERANCE
    return _TOLERANCE.get(dtype, _LOW_PRECISION_TOLERANCE)


def runs_tf32(model: nn.Module, device: torch.device) -> bool:
    """Whether ``model``'s float32 products on ``device`` may run in TF32: on CUDA, cuBLAS' matrix products
    where ``torch.backends.cuda.matmul.allow_tf32`` is set (``torch.set_float32_matmul_precision("high")``),
    and cuDNN's convolutions and recurrent layers where ``torch.backends.cudnn.allow_tf32`` is (PyTorch's
    default) and the model holds one. Autograd's gradient of a parameter then differs from an exact sum of
    its per-example gradients by about 1e-3 of its size (measured on nn.LSTM / nn.GRU on an H200, stop 60)."""
    if device.type != "cuda":
        return False
    if torch.backends.cuda.matmul.allow_tf32:
        return True
    cudnn = (nn.modules.conv._ConvNd, nn.RNNBase)
    return torch.backends.cudnn.allow_tf32 and any(isinstance(m, cudnn) for m in model.modules())
