"""DeepSeek-V4's block-diagonal grouped linear (``rules/grouped_linear.py``) against the brute-force oracle:
alone between two linear layers, in every strategy x clipping mode, and in a tiny DeepSeek-V4, where it and
the attention's sinks no longer take the fallback; and the refusals of a bias its forward never adds and of a
wrapped projection the sinks rule cannot follow."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dpexp.privacy import PrivacyEngine
from dpexp.privacy.capture import unsupported_modules
from dpexp.privacy.rules import rule_for
from tests.engine_models import _padded_text, lm_loss, new_moe
from tests.oracle import check_clipped_step

pytestmark = pytest.mark.filterwarnings("ignore:noise_multiplier=0")


def _grouped(bias: bool = False) -> nn.Module:
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4GroupedLinear

    return DeepseekV4GroupedLinear(4, 3 * 5, 3, bias=bias)  # 3 groups of 4 features, each to 5


class GroupedNet(nn.Module):
    """Linear (B, T, 12) -> 3 groups of 4 -> grouped linear (each group to 5) -> tanh -> Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.grouped, self.out = nn.Linear(6, 12), _grouped(), nn.Linear(15, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x).unflatten(-1, (3, 4))
        return self.out(torch.tanh(self.grouped(h).flatten(-2))).sum(1)


def _loss(model: nn.Module, batch: dict) -> torch.Tensor:
    return F.softplus(model(batch["x"])).sum(1)


@pytest.mark.parametrize("clipping", ["flat", "per_layer", "groups"])
@pytest.mark.parametrize("strategy", ["bk", "ghost", "instantiate"])
def test_grouped_linear_matches_oracle(strategy, clipping):
    torch.manual_seed(0)
    model = GroupedNet().double()
    assert rule_for(model.grouped) is not None
    x = torch.randn(6, 5, 6, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    x[0] = 0.0  # an example with no gradient through the first layer
    groups = 2 if clipping == "groups" else None
    with warnings.catch_warnings():
        warnings.filterwarnings("error", ".*torch.func fallback")
        check_clipped_step(
            model, _loss, {"x": x}, [[0, 1, 2], [3, 4, 5]], strategy, clipping, groups, rel=1e-9
        )


def test_deepseek_v4_output_projection_needs_no_fallback_and_matches_oracle():
    """Its grouped projection by this rule, its attention's sinks by the sinks rule, which follows the heads'
    outputs through the grouped projection and the mixing one (``rules/sinks.py``)."""
    torch.manual_seed(0)
    model = new_moe("deepseek_v4")
    left = {name.rsplit(".", 1)[1] for name in unsupported_modules(model)}
    assert not {"DeepseekV4GroupedLinear", "DeepseekV4Attention"} & left, left
    batch = _padded_text(6, 8, 40, torch.Generator().manual_seed(0))
    check_clipped_step(model, lm_loss, batch, [[0, 1, 2], [3, 4, 5]], "bk", "per_layer", rel=1e-6)


def test_a_bias_the_forward_never_adds_is_refused():
    model = GroupedNet()
    model.grouped = _grouped(bias=True)
    with pytest.raises(
        ValueError, match=r"DeepseekV4GroupedLinear: .*trainable bias, which its forward never"
    ):
        PrivacyEngine(model, batch_size=2, sample_size=10, max_grad_norm=1.0, noise_multiplier=0.0)


def test_deepseek_v4_attention_with_a_wrapped_projection_is_refused():
    model = new_moe("deepseek_v4")
    attention = model.model.layers[0].self_attn
    attention.o_b_proj = nn.Sequential(attention.o_b_proj)
    with pytest.raises(ValueError, match=r"DeepseekV4Attention: .*its o_b_proj are wrapped or replaced"):
        PrivacyEngine(model, batch_size=2, sample_size=10, max_grad_norm=1.0, noise_multiplier=0.0)
