"""Differential attention (DiffLlama's lambda vectors, ``rules/differential.py``) against the brute-force
oracle (every strategy x clipping mode: ``test_rules_decoder_modules.py``): both attention implementations,
the returned probabilities in the loss, float32, frozen and zero vectors, and the refusals of what the rule
cannot run again or read (a wrapped o_proj: ``test_rules_sinks.py``)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dpexp.privacy import PrivacyEngine
from tests.engine_models import diffllama, lm_loss
from tests.oracle import check_clipped_step
from tests.test_rules_decoder_modules import batch
from tests.test_rules_sinks import _attention_loss

pytestmark = pytest.mark.filterwarnings("ignore:noise_multiplier=0")

MICRO = [[0, 1, 2], [3, 4, 5]]
REL = 1e-6  # float64, but DiffLlama forms lambda's dot products in float32


def test_sdpa_matches_oracle():
    """Lambda acts after the attention function, which the rule's forward-mode run calls on inputs without
    tangents: sdpa serves as eager does."""
    torch.manual_seed(0)
    check_clipped_step(diffllama("sdpa"), lm_loss, batch(), MICRO, "bk", "per_layer", rel=REL)


def test_returned_probabilities_in_the_loss_match_oracle():
    torch.manual_seed(0)
    check_clipped_step(diffllama(), _attention_loss, batch(), MICRO, "bk", "per_layer", rel=REL)


def test_float32_matches_oracle():
    torch.manual_seed(0)
    check_clipped_step(diffllama().float(), lm_loss, batch(), MICRO, "bk", "flat", rel=1e-5, floor=1e-6)


@pytest.mark.parametrize(
    "zeroed",
    [("lambda_q1", "lambda_k1"), ("lambda_k2",), ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2")],
    ids=["first_pair", "one_vector", "all"],
)
def test_zero_vectors_match_oracle(zeroed):
    """Zero vectors move lambda along another vector, or not at all (every gradient of the four is then 0)."""
    torch.manual_seed(0)
    model = diffllama()
    with torch.no_grad():
        for layer in model.model.layers:
            for name in zeroed:
                getattr(layer.self_attn, name).zero_()
    check_clipped_step(model, lm_loss, batch(), MICRO, "instantiate", "per_layer", rel=REL)


def test_partly_frozen_vectors_match_oracle():
    torch.manual_seed(0)
    model = diffllama()
    for layer in model.model.layers:
        layer.self_attn.lambda_q1.requires_grad_(False)
        layer.self_attn.lambda_k2.requires_grad_(False)
    check_clipped_step(model, lm_loss, batch(), MICRO, "bk", "flat", rel=REL)


def _engine(model: nn.Module) -> PrivacyEngine:
    return PrivacyEngine(model, batch_size=6, sample_size=60, max_grad_norm=1.0, noise_multiplier=0.0)


def test_a_cache_is_refused_at_the_call():
    model = diffllama()
    engine = _engine(model)
    model.config.use_cache = True
    with pytest.raises(
        ValueError, match=r"\(DiffLlamaAttention\): was given a key/value cache.*use_cache=False"
    ):
        engine.backward(lm_loss(model, batch()))


def test_another_own_parameter_is_refused_at_construction():
    model = diffllama()
    model.model.layers[1].self_attn.extra = nn.Parameter(torch.zeros(3, dtype=torch.float64))
    with pytest.raises(
        ValueError, match=r"DiffLlamaAttention: .*owns parameters \['extra'\].*freeze lambda_q1"
    ):
        _engine(model)
