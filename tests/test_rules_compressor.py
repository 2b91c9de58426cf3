"""DeepSeek-V4's heavily compressed attention's window bias by rule (``rules/compressor.py``): the gradient at
``gate_proj``'s output read off the call's graph and summed over each example's whole windows. A tiny
DeepSeek-V4 whose windows of 4 the texts close, with the bias drawn, against the oracle (more settings in
``test_rules_moe.py``'s ``deepseek_v4_windows``), texts shorter than a window, and the refusals of window
weights the rule does not reproduce, of a cache and of parameters it does not know."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dpexp.privacy import PrivacyEngine
from dpexp.privacy.capture import unsupported_modules
from tests.engine_models import _padded_text, lm_loss, new_moe
from tests.oracle import check_clipped_step

pytestmark = pytest.mark.filterwarnings("ignore:noise_multiplier=0")

MICRO = [[0, 1, 2], [3, 4, 5]]
TOLERANCE = {"rel": 1e-6, "floor": 1e-10}


def _model() -> nn.Module:
    """The bias drawn; the hyper-connections frozen: they compute in float32, batched, which moves their
    small clipped gradients by up to 1e-4 of themselves on short texts (``test_rules_hyper_connections.py``
    shows the rule exact in float64)."""
    model = new_moe("deepseek_v4_windows")
    with torch.no_grad():
        for module in model.modules():
            if type(module).__name__ == "DeepseekV4HCACompressor":
                module.position_bias.normal_(0.0, 0.5, generator=torch.Generator().manual_seed(3))
            if "Hyper" in type(module).__name__:
                module.requires_grad_(False)
    return model


def _batch(length: int = 10) -> dict[str, torch.Tensor]:
    return _padded_text(6, length, 40, torch.Generator().manual_seed(0))


def _engine(model: nn.Module) -> PrivacyEngine:
    return PrivacyEngine(model, batch_size=6, sample_size=60, max_grad_norm=1.0, noise_multiplier=0.0)


def test_needs_no_fallback():
    assert unsupported_modules(_model()) == {}


@pytest.mark.parametrize(("strategy", "clipping"), [("bk", "flat"), ("ghost", "per_layer")])
def test_drawn_bias_matches_oracle(strategy, clipping):
    torch.manual_seed(0)
    check_clipped_step(_model(), lm_loss, _batch(), MICRO, strategy, clipping, **TOLERANCE)


def test_texts_shorter_than_a_window_give_the_bias_no_gradient():
    torch.manual_seed(0)
    check_clipped_step(_model(), lm_loss, _batch(3), MICRO, "bk", "per_layer", **TOLERANCE)


def test_window_weights_the_rule_does_not_reproduce_are_refused(monkeypatch):
    """Window weights taken of the gates scaled by 1.1: not ``softmax(Z + B)``."""
    original = torch.Tensor.softmax

    def scaled(self, *args, **kwargs):
        return original(self * 1.1, *args, **kwargs)

    model = _model()
    engine = _engine(model)
    monkeypatch.setattr(torch.Tensor, "softmax", scaled)
    loss = lm_loss(model, _batch())
    monkeypatch.setattr(torch.Tensor, "softmax", original)
    with pytest.raises(RuntimeError, match=r"DeepseekV4HCACompressor: .*window weights does not reproduce"):
        engine.backward(loss)


def test_a_cache_is_refused_at_the_call():
    model = _model()
    _engine(model)
    with pytest.raises(ValueError, match=r"DeepseekV4HCACompressor\): was given a cache.*use_cache=False"):
        model(input_ids=_batch()["input_ids"], use_cache=True)


def test_another_own_parameter_is_refused_at_construction():
    model = _model()
    model.model.layers[0].self_attn.compressor.extra = nn.Parameter(torch.zeros(3, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"DeepseekV4HCACompressor: .*\['extra'\].*freeze position_bias"):
        _engine(model)
