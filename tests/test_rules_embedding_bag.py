"""nn.EmbeddingBag against the brute-force oracle: 2-D bags and 1-D inputs with offsets, sum and mean,
per-sample weights, padding_idx, every strategy x clipping mode; the sensitivity under removal; refusals."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dpexp.privacy import PrivacyEngine
from tests.oracle import clipped_mean, engine_update, group_norms, per_example_grads

pytestmark = pytest.mark.filterwarnings("ignore:noise_multiplier=0")


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


def _loss(model, batch):
    return F.cross_entropy(
        model(batch["ids"], batch["lengths"], batch["weights"]), batch["y"], reduction="none"
    )


def _batch(size: int = 6, seed: int = 0):
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


VARIANTS = {
    "rows-sum": ("sum", "rows", False, None, False),
    "rows-mean-padding": ("mean", "rows", False, 0, False),
    "rows-weighted": ("sum", "rows", True, None, False),
    "offsets-sum": ("sum", "offsets", False, None, False),
    "offsets-mean-padding-last": ("mean", "offsets", False, 0, True),
    "offsets-weighted-padding": ("sum", "offsets", True, 0, False),
}
SETTINGS = [(s, c) for s in ("bk", "ghost", "instantiate") for c in ("flat", "per_layer")]


def _check(variant: str, strategy: str, clipping: str) -> None:
    torch.manual_seed(0)
    model = BagNet(*VARIANTS[variant]).double()
    batch = _batch()
    grads = per_example_grads(model, _loss, batch)
    partition = PrivacyEngine(
        BagNet(*VARIANTS[variant]).double(), batch_size=6, sample_size=60, max_grad_norm=1.0,
        noise_multiplier=0.0, clipping=clipping,
    ).groups  # fmt: skip
    thresholds = group_norms(grads, partition).median(0).values.tolist()
    expected = clipped_mean(grads, partition, thresholds, batch_size=6)
    delta, _ = engine_update(
        model, _loss, batch, [[0, 1, 2], [3, 4, 5]], batch_size=6, clipping=clipping, strategy=strategy,
        thresholds=thresholds, max_grad_norm=1.0,
    )  # fmt: skip
    for name, want in expected.items():
        err = (delta[name] - want).norm() / want.norm().clamp_min(1e-12)
        assert err < 1e-6, f"{variant}/{strategy}/{clipping}: {name} relative error {err:.2e}"


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_embedding_bag_matches_the_oracle(variant):
    _check(variant, "bk", "per_layer")


@pytest.mark.slow
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("strategy,clipping", SETTINGS)
def test_embedding_bag_matches_the_oracle_everywhere(variant, strategy, clipping):
    _check(variant, strategy, clipping)


def test_embedding_bag_needs_no_fallback():
    from dpexp.privacy.capture import unsupported_modules

    assert not any("EmbeddingBag" in kind for kind in unsupported_modules(BagNet("sum", "offsets", True, 0)))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"mode": "max"}, "mode='max'"),
        ({"max_norm": 1.0}, "max_norm"),
        ({"scale_grad_by_freq": True}, "scale_grad_by_freq"),
    ],
)
def test_unsupported_embedding_bags_are_refused(kwargs, message):
    model = nn.Sequential(nn.EmbeddingBag(10, 4, **kwargs), nn.Linear(4, 2))
    with pytest.raises(ValueError, match=message):
        PrivacyEngine(model, batch_size=2, sample_size=10, max_grad_norm=1.0, noise_multiplier=1.0)
