"""LFM2's gated short convolution (``Lfm2ShortConv``: the ``conv`` weight and bias it reads itself) against
the brute-force oracle, without the fallback: every strategy x clipping mode is in ``test_engine_oracle``'s
``lfm2`` case (padding, two micro-batches, float64); here float32, a frozen bias-free convolution, and the
refusals of what the rule cannot follow."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from dpexp.privacy import PrivacyEngine
from dpexp.privacy.capture import unsupported_modules
from tests.engine_models import _decoder, _padded_text, lfm2, lfm2_moe, lm_loss
from tests.oracle import check_clipped_step

pytestmark = pytest.mark.filterwarnings("ignore:noise_multiplier=0")

MICRO = [[0, 1, 2], [3, 4, 5]]


def _batch() -> dict[str, torch.Tensor]:
    return _padded_text(6, 10, 40, torch.Generator().manual_seed(0))


def lfm2_biased() -> nn.Module:
    """LFM2 with biases in its short convolution and projections (``conv_bias``)."""
    from transformers import Lfm2Config, Lfm2ForCausalLM

    return _decoder(
        Lfm2Config, Lfm2ForCausalLM, layer_types=["conv", "full_attention"], conv_L_cache=3, conv_bias=True,
        use_cache=False,
    )  # fmt: skip


@pytest.mark.parametrize("build", [lfm2, lfm2_biased, lfm2_moe])
def test_no_short_convolution_is_left_to_the_fallback(build):
    assert unsupported_modules(build()) == {}


@pytest.mark.parametrize(
    "build,strategy,clipping",
    [
        (lfm2, "bk", "flat"),
        (lfm2_biased, "bk", "per_layer"),
        (lfm2_biased, "ghost", "flat"),
        (lfm2_moe, "bk", "flat"),
    ],
)
def test_rule_matches_oracle_without_the_fallback(build, strategy, clipping):
    torch.manual_seed(0)
    model = build().train()
    with warnings.catch_warnings():
        warnings.filterwarnings("error", ".*torch.func fallback")
        check_clipped_step(model, lm_loss, _batch(), MICRO, strategy, clipping, rel=1e-9)


def test_float32_matches_oracle():
    torch.manual_seed(0)
    check_clipped_step(lfm2_biased().float(), lm_loss, _batch(), MICRO, "bk", "flat", rel=1e-4, floor=1e-6)


def test_a_block_whose_forward_differs_is_refused(monkeypatch):
    """A convolution that is not the plain causal one (here its output scaled) is not reproduced by the rule:
    refused, not approximated."""
    from transformers.models.lfm2 import modeling_lfm2

    conv = modeling_lfm2.causal_conv1d_fn
    monkeypatch.setattr(modeling_lfm2, "causal_conv1d_fn", lambda *a, **k: 0.5 * conv(*a, **k))
    model = lfm2()
    engine = PrivacyEngine(model, batch_size=6, sample_size=100, max_grad_norm=1.0, noise_multiplier=0.0)
    with pytest.raises(RuntimeError, match=r"Lfm2ShortConv: the rule's recomputation of out_proj's input"):
        engine.backward(lm_loss(model, _batch()))


def test_a_cache_is_refused_at_the_call():
    model = lfm2()
    PrivacyEngine(model, batch_size=6, sample_size=100, max_grad_norm=1.0, noise_multiplier=0.0)
    batch = _batch()
    with pytest.raises(ValueError, match=r"Lfm2ShortConv was given a cache.*use_cache=False"):
        model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=True)


def test_a_wrapped_output_projection_is_refused_at_construction():
    model = lfm2()
    block = model.model.layers[0].conv
    block.out_proj = nn.Sequential(block.out_proj)
    with pytest.raises(ValueError, match=r"short-convolution rule.*out_proj is a Sequential"):
        PrivacyEngine(model, batch_size=6, sample_size=100, max_grad_norm=1.0, noise_multiplier=1.0)
