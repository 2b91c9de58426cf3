"""Beam's per-head gate bias (``BeamAttention.gate_bias``: ``y = a * sigmoid(gate_proj(x) + gate_bias[h])``
before ``o_proj``, ``rules/attention_gate.py``) against the brute-force oracle in every strategy x clipping
mode (float64, padding, two micro-batches, a sliding-window layer with rotary positions and a full one
without), under eager and sdpa attention (the rule reads values kept from the call, whatever computed
them); the attention must not take the fallback; and the refusals of modules the rule cannot follow."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from dpexp.privacy import PrivacyEngine
from tests.engine_models import beam_attention, lm_loss, padded_lm_batch
from tests.oracle import SETTINGS, check_clipped_step

pytestmark = pytest.mark.filterwarnings("ignore:noise_multiplier=0")

MICRO = [[0, 1, 2], [3, 4, 5]]
TOLERANCE = {"rel": 1e-5, "floor": 1e-6}  # float64, but Beam computes softmax, gates, logits in float32


@pytest.mark.parametrize("strategy,clipping,groups", SETTINGS, ids=[f"{s}-{c}" for s, c, _ in SETTINGS])
def test_gate_bias_matches_oracle_without_the_fallback(strategy, clipping, groups):
    torch.manual_seed(0)
    model = beam_attention()
    with warnings.catch_warnings():
        warnings.filterwarnings("error", ".*torch.func fallback")
        check_clipped_step(model, lm_loss, padded_lm_batch(), MICRO, strategy, clipping, groups, **TOLERANCE)


def test_gate_bias_under_sdpa_matches_oracle():
    torch.manual_seed(0)
    model = beam_attention("sdpa")
    check_clipped_step(model, lm_loss, padded_lm_batch(), MICRO, "bk", "per_layer", **TOLERANCE)


def _wrapped(name: str):
    def change(model: nn.Module) -> None:
        attention = model.model.layers[0].self_attn
        setattr(attention, name, nn.Sequential(getattr(attention, name)))

    return change


@pytest.mark.parametrize(
    "change,match",
    [
        (_wrapped("o_proj"), r"BeamAttention: .*o_proj is a Sequential, not an nn.Linear"),
        (_wrapped("gate_proj"), r"BeamAttention: .*gate_proj is a Sequential, not the plain module"),
    ],
    ids=["o_proj", "gate_proj"],
)
def test_a_wrapped_projection_is_refused_at_construction(change, match):
    model = beam_attention()
    change(model)
    with pytest.raises(ValueError, match=match):
        PrivacyEngine(model, batch_size=6, sample_size=60, max_grad_norm=1.0, noise_multiplier=0.0)
