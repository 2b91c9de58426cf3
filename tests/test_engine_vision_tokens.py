"""timm Vision Transformers: class/register tokens and position embedding by their own rule, not the fallback.

Exactness against the oracle is in ``test_engine_oracle.py`` (cases ``vit`` and ``vit_registers``); here: the
rule is what runs, it works in training mode with dropout after the tap, and unsupported layouts are refused.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from dpexp.privacy import PrivacyEngine
from dpexp.privacy.per_example import Dense
from dpexp.privacy.rules import register_rule
from tests.engine_models import vit


def _engine(model: nn.Module, **kwargs) -> PrivacyEngine:
    defaults = {"batch_size": 4, "sample_size": 40, "max_grad_norm": 1.0, "noise_multiplier": 0.0}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "noise_multiplier=0")
        return PrivacyEngine(model, **{**defaults, **kwargs})


def test_vit_needs_no_fallback():
    engine = _engine(vit(reg_tokens=1), generic_fallback=False)
    assert {"cls_token", "reg_token", "pos_embed"} <= set(engine.trainable_parameters())


def test_tap_sees_the_tokens_before_position_dropout():
    """With dropout after the tap (pos_drop) the token gradients are the slices of the tap's input gradient,
    so flat clipping of one example reproduces its clipped gradient from plain autograd."""
    torch.manual_seed(0)
    model = vit(pos_drop_rate=0.5).train()
    reference = vit(pos_drop_rate=0.5).train()
    reference.load_state_dict(model.state_dict())
    x = torch.randn(1, 3, 8, 8, dtype=torch.float64)
    y = torch.tensor([1])

    torch.manual_seed(1)
    nn.functional.cross_entropy(reference(x), y).backward()
    full = torch.cat([p.grad.flatten() for p in reference.parameters()])
    coef = min(1.0, 1e-3 / float(full.norm()))

    engine = _engine(model, batch_size=1, max_grad_norm=1e-3)
    optimizer = engine.attach(torch.optim.SGD(model.parameters(), lr=1.0))
    torch.manual_seed(1)
    engine.backward(nn.functional.cross_entropy(model(x), y, reduction="none"))
    engine._privatize()
    for name, p in model.named_parameters():
        expected = dict(reference.named_parameters())[name].grad * coef
        torch.testing.assert_close(p.grad, expected, rtol=1e-9, atol=1e-12, msg=name)
    optimizer.zero_grad()


@pytest.mark.parametrize(
    "kwargs,reason",
    [({"dynamic_img_size": True}, "dynamic_img_size"), ({"pos_embed": "none"}, "without pos_embed")],
)
def test_unsupported_token_layouts_are_refused(kwargs, reason):
    with pytest.raises(ValueError, match=f"VisionTransformer.*{reason}.*Freeze"):
        _engine(vit(**kwargs))


class _Affine(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(3))
        self.bias = nn.Parameter(torch.zeros(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight + self.bias


@register_rule(_Affine)
def _forgets_the_bias(module: _Affine, x: torch.Tensor, dy: torch.Tensor):
    return {"weight": Dense(dy * x)}


def test_rule_that_skips_a_parameter_fails_instead_of_leaving_it_unclipped():
    model = _Affine()
    engine = _engine(model)
    with pytest.raises(RuntimeError, match=r"no per-example gradient for its trainable parameters \['bias'"):
        engine.backward((model(torch.randn(4, 3)) ** 2).sum(1))
