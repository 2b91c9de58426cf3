"""Where the examples are in a layer call's input and output gradient.

A rule reads example i from row i of dim 0 (batch-first). A position-wise rule (``LayerRule.position_wise``:
a layer that acts on every position alone, as a linear or normalisation layer) can also read two other
layouts, by a view of the same tensor:

* flattened, ``(b*T, ..., F)`` with example i's positions in rows ``[i*T, (i+1)*T)`` (OPT's MLP): folded to
  ``(b, T, ..., F)``;
* time-major, ``(T, b, ..., F)`` with example i in column i of dim 1 (``nn.TransformerEncoderLayer`` with
  ``batch_first=False``, Longformer's global attention): transposed to ``(b, T, ..., F)``.

Sizes only say which layouts are possible. Which one holds is a property of the code path that only the
engine's probe establishes (:mod:`dpexp.privacy.verification`); a time-major tensor with T = b, or a
time-major flattening ``(T*b, ...)``, has the shapes of another layout.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Layout:
    """``fold`` rows per example in dim 0 (1: batch-first), or (``time_major``) one column per example in dim
    1 of a tensor with positions in dim 0."""

    fold: int = 1
    time_major: bool = False

    def batch_first(self, t: torch.Tensor, batch_size: int) -> torch.Tensor:
        """``t`` as a (b, ...) view: unchanged, folded to (b, fold, ...), or with dims 0 and 1 swapped."""
        if self.time_major:
            return t.transpose(0, 1)
        return t.unflatten(0, (batch_size, self.fold)) if self.fold > 1 else t

    def describe(self) -> str:
        if self.time_major:
            return "time-major (examples in dim 1)"
        return "batch-first" if self.fold == 1 else f"{self.fold} rows per example, flattened into dim 0"


BATCH_FIRST = Layout()
TIME_MAJOR = Layout(time_major=True)
