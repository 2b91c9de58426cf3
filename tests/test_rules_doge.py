"""Doge's own parameters by rule against the brute-force oracle: its attention's dynamic-mask ``A``
(``rules/dynamic_mask.py``, one forward-mode run of the module) and its decoder layer's residual scales
(``rules/residual_scale.py``, read off the layer's graph), every strategy x clipping mode, padded texts, two
micro-batches, keys past the kept window masked; and the refusals of what the rules cannot run again or
read."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from dpexp.privacy import PrivacyEngine
from dpexp.privacy.capture import unsupported_modules
from tests.engine_models import _padded_text, doge, lm_loss
from tests.oracle import check_clipped_step

pytestmark = pytest.mark.filterwarnings("ignore:noise_multiplier=0")

MICRO = [[0, 1, 2], [3, 4, 5]]
# float64, but Doge's eager attention takes its softmax in float32: A's gradient, a small sum of large terms,
# is exact to that rounding (the oracle's and the rule's differ by about 1e-5 of it), the rest to 1e-8
TOLERANCE = {"rel": 1e-6, "floor": 1e-9}


def _batch() -> dict[str, torch.Tensor]:
    return _padded_text(6, 8, 40, torch.Generator().manual_seed(0))


def test_doge_needs_no_fallback():
    assert unsupported_modules(doge()) == {}


@pytest.mark.parametrize("clipping", ["flat", "per_layer", "groups"])
@pytest.mark.parametrize("strategy", ["bk", "ghost", "instantiate"])
def test_rules_match_oracle_without_the_fallback(strategy, clipping):
    torch.manual_seed(0)
    groups = 2 if clipping == "groups" else None
    with warnings.catch_warnings():
        warnings.filterwarnings("error", ".*torch.func fallback")
        check_clipped_step(doge(), lm_loss, _batch(), MICRO, strategy, clipping, groups=groups, **TOLERANCE)


def test_every_key_kept_matches_oracle():
    """A window as long as the texts: no key masked by the top-k."""
    torch.manual_seed(0)
    check_clipped_step(doge(keep_window_size=16), lm_loss, _batch(), MICRO, "bk", "flat", **TOLERANCE)


def _engine(model: nn.Module) -> PrivacyEngine:
    return PrivacyEngine(model, batch_size=6, sample_size=60, max_grad_norm=1.0, noise_multiplier=0.0)


def test_another_attention_implementation_is_refused_at_the_call():
    model = doge()
    engine = _engine(model)
    model.config._attn_implementation = "sdpa"
    with pytest.raises(ValueError, match=r"\(DogeAttention\): attention implementation 'sdpa'.*'eager'"):
        engine.backward(lm_loss(model, _batch()))


def test_residual_products_missing_from_the_graph_are_refused():
    """Activation checkpointing's hooks on saved tensors: the graph reads stand down, and the layer, which
    has no recomputation, is refused with the fix."""
    model = doge()
    engine = _engine(model)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        loss = lm_loss(model, _batch())
    with pytest.raises(
        ValueError, match=r"DogeDecoderLayer: .*off the layer's autograd graph.*freeze input_"
    ):
        engine.backward(loss)


def test_another_own_parameter_is_refused_at_construction():
    model = doge()
    model.model.layers[0].extra = nn.Parameter(torch.zeros(3, dtype=torch.float64))
    with pytest.raises(
        ValueError, match=r"DogeDecoderLayer: .*parameters \['extra'\].*freeze input_residual"
    ):
        _engine(model)
