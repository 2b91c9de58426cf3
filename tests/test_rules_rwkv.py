"""RWKV-4's own parameters by rule (``rules/rwkv.py``): the token shift's mixing vectors of both blocks and
the time mixing's decay and bonus. Every strategy x clipping mode is in ``test_rules_decoder_modules.py``;
here partly frozen blocks, and the refusals of a recurrent state, of a forward the rule does not reproduce
and of parameters it does not know."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dpexp.privacy import PrivacyEngine
from tests.engine_models import lm_loss, rwkv
from tests.oracle import check_clipped_step
from tests.test_rules_decoder_modules import MODELS, batch

pytestmark = pytest.mark.filterwarnings("ignore:noise_multiplier=0")

MICRO = [[0, 1, 2], [3, 4, 5]]


@pytest.mark.parametrize("frozen", ["time_decay", "time_mix_key"])
def test_partly_frozen_blocks_match_oracle(frozen):
    model = rwkv()
    for block in model.rwkv.blocks:
        getattr(block.attention, frozen).requires_grad_(False)
        block.feed_forward.time_mix_receptance.requires_grad_(False)
    torch.manual_seed(0)
    check_clipped_step(model, lm_loss, batch(), MICRO, "bk", "per_layer", **MODELS["rwkv"][1])


def _engine(model: nn.Module) -> PrivacyEngine:
    return PrivacyEngine(model, batch_size=6, sample_size=60, max_grad_norm=1.0, noise_multiplier=0.0)


def test_a_recurrent_state_is_refused_at_the_call():
    model = rwkv()
    _engine(model)
    with pytest.raises(ValueError, match=r"RwkvSelfAttention\): was given a recurrent state.*use_cache"):
        model(input_ids=batch()["input_ids"], use_cache=True)


def test_a_mix_the_rule_does_not_reproduce_is_refused(monkeypatch):
    """Channel mixing whose key reads the shifted input at half weight: not the mix the rule recomputes."""
    from transformers.models.rwkv import modeling_rwkv

    def halved(self, hidden, state=None):
        shifted = self.time_shift(hidden)
        key = hidden * self.time_mix_key + shifted * (1 - self.time_mix_key) * 0.5
        receptance = hidden * self.time_mix_receptance + shifted * (1 - self.time_mix_receptance)
        value = self.value(torch.square(torch.relu(self.key(key))))
        return torch.sigmoid(self.receptance(receptance)) * value, state

    model = rwkv()
    engine = _engine(model)
    monkeypatch.setattr(modeling_rwkv.RwkvFeedForward, "forward", halved)
    with pytest.raises(RuntimeError, match=r"RwkvFeedForward: .*mix of time_mix_key does not reproduce"):
        engine.backward(lm_loss(model, batch()))


def test_a_submodule_called_twice_is_refused(monkeypatch):
    from transformers.models.rwkv import modeling_rwkv

    original = modeling_rwkv.RwkvFeedForward.forward

    def twice(self, hidden, state=None):
        out, state = original(self, hidden, state)
        return out + self.key(hidden).sum(-1, keepdim=True), state

    model = rwkv()
    engine = _engine(model)
    monkeypatch.setattr(modeling_rwkv.RwkvFeedForward, "forward", twice)
    with pytest.raises(ValueError, match=r"RwkvFeedForward: the RWKV rule reads .*other than once"):
        engine.backward(lm_loss(model, batch()))


def test_another_own_parameter_is_refused_at_construction():
    model = rwkv()
    model.rwkv.blocks[0].attention.extra = nn.Parameter(torch.zeros(3, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"RwkvSelfAttention: .*\['extra'\].*freeze time_decay"):
        _engine(model)
