"""CPM-Ant's own modules by rule (``rules/rms_norm.py``: its norm; ``rules/embedding.py``: its segment
position bias, looked up per example from the positions and segments of the batch and shared by every layer's
attention) against the brute-force oracle, without the fallback; and the refusal of a bias whose forward is
not the lookup the rule reads."""

from __future__ import annotations

import warnings

import pytest
import torch

from dpexp.privacy import PrivacyEngine
from dpexp.privacy.capture import unsupported_modules
from tests.engine_models import _padded_text, cpmant, lm_loss
from tests.oracle import check_clipped_step

pytestmark = pytest.mark.filterwarnings("ignore:noise_multiplier=0")

MICRO = [[0, 1, 2], [3, 4, 5]]
REL = 1e-6  # float64, but the norm's variance is in float32


def _batch() -> dict[str, torch.Tensor]:
    return _padded_text(6, 8, 40, torch.Generator().manual_seed(0))


def test_cpmant_needs_no_fallback():
    assert unsupported_modules(cpmant()) == {}


@pytest.mark.parametrize("clipping", ["flat", "per_layer", "groups"])
@pytest.mark.parametrize("strategy", ["bk", "ghost", "instantiate"])
def test_rules_match_oracle_without_the_fallback(strategy, clipping):
    torch.manual_seed(0)
    groups = 2 if clipping == "groups" else None
    with warnings.catch_warnings():
        warnings.filterwarnings("error", ".*torch.func fallback")
        check_clipped_step(cpmant(), lm_loss, _batch(), MICRO, strategy, clipping, groups=groups, rel=REL)


def test_a_bias_that_is_not_its_lookup_moved_is_refused_at_the_call(monkeypatch):
    from transformers.models.cpmant.modeling_cpmant import CpmAntSegmentPositionEmbedding

    forward = CpmAntSegmentPositionEmbedding.forward
    monkeypatch.setattr(CpmAntSegmentPositionEmbedding, "forward", lambda self, *a: 2 * forward(self, *a))
    model = cpmant()
    engine = PrivacyEngine(model, batch_size=6, sample_size=60, max_grad_norm=1.0, noise_multiplier=0.0)
    with pytest.raises(ValueError, match=r"CpmAntSegmentPositionEmbedding.*its lookup moved to \(B, heads"):
        engine.backward(lm_loss(model, _batch()))
