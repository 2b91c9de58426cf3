"""Doge's own parameters by rule: its attention's dynamic-mask ``A`` (``rules/dynamic_mask.py``, one
forward-mode run of the module) and its decoder layer's residual scales (``rules/residual_scale.py``, read off
the layer's graph); every strategy x clipping mode with keys past the kept window masked is in
``test_rules_decoder_modules.py``. Here every key kept, and the refusals of what the rules cannot run again
(of a graph without the reads: ``test_engine_graph_reads.py``)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dpexp.privacy import PrivacyEngine
from tests.engine_models import doge, lm_loss
from tests.oracle import check_clipped_step
from tests.test_rules_decoder_modules import MODELS, batch

pytestmark = pytest.mark.filterwarnings("ignore:noise_multiplier=0")

MICRO = [[0, 1, 2], [3, 4, 5]]


def test_every_key_kept_matches_oracle():
    """A window as long as the texts: no key masked by the top-k."""
    torch.manual_seed(0)
    check_clipped_step(doge(keep_window_size=16), lm_loss, batch(), MICRO, "bk", "flat", **MODELS["doge"][1])


def _engine(model: nn.Module) -> PrivacyEngine:
    return PrivacyEngine(model, batch_size=6, sample_size=60, max_grad_norm=1.0, noise_multiplier=0.0)


def test_another_attention_implementation_is_refused_at_the_call():
    model = doge()
    engine = _engine(model)
    model.config._attn_implementation = "sdpa"
    with pytest.raises(ValueError, match=r"\(DogeAttention\): attention implementation 'sdpa'.*'eager'"):
        engine.backward(lm_loss(model, batch()))


def test_another_own_parameter_is_refused_at_construction():
    model = doge()
    model.model.layers[0].extra = nn.Parameter(torch.zeros(3, dtype=torch.float64))
    with pytest.raises(
        ValueError, match=r"DogeDecoderLayer: .*parameters \['extra'\].*freeze input_residual"
    ):
        _engine(model)
