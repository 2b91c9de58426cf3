"""nn.EmbeddingBag models for the oracle (tests/test_rules_embedding_bag.py) and sensitivity tests."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class BagNet(nn.Module):
    """Bags of token ids -> EmbeddingBag -> Linear; ``layout="offsets"`` flattens the padded (B, L) ids of
    each example into one 1-D input with offsets, as recommender models call it."""

    def __init__(self, mode: str, layout: str, weighted: bool, padding_idx: int | None, last: bool = False):
        super().__init__()
        self.layout, self.weighted = layout, weighted
        self.bag = nn.EmbeddingBag(13, 5, mode=mode, padding_idx=padding_idx, include_last_offset=last)
        self.head = nn.Linear(5, 3)

    def forward(self, ids: torch.Tensor, lengths: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        psw = weights if self.weighted else None
        if self.layout == "rows":
            return self.head(torch.tanh(self.bag(ids, per_sample_weights=psw)))
        keep = torch.arange(ids.shape[1])[None, :] < lengths[:, None]
        offsets = torch.cumsum(lengths, 0) - lengths
        if self.bag.include_last_offset:
            offsets = torch.cat([offsets, lengths.sum().reshape(1)])
        out = self.bag(ids[keep], offsets, per_sample_weights=None if psw is None else psw[keep])
        return self.head(torch.tanh(out))


def bag_batch(size: int = 6, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 13, (size, 7), generator=gen)
    ids[0, :3] = 0  # padding_idx entries
    lengths = torch.randint(1, 8, (size,), generator=gen)
    lengths[1] = 7
    weights = torch.rand(size, 7, generator=gen, dtype=torch.float64) + 0.5
    return {
        "ids": ids,
        "lengths": lengths,
        "weights": weights,
        "y": torch.randint(0, 3, (size,), generator=gen),
    }


def bag_loss(model: BagNet, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Per-example cross-entropy, shape (B,)."""
    logits = model(batch["ids"], batch["lengths"], batch["weights"])
    return F.cross_entropy(logits, batch["y"], reduction="none")
