"""Dory's LM head, a linear layer whose logits are scaled per vocabulary entry in float32
(``rules/scaled_linear.py``): its per-example gradients against autograd one example at a time. A tiny Dory,
its head and its nGPT scales (``rules/ngpt.py``), is against the brute-force oracle in every strategy x
clipping mode in ``test_rules_decoder_modules.py``."""

from __future__ import annotations

import pytest
import torch

from dpexp.privacy.rules import rule_for, scaled_linear
from tests.engine_models import dory


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
        # float32 sums over positions in another order: the error is relative to the terms, not to a sum
        # that cancels (an entry of 0.19 was 3e-6 off)
        atol = 1e-5 * scale.abs().max().item()
        torch.testing.assert_close(grads["logit_scale"].instantiate()[i], scale, rtol=1e-5, atol=atol)
