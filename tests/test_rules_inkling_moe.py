"""Inkling's mixture of experts (``dpexp/privacy/rules/inkling_moe.py``), normed embedding
(``rules/embedding.py``), short convolution (``rules/short_conv.py``) and relative logits
(``rules/relative_logits.py``) against the brute-force oracle, no module on the fallback: its
sigmoid router over routed and shared experts with a learnt global scale, its shared experts (one and two: the
stacked factor), under bk, ghost and instantiation with flat, per-layer and group-wise clipping, float64,
examples padded on the right or the left, two micro-batches, in training mode; float32; the refusals."""

from __future__ import annotations

import warnings

import pytest
import torch

from dpexp.privacy import PrivacyEngine
from dpexp.privacy.capture import unsupported_modules
from tests.engine_models import _padded_text, inkling, lm_loss
from tests.oracle import check_clipped_step

pytestmark = pytest.mark.filterwarnings("ignore:noise_multiplier=0")

MICRO = [[0, 1, 2], [3, 4, 5]]


def _batch(left: bool = False) -> dict[str, torch.Tensor]:
    """Examples padded to different lengths, on the right, or on the left (where the short convolutions'
    padding mask changes the real positions' outputs)."""
    batch = _padded_text(6, 10, 40, torch.Generator().manual_seed(0))
    return {key: value.flip(1) for key, value in batch.items()} if left else batch


def test_no_module_is_left_to_the_fallback():
    """Since stop 64 its relative logits too (``rules/relative_logits.py``)."""
    assert unsupported_modules(inkling()) == {}


@pytest.mark.parametrize("shared,left", [(1, False), (2, False), (2, True)])
@pytest.mark.parametrize(
    "strategy,clipping", [("bk", "flat"), ("ghost", "per_layer"), ("instantiate", "flat"), ("bk", "groups")]
)
def test_inkling_matches_oracle(shared, left, strategy, clipping):
    torch.manual_seed(0)
    model = inkling(shared).train()
    groups = 3 if clipping == "groups" else None
    check_clipped_step(model, lm_loss, _batch(left), MICRO, strategy, clipping, groups=groups, rel=1e-6)


def test_float32_matches_oracle():
    model = inkling().float().train()
    check_clipped_step(model, lm_loss, _batch(), MICRO, "bk", "flat", rel=1e-4, floor=1e-6)


def test_router_with_a_parameter_it_does_not_know_is_refused():
    model = inkling()
    router = next(m for m in model.modules() if type(m).__name__ == "InklingTopkRouter")
    router.extra = torch.nn.Parameter(torch.zeros(2))
    with pytest.raises(ValueError, match=r"InklingTopkRouter.*Inkling router rule.*\['extra'\]"):
        PrivacyEngine(model, batch_size=6, sample_size=100, max_grad_norm=1.0, noise_multiplier=1.0)


def test_shared_experts_with_an_unknown_activation_are_refused():
    model = inkling()
    shared = next(m for m in model.modules() if type(m).__name__ == "InklingSharedExperts")
    shared.act_fn = torch.nn.Softmax(dim=-1)  # mixes a row's values: not elementwise
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ValueError, match=r"InklingSharedExperts.*activation Softmax"):
            PrivacyEngine(model, batch_size=6, sample_size=100, max_grad_norm=1.0, noise_multiplier=1.0)
