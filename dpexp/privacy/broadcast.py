"""Inputs broadcast over the batch, made per-example.

Hugging Face's GPT-2 and BERT look up position embeddings with ids of batch size 1 and let broadcasting add
the result to every example, so the embedding's output gradient arrives already summed over the batch.
Clipping that sum as if it were one example's gradient would break the privacy guarantee (Li et al. 2022
and Opacus both hit this). :class:`BroadcastExpander` expands such inputs to the batch size before the
layer runs; the outputs are numerically identical, and each example's gradient stays its own.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn


class BroadcastExpander:
    """Records the batch size at the model's input and expands batch-size-1 inputs of ``layers`` to it.

    The batch size is the leading dimension of the first tensor argument of ``model.forward`` (batch-first
    inputs). ``active`` can switch the expansion off (e.g. while a layer is recomputed per example).
    """

    def __init__(
        self, model: nn.Module, layers: Iterable[nn.Module], active: Callable[[], bool] = lambda: True
    ):
        self.batch_size: int | None = None
        self._active = active
        self._handles = [model.register_forward_pre_hook(self._record, with_kwargs=True)]
        self._handles += [layer.register_forward_pre_hook(self._expand) for layer in layers]

    def _record(self, module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        first = next((t for t in (*args, *kwargs.values()) if torch.is_tensor(t) and t.dim() > 0), None)
        if first is not None and self._active():
            self.batch_size = first.shape[0]

    def _expand(self, module: nn.Module, args: tuple) -> tuple | None:
        b, x = self.batch_size, args[0]
        if (
            self._active()
            and b is not None
            and b > 1
            and torch.is_tensor(x)
            and x.dim() > 0
            and x.shape[0] == 1
        ):
            return (x.expand(b, *x.shape[1:]), *args[1:])
        return None

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
