"""``nn.Embedding``: the per-example gradient of the table is ``sum_t e_{idx_t} (x) dy_t`` (one-hot rows).

Its squared norm is ``sum_{t,s} [idx_t = idx_s] <dy_t, dy_s>`` (ghost norm with an index factor), so the
(V, d) per-example gradient is never formed. Positions equal to ``padding_idx`` receive no gradient.
Inputs of batch size 1 (position ids broadcast over the batch by Hugging Face models) are expanded to the
batch in the forward pass, so that each example's output gradient stays its own.
"""

from __future__ import annotations

import torch
from torch import nn

from dpexp.privacy.per_example import Outer, PerExampleGrad
from dpexp.privacy.rules import register_rule


def _check(module: nn.Embedding) -> None:
    if module.max_norm is not None or module.scale_grad_by_freq or module.sparse:
        raise ValueError(
            f"{module!r}: Embedding with max_norm, scale_grad_by_freq or sparse=True is not supported by the "
            "privacy engine (the first two make one example's gradient depend on the others)."
        )


@register_rule(nn.Embedding, check=_check, expand_broadcast_input=True, position_wise=True)
def embedding_grads(module: nn.Embedding, idx: torch.Tensor, dy: torch.Tensor) -> dict[str, PerExampleGrad]:
    idx = idx.reshape(idx.shape[0], -1)
    g = dy.reshape(idx.shape[0], idx.shape[1], -1)
    if module.padding_idx is not None:
        g = g * (idx != module.padding_idx).unsqueeze(-1).to(g.dtype)
    return {"weight": Outer(idx, g, module.weight.shape, module.num_embeddings)}
