"""Griffin's RG-LRU by rule (``rules/rg_lru.py``): the gradients at its two gates' block-diagonal products
and at its log decay's product read off the call's graph. RecurrentGemma whole against the oracle in every
strategy and clipping mode without the fallback, to 1e-10 where only it trains; a decay
parameter past softplus's threshold; frozen layers below it (its input anchored); and the refusals of a
recomputation that does not reproduce the call and of unknown parameters (of hooks on saved tensors:
``test_engine_graph_reads.py``)."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from dpexp.privacy import PrivacyEngine
from tests.engine_models import lm_loss, padded_lm_batch, recurrent_gemma
from tests.oracle import check_clipped_step

pytestmark = pytest.mark.filterwarnings("ignore:noise_multiplier=0")

MICRO = [[0, 1, 2], [3, 4, 5]]


def _lrus(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if type(m).__name__ == "RecurrentGemmaRglru"]


def _engine(model: nn.Module) -> PrivacyEngine:
    return PrivacyEngine(model, batch_size=6, sample_size=60, max_grad_norm=1.0, noise_multiplier=0.0)


def _no_fallback(check) -> None:
    """Run ``check``, failing if any module took the exact fallback (which says so in a warning)."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        check()
    fallbacks = [str(w.message) for w in seen if "one example at a time" in str(w.message)]
    assert not fallbacks, fallbacks


@pytest.mark.parametrize(
    "strategy,clipping", [("bk", "flat"), ("ghost", "per_layer"), ("instantiate", "groups")]
)
def test_recurrent_gemma_matches_oracle_with_no_fallback(strategy, clipping):
    """The model's norms compute in float32: the oracle's one-example-at-a-time rounding differs from the
    batch's by up to 1e-9 of the float64 model's gradients."""
    torch.manual_seed(0)
    groups = 2 if clipping == "groups" else None
    model, batch = recurrent_gemma(), padded_lm_batch()
    _no_fallback(
        lambda: check_clipped_step(
            model, lm_loss, batch, MICRO, strategy, clipping, groups, rel=1e-6, floor=1e-9
        )
    )


def test_the_rule_is_exact_when_only_the_rg_lru_trains():
    """What the whole-model tests allow is the float32 norms' rounding (batched against one example at a
    time: the pre-norm's weight differed by 2e-9), not the rule's: with only the RG-LRU trained (its input
    then needs no gradient and is anchored) the rule matches the oracle to 1e-10."""
    model = recurrent_gemma().requires_grad_(False)
    for lru in _lrus(model):
        lru.requires_grad_(True)
    torch.manual_seed(0)
    check_clipped_step(model, lm_loss, padded_lm_batch(), MICRO, "ghost", "per_layer", rel=1e-10)


def test_a_decay_past_softplus_threshold_matches_oracle():
    """softplus(x) = x above its threshold 20, its derivative 1 there, not sigmoid(x)."""
    model = recurrent_gemma()
    (lru,) = _lrus(model)
    with torch.no_grad():
        lru.recurrent_param[::2] = 21.0  # decays of exp(-8 r 21): the scan forgets at once
    torch.manual_seed(0)
    check_clipped_step(model, lm_loss, padded_lm_batch(), MICRO, "bk", "per_layer", rel=1e-6, floor=1e-9)


def test_frozen_layers_below_it_match_oracle():
    """Embeddings, norm, input projection and convolution frozen: the RG-LRU's input needs no gradient,
    and the capture anchors it so that the call builds the graph the rule reads."""
    model = recurrent_gemma()
    block = _lrus(model)[0]
    owner = next(m for m in model.modules() if getattr(m, "rg_lru", None) is block)
    for frozen in (
        model.model.embed_tokens,
        model.model.layers[0].temporal_pre_norm,
        owner.linear_x,
        owner.conv_1d,
    ):
        frozen.requires_grad_(False)
    torch.manual_seed(0)
    _no_fallback(
        lambda: check_clipped_step(
            model, lm_loss, padded_lm_batch(), MICRO, "ghost", "flat", rel=1e-6, floor=1e-9
        )
    )


def test_a_forward_the_recomputation_does_not_reproduce_is_refused(monkeypatch):
    """The rule recomputes the recurrence gate's factor -8 r from the weights and checks it against the one
    the call's product kept; a forward with another constant (here: the rule's own, changed) is refused."""
    import dpexp.privacy.rules.rg_lru as rg_lru

    monkeypatch.setattr(rg_lru, "_DECAY", -4.0)
    model = recurrent_gemma().train()
    engine = _engine(model)
    with pytest.raises(
        RuntimeError, match=r"RecurrentGemmaRglru: .*log decay's factor -8 r does not reproduce"
    ):
        engine.backward(lm_loss(model, padded_lm_batch()))


def test_another_own_parameter_is_refused_at_construction():
    model = recurrent_gemma()
    _lrus(model)[0].extra = nn.Parameter(torch.zeros(3, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"RecurrentGemmaRglru: .*\['extra'\].*freeze the RG-LRU"):
        _engine(model)
