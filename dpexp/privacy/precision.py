"""How closely two exact computations of the same value agree in a given floating-point precision."""

from __future__ import annotations

import torch

_TOLERANCE = {torch.float64: 1e-9, torch.float32: 1e-4}
_LOW_PRECISION_TOLERANCE = 3e-2  # bfloat16 / float16 (autocast)


def tolerance(dtype: torch.dtype) -> float:
    """Relative agreement expected between two exact computations of the same value in ``dtype``."""
    return _TOLERANCE.get(dtype, _LOW_PRECISION_TOLERANCE)
