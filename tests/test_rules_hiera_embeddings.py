"""Hugging Face Hiera's embeddings (``position_embeddings`` added to the patch convolution's output, returned
with the MAE mask and restore ids) against the brute-force oracle in every strategy x clipping mode (float64,
two micro-batches, the whole tiny model without the fallback), and the refusal of a resampled table."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dpexp.privacy import PrivacyEngine
from dpexp.privacy.capture import unsupported_modules
from dpexp.privacy.rules import rule_for, vision_tokens
from tests.engine_models import classification_loss
from tests.oracle import SETTINGS, check_clipped_step
from tests.timm_cnn_models import hf_hiera

pytestmark = pytest.mark.filterwarnings("ignore:noise_multiplier=0")

MICRO = [[0, 1, 2], [3, 4, 5]]


def _batch() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {
        "x": torch.randn(6, 3, 8, 8, generator=gen, dtype=torch.float64),
        "y": torch.randint(0, 3, (6,), generator=gen),
    }


def _hiera() -> nn.Module:
    return hf_hiera().double()


def test_hiera_needs_no_fallback():
    model = _hiera()
    assert unsupported_modules(model) == {}
    embeddings = next(m for m in model.modules() if type(m).__name__ == "HieraEmbeddings")
    assert rule_for(embeddings).per_example_grads is vision_tokens.hiera_position_grads


@pytest.mark.parametrize("strategy,clipping,groups", SETTINGS, ids=[f"{s}-{c}" for s, c, _ in SETTINGS])
def test_hiera_matches_oracle(strategy, clipping, groups):
    with warnings.catch_warnings():
        warnings.filterwarnings("error", ".*torch.func fallback")
        check_clipped_step(_hiera(), classification_loss, _batch(), MICRO, strategy, clipping, groups)


def test_resampled_positions_are_refused():
    """Other-sized images with ``interpolate_pos_encoding=True``: the table is resampled (bicubic), which the
    rule does not differentiate."""
    model = _hiera()
    hf_model = model.model
    engine = PrivacyEngine(model, batch_size=6, sample_size=60, max_grad_norm=1.0, noise_multiplier=0.0)
    pixels = torch.randn(6, 3, 12, 12, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"resamples position_embeddings for \(12, 12\) images"):
        logits = hf_model(pixel_values=pixels, interpolate_pos_encoding=True).logits
        engine.backward(F.cross_entropy(logits, torch.zeros(6, dtype=torch.long), reduction="none"))
