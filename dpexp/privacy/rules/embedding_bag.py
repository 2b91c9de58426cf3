"""``nn.EmbeddingBag``: a bag of table rows per example, summed or averaged (``mode="sum"|"mean"``),
optionally weighted (``per_sample_weights``, sum mode).

Example i's output is ``y_i = sum_t w_{i,t} E[idx_{i,t}]``, so its per-example gradient of the table is
``sum_t e_{idx_{i,t}} (x) w_{i,t} dy_i``: the embedding's one-hot factored form (:mod:`.embedding`) with the
position gradients ``w_{i,t} dy_i``, and its norm is a ghost norm over the bag's indices. The bags come from
the call itself: rows of a 2-D input, or the ``offsets`` of a 1-D input (one bag per offset, the last one
closing the input unless ``include_last_offset``); bag b is output row b, which the engine's probe checks is
example b's. The call is recorded as a padded (B, L) index matrix with the weights ``w`` (B, L): the
per-sample weight in sum mode, 1 / (bag size) in mean mode, 0 for padding and for ``padding_idx`` entries
(excluded from the bag, and from its size). ``mode="max"`` sends each coordinate's gradient to a different
row and is refused, as are ``max_norm``, ``scale_grad_by_freq`` and sparse gradients.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from dpexp.privacy.per_example import Outer, PerExampleGrad
from dpexp.privacy.rules import CallLayout, register_rule


def _check(module: nn.EmbeddingBag) -> None:
    if module.mode == "max":
        raise ValueError(
            f"{module!r}: EmbeddingBag(mode='max') sends each coordinate's gradient to a different row; the "
            "privacy engine supports mode='sum' and 'mean'."
        )
    if module.max_norm is not None or module.scale_grad_by_freq or module.sparse:
        raise ValueError(
            f"{module!r}: EmbeddingBag with max_norm, scale_grad_by_freq or sparse=True is not supported by "
            "the privacy engine (the first two make one example's gradient depend on the others)."
        )


def _argument(args: tuple, kwargs: dict[str, Any], position: int, name: str) -> Any:
    return args[position] if len(args) > position else kwargs.get(name)


def bag_inputs(module: nn.EmbeddingBag, args: tuple, kwargs: dict[str, Any]) -> tuple:
    """(indices (B, L), weights w (B, L)) of a call: padded, one row per bag."""
    idx = _argument(args, kwargs, 0, "input")
    offsets = _argument(args, kwargs, 1, "offsets")
    weights = _argument(args, kwargs, 2, "per_sample_weights")
    if idx.dim() == 2:
        if offsets is not None:
            raise ValueError("a 2-D input takes no offsets")
        rows, lengths = idx.shape
        bag = torch.arange(rows, device=idx.device).repeat_interleave(lengths)
        position = torch.arange(lengths, device=idx.device).repeat(rows)
        flat, flat_weights = idx.reshape(-1), None if weights is None else weights.reshape(-1)
    elif idx.dim() == 1 and offsets is not None:
        starts = offsets[:-1] if module.include_last_offset else offsets
        ends = torch.cat(
            [starts[1:], offsets[-1:] if module.include_last_offset else idx.new_tensor([len(idx)])]
        )
        sizes = ends - starts
        bag = torch.arange(len(starts), device=idx.device).repeat_interleave(sizes)
        position = torch.arange(len(idx), device=idx.device) - starts.repeat_interleave(sizes)
        rows, lengths = len(starts), int(sizes.max()) if len(sizes) else 0
        flat, flat_weights = idx, weights
    else:
        raise ValueError("EmbeddingBag needs a 2-D input (one bag per row) or a 1-D input with offsets")
    w = torch.ones(flat.shape, dtype=module.weight.dtype, device=idx.device)
    if flat_weights is not None:
        w = flat_weights.to(w.dtype)
    if module.padding_idx is not None:
        w = w * (flat != module.padding_idx).to(w.dtype)
    if module.mode == "mean":
        counted = torch.zeros(rows, dtype=w.dtype, device=idx.device).index_add_(0, bag, (w != 0).to(w.dtype))
        w = w / counted.clamp_min(1)[bag]
    table = idx.new_zeros((rows, max(lengths, 1)))
    coef = w.new_zeros((rows, max(lengths, 1)))
    table[bag, position] = flat
    coef[bag, position] = w
    return table, coef


def bag_output_grad(module: nn.EmbeddingBag, grads: list[torch.Tensor | None]) -> torch.Tensor:
    """The gradient of the bag embeddings (B, d): the module's only output."""
    return grads[0]


@register_rule(nn.EmbeddingBag, check=_check, call=CallLayout(bag_inputs, bag_output_grad))
def embedding_bag_grads(
    module: nn.EmbeddingBag, call: tuple[torch.Tensor, torch.Tensor], dy: torch.Tensor
) -> dict[str, PerExampleGrad]:
    idx, coef = call
    g = coef.unsqueeze(-1).to(dy.dtype) * dy.unsqueeze(1)  # (B, L, d): w_{i,t} dy_i
    return {"weight": Outer(idx, g, module.weight.shape, module.num_embeddings)}
