"""DeBERTa (v1)'s query and value biases (``DisentangledSelfAttention.q_bias``, ``v_bias``, added to its
``in_proj``'s output) against the brute-force oracle: every strategy x clipping mode is in
``test_engine_oracle`` (the ``deberta`` case: padding, two micro-batches, float64, c2p and p2c); here the rule
alone (the fallback must not be taken), a wrapped ``in_proj``, one bias frozen, and the refusal of a bias
used outside the attention as well. GPT-NeoX-Japanese's ``dense_bias``, returned by its last attention for
the decoder layer to add to ``dense``'s output: the oracle in every setting, and the refusal of a bias the
caller adds elsewhere."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from dpexp.privacy import PrivacyEngine
from dpexp.privacy.capture import unsupported_modules
from dpexp.privacy.verification import VerificationError
from tests.engine_models import (
    _padded_text,
    deberta,
    gpt_neox_japanese,
    lm_loss,
    make_case,
    seq_classification_loss,
)
from tests.oracle import check_clipped_step

pytestmark = pytest.mark.filterwarnings("ignore:noise_multiplier=0")

MICRO = [[0, 1, 2], [3, 4, 5]]


def _batch() -> dict[str, torch.Tensor]:
    return make_case("deberta")[2]


def test_deberta_needs_no_fallback():
    assert unsupported_modules(deberta()) == {}


@pytest.mark.parametrize(
    "strategy,clipping", [("bk", "flat"), ("ghost", "per_layer"), ("instantiate", "flat")]
)
def test_projection_bias_rule_matches_oracle_without_the_fallback(strategy, clipping):
    with warnings.catch_warnings():
        warnings.filterwarnings("error", ".*torch.func fallback")  # the attention must not take it
        check_clipped_step(deberta(), seq_classification_loss, _batch(), MICRO, strategy, clipping)


def test_a_wrapped_in_proj_matches_oracle():
    """The rule reads the gradient at in_proj's output, whatever computes it (an adapter's wrapper)."""
    model = deberta()
    for layer in model.deberta.encoder.layer:
        layer.attention.self.in_proj = nn.Sequential(layer.attention.self.in_proj)
    check_clipped_step(model, seq_classification_loss, _batch(), MICRO, "bk", "per_layer")


def test_one_bias_frozen_matches_oracle():
    model = deberta()
    for layer in model.deberta.encoder.layer:
        layer.attention.self.q_bias.requires_grad_(False)
    check_clipped_step(model, seq_classification_loss, _batch(), MICRO, "ghost", "flat")


def test_a_use_of_a_bias_outside_the_attention_is_refused():
    """The rule covers the biases' uses inside the attention (after ``in_proj``); one in the loss as well is
    not, and the verification refuses it, naming the parameter."""
    model = deberta()
    attention = model.deberta.encoder.layer[0].attention.self

    def loss_fn(net: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return seq_classification_loss(net, batch) + 0.1 * attention.v_bias.square().sum()

    engine = PrivacyEngine(model, batch_size=6, sample_size=60, max_grad_norm=1.0, noise_multiplier=0.0)
    with pytest.raises(VerificationError, match=r"v_bias"):
        engine.backward(loss_fn(model, _batch()))


def test_an_output_tap_needs_a_named_tap():
    from dpexp.privacy.rules import register_rule

    with pytest.raises(ValueError, match="tap_output reads the output of a tap"):
        register_rule(nn.Identity, tap_output=True)


class _PairProjection(nn.Module):
    """A projection that returns a tuple: an output tap needs one tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4, bias=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = self.linear(x)
        return y, y


class _BiasAfterPair(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = _PairProjection()
        self.bias = nn.Parameter(torch.zeros(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)[0] + self.bias


def test_an_output_tap_that_returns_no_tensor_is_refused_at_the_call():
    from dpexp.privacy.per_example import Dense
    from dpexp.privacy.rules import register_rule

    rule = register_rule(_BiasAfterPair, tap="proj", tap_output=True)
    rule(lambda module, y, dy: {"bias": Dense(dy.sum(1))})
    model = _BiasAfterPair().double()
    engine = PrivacyEngine(model, batch_size=3, sample_size=30, max_grad_norm=1.0, noise_multiplier=0.0)
    with pytest.raises(TypeError, match=r"reads the output of its submodule, which returned tuple"):
        engine.backward(model(torch.randn(3, 5, 4, dtype=torch.float64)).square().sum((1, 2)))


def _lm_batch() -> dict[str, torch.Tensor]:
    return _padded_text(6, 7, 40, torch.Generator().manual_seed(0))


@pytest.mark.parametrize("strategy", ["bk", "ghost", "instantiate"])
@pytest.mark.parametrize("clipping", ["flat", "per_layer"])
def test_returned_bias_rule_matches_oracle_without_the_fallback(strategy, clipping):
    model = gpt_neox_japanese()
    assert unsupported_modules(model) == {}
    assert model.gpt_neox_japanese.layers[-1].attention.dense_bias is not None
    check_clipped_step(model, lm_loss, _lm_batch(), MICRO, strategy, clipping)


def test_a_returned_bias_added_elsewhere_is_refused():
    """The rule's gradient assumes the caller adds the bias to ``dense``'s output; a caller that also adds
    it to the residual makes the example sums differ from autograd's, and the verification refuses."""
    model = gpt_neox_japanese()
    layer = model.gpt_neox_japanese.layers[-1]
    forward = type(layer).forward

    def twice(self, hidden_states, *args, **kwargs):
        out = forward(self, hidden_states, *args, **kwargs)
        return (out[0] + self.attention.dense_bias, *out[1:])

    layer.forward = twice.__get__(layer)
    engine = PrivacyEngine(model, batch_size=6, sample_size=60, max_grad_norm=1.0, noise_multiplier=0.0)
    with pytest.raises(VerificationError, match=r"dense_bias"):
        engine.backward(lm_loss(model, _lm_batch()))
