"""Switch Transformers' experts, one module per expert (``rules/expert_modules.py``), against the brute-force
oracle in every strategy x clipping mode (float64, two micro-batches, padded sources and targets, tokens
dropped at the experts' capacity); its float32 routers to float32 rounding; and the refusal of dropout
inside the experts in training."""

from __future__ import annotations

import warnings

import pytest
import torch

from dpexp.privacy import PrivacyEngine
from dpexp.privacy.capture import unsupported_modules
from tests.engine_models import _padded_text
from tests.oracle import SETTINGS, check_clipped_step
from tests.sensitivity_models import seq2seq_loss, switch_transformers

pytestmark = pytest.mark.filterwarnings("ignore:noise_multiplier=0")

MICRO = [[0, 1, 2], [3, 4, 5]]


def _batch() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    source = _padded_text(6, 8, 32, gen)
    labels = torch.randint(2, 32, (6, 6), generator=gen)
    labels[:, -1] = -100
    ids = source["input_ids"].masked_fill(source["attention_mask"] == 0, 0)
    return {"input_ids": ids, "attention_mask": source["attention_mask"], "labels": labels}


def _frozen_routers(model: torch.nn.Module) -> torch.nn.Module:
    for name, p in model.named_parameters():
        p.requires_grad_("router" not in name)
    return model


def test_switch_needs_no_fallback_and_drops_tokens():
    model = switch_transformers()
    assert unsupported_modules(model) == {}
    kept = []
    for module in model.modules():
        if type(module).__name__ == "SwitchTransformersExperts":
            module.register_forward_pre_hook(lambda m, args: kept.append(float(args[1].sum() / len(args[1]))))
    seq2seq_loss(model, _batch())
    assert min(kept) < 1.0  # some rows are beyond an expert's capacity


@pytest.mark.parametrize("strategy,clipping,groups", SETTINGS, ids=[f"{s}-{c}" for s, c, _ in SETTINGS])
def test_switch_experts_match_oracle(strategy, clipping, groups):
    """The routers frozen: every other parameter (experts, attention, T5 bias, norms) exact in float64."""
    model = _frozen_routers(switch_transformers())
    with warnings.catch_warnings():
        warnings.filterwarnings("error", ".*torch.func fallback")
        check_clipped_step(model, seq2seq_loss, _batch(), MICRO, strategy, clipping, groups)


@pytest.mark.parametrize("clipping", ["flat", "per_layer"])
def test_switch_routers_match_oracle_to_float32(clipping):
    """The routers' classifiers run in float32 (``router_dtype``): their gradients are float32 roundings."""
    check_clipped_step(switch_transformers(), seq2seq_loss, _batch(), MICRO, "bk", clipping, rel=1e-5)


def test_dropout_inside_the_experts_is_refused():
    model = switch_transformers().train()
    for module in model.modules():
        if type(module).__name__ == "SwitchTransformersDenseActDense":
            module.dropout.p = 0.1
    engine = PrivacyEngine(model, batch_size=6, sample_size=60, max_grad_norm=1.0, noise_multiplier=0.0)
    with pytest.raises(ValueError, match=r"experts apply dropout \(p = \[0.1\]\) .* dropout_rate=0"):
        engine.backward(seq2seq_loss(model, _batch()))
