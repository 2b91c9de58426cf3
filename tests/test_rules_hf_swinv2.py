"""Hugging Face Swin V2's ``Swinv2SelfAttention`` (scaled cosine attention: a learnt per-head temperature
``logit_scale``, and a relative position bias computed by an MLP from a coordinate buffer shared by all
examples) against the brute-force oracle in every strategy x clipping mode (float64, two micro-batches): a
two-stage Swin V2 whose first stage has 4 windows per example, plain and shifted (with the shift mask), one
temperature clamped; its attention probabilities in the loss; window-major rows refused by the probe; and
the refusals of what the rule cannot recompute."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dpexp.privacy import PrivacyEngine
from dpexp.privacy.capture import unsupported_modules
from dpexp.privacy.verification import VerificationError
from tests.engine_models import classification_loss as loss_fn
from tests.layer_models import HFSwinv2Net as SwinNet
from tests.oracle import SETTINGS, check_clipped_step

pytestmark = pytest.mark.filterwarnings("ignore:noise_multiplier=0")

MICRO = [[0, 1, 2], [3, 4, 5]]


def _batch(dtype: torch.dtype = torch.float64) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {"x": torch.randn(6, 3, 16, 16, generator=gen, dtype=dtype), "y": torch.arange(6) % 3}


def test_hf_swinv2_needs_no_fallback():
    model = SwinNet()
    assert unsupported_modules(model) == {}
    assert model.backbone.encoder.layers[0].blocks[1].shift_size > 0  # a shifted, masked block


@pytest.mark.parametrize("strategy,clipping,groups", SETTINGS, ids=[f"{s}-{c}" for s, c, _ in SETTINGS])
def test_hf_swinv2_attention_matches_oracle(strategy, clipping, groups):
    torch.manual_seed(0)
    model = SwinNet().double()
    with warnings.catch_warnings():
        warnings.filterwarnings("error", ".*torch.func fallback")  # the attention must not take it
        check_clipped_step(model, loss_fn, _batch(), MICRO, strategy, clipping, groups)


@pytest.mark.parametrize("strategy", ["bk", "instantiate"])
def test_returned_probabilities_in_the_loss_match_oracle(strategy):
    torch.manual_seed(0)
    model = SwinNet(attentions=True).double()
    check_clipped_step(model, loss_fn, _batch(), MICRO, strategy, "per_layer")


def test_float32_matches_oracle():
    torch.manual_seed(0)
    check_clipped_step(SwinNet(), loss_fn, _batch(torch.float32), MICRO, "bk", "flat", rel=1e-5, floor=1e-6)


def _engine(model: nn.Module) -> PrivacyEngine:
    return PrivacyEngine(model, batch_size=6, sample_size=60, max_grad_norm=1.0, noise_multiplier=0.0)


def test_attention_dropout_in_training_is_refused():
    net = SwinNet(attention_dropout=0.1).double()
    engine = _engine(net)
    with pytest.raises(ValueError, match=r"\(Swinv2SelfAttention\): .*attention dropout \(p=0.1\)"):
        engine.backward(loss_fn(net, _batch()))


def test_other_bias_network_is_refused():
    model = SwinNet().double()
    attention = model.backbone.encoder.layers[0].blocks[0].attention.self
    attention.continuous_position_bias_mlp.append(nn.Tanh())
    with pytest.raises(ValueError, match=r"Swinv2SelfAttention: .*not Sequential\(Linear, ReLU, Linear\)"):
        _engine(model)


def test_frozen_temperature_and_bias_need_no_rule():
    """Frozen, the module owns nothing trainable the rule would cover; the projections keep their rules."""
    model = SwinNet().double()
    for name, p in model.named_parameters():
        if "logit_scale" in name or "continuous_position_bias_mlp" in name:
            p.requires_grad_(False)
    check_clipped_step(model, loss_fn, _batch(), MICRO, "bk", "flat")


class _WindowMajor(nn.Module):
    """Windows laid out window-major, (nW*B, N, C): row w*B + i is example i's window w. The rows cannot be
    folded per example as [i*nW, (i+1)*nW); the probe must find that, whatever the sizes (nW = B here)."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import Swinv2Config
        from transformers.models.swinv2.modeling_swinv2 import Swinv2SelfAttention

        config = Swinv2Config(embed_dim=8, window_size=2, attention_probs_dropout_prob=0.0)
        self.embed = nn.Linear(5, 8)
        self.attn = Swinv2SelfAttention(config, dim=8, num_heads=2, window_size=2)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, nW, N, 5)
        h = self.embed(x)
        (windows,) = self.attn(h.transpose(0, 1).reshape(-1, *h.shape[2:]))
        return self.head(windows.view(h.shape[1], h.shape[0], *h.shape[2:]).mean((0, 2)))


def test_window_major_rows_are_refused():
    model = _WindowMajor().double()
    for name, p in model.named_parameters():  # only the attention's own: its rule's rows are the ones checked
        p.requires_grad_(name == "attn.logit_scale")
    engine = PrivacyEngine(model, batch_size=3, sample_size=30, max_grad_norm=1.0, noise_multiplier=0.0)
    x = torch.randn(3, 3, 4, 5, dtype=torch.float64)
    loss = F.cross_entropy(model(x), torch.arange(3), reduction="none")
    match = r"layer 'attn' \(Swinv2SelfAttention\): row 0 .* other examples"
    with pytest.raises(VerificationError, match=match):
        engine.backward(loss)
