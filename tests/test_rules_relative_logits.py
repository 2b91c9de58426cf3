"""Inkling's relative logits by rule (``rules/relative_logits.py``): the gradient at the product of the
relative states and the profile bank read off the call's graph. Inkling whole against the oracle, texts longer
than the bank's extent (distances past it masked), is in ``test_rules_inkling_moe.py``; here a frozen bank,
the per-example gradients against autograd one example at a time, and the refusal of parameters the rule does
not know (of a graph without the product: ``test_engine_graph_reads.py``)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dpexp.privacy import PrivacyEngine
from tests.engine_models import _padded_text, inkling, lm_loss
from tests.oracle import check_clipped_step, read_by_hand

pytestmark = pytest.mark.filterwarnings("ignore:noise_multiplier=0")

MICRO = [[0, 1, 2], [3, 4, 5]]


def _batch() -> dict[str, torch.Tensor]:
    return _padded_text(6, 10, 40, torch.Generator().manual_seed(0))


def _engine(model: nn.Module) -> PrivacyEngine:
    return PrivacyEngine(model, batch_size=6, sample_size=60, max_grad_norm=1.0, noise_multiplier=0.0)


def _banks(model: nn.Module) -> list[nn.Parameter]:
    return [m.proj for m in model.modules() if type(m).__name__ == "InklingRelativeLogits"]


def test_a_bank_frozen_in_one_layer_matches_oracle():
    model = inkling().train()
    banks = _banks(model)
    assert banks
    banks[0].requires_grad_(False)
    torch.manual_seed(0)
    check_clipped_step(model, lm_loss, _batch(), MICRO, "ghost", "per_layer", rel=1e-6)


def test_per_example_grads_match_autograd_one_example_at_a_time():
    """The module alone: relative states (B, T, heads, d_rel) of 10 positions with a bank of extent 8."""
    from transformers.models.inkling.modeling_inkling import InklingRelativeLogits

    from dpexp.privacy.rules import rule_for

    module = InklingRelativeLogits(4, 8).double()
    nn.init.normal_(module.proj)
    gen = torch.Generator().manual_seed(0)
    states = torch.randn(3, 10, 2, 4, dtype=torch.float64, generator=gen, requires_grad=True)
    positions = torch.arange(10)
    dy = torch.randn(3, 2, 10, 10, dtype=torch.float64, generator=gen)
    module.proj.requires_grad_(False)  # as the engine holds it: the product keeps it for the states' gradient
    out = module(states, positions, positions)
    reads = read_by_hand(module, (states,), out, [states], dy)
    grads = rule_for(module).per_example_grads(module, (states, reads), dy)
    module.proj.requires_grad_(True)
    for i in range(3):
        one = module(states[i : i + 1], positions, positions)
        (want,) = torch.autograd.grad(one, module.proj, dy[i : i + 1])
        torch.testing.assert_close(grads["proj"].instantiate()[i], want, rtol=1e-12, atol=1e-12)


def test_another_own_parameter_is_refused_at_construction():
    model = inkling()
    module = next(m for m in model.modules() if type(m).__name__ == "InklingRelativeLogits")
    module.extra = nn.Parameter(torch.zeros(3, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"InklingRelativeLogits: .*\['extra'\].*freeze proj"):
        _engine(model)
