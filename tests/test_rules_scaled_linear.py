"""Dory's LM head, a linear layer whose logits are scaled per vocabulary entry in float32
(``rules/scaled_linear.py``): its per-example gradients against autograd one example at a time, and a tiny
Dory against the brute-force oracle in every strategy x clipping mode (float64, its logits in float32, the
model's other own parameters on the exact fallback)."""

from __future__ import annotations

import pytest
import torch

from dpexp.privacy.capture import unsupported_modules
from dpexp.privacy.rules import rule_for, scaled_linear
from tests.engine_models import _padded_text, dory, lm_loss
from tests.oracle import SETTINGS, check_clipped_step

pytestmark = pytest.mark.filterwarnings("ignore:noise_multiplier=0", "ignore:.*torch.func fallback")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_head_grads_match_autograd_per_example(dtype):
    head = dory().lm_head.to(dtype)
    assert rule_for(head).per_example_grads is scaled_linear.scaled_head_grads
    x = torch.randn(3, 5, 16, dtype=dtype, generator=torch.Generator().manual_seed(0))
    dy = torch.randn(3, 5, 40, generator=torch.Generator().manual_seed(1))  # the float32 logits' gradient
    grads = scaled_linear.scaled_head_grads(head, x, dy)
    for i in range(3):
        out = head(x[i : i + 1])
        weight, scale = torch.autograd.grad(out, [head.weight, head.logit_scale], dy[i : i + 1])
        rel = 1e-12 if dtype == torch.float64 else 1e-5
        torch.testing.assert_close(grads["weight"].instantiate()[i], weight, rtol=rel, atol=rel)
        torch.testing.assert_close(grads["logit_scale"].instantiate()[i], scale, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("strategy,clipping,groups", SETTINGS, ids=[f"{s}-{c}" for s, c, _ in SETTINGS])
def test_dory_matches_oracle(strategy, clipping, groups):
    model = dory()
    assert "DoryLMHead" not in {kind.rsplit(".", 1)[1] for kind in unsupported_modules(model)}
    batch = _padded_text(6, 8, 40, torch.Generator().manual_seed(0))
    check_clipped_step(model, lm_loss, batch, [[0, 1, 2], [3, 4, 5]], strategy, clipping, groups, rel=1e-5)
