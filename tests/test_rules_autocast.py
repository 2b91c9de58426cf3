"""Rules that recompute part of their module's forward, under CPU bfloat16 autocast (``rules/autocast.py``):
the recomputation runs in the autocast state recorded at the call, so it reproduces the call and the gradients
are those of the computation autocast ran. Each family against the oracle under the same autocast
(``tests/oracle.py``'s ``check_clipped_step`` with ``autocast``); before, each was refused under autocast as a
forward the rule does not follow, or failed with a dtype error. And the DP property under autocast for one
family of each rule: one example alone, clipped in every group, moves the release by at most its bound."""

from __future__ import annotations

import copy

import pytest
import torch

from dpexp.privacy import PrivacyEngine
from tests import engine_models
from tests.engine_models import lm_loss
from tests.oracle import (
    check_clipped_step,
    engine_update,
    group_norms,
    per_example_grads,
    under_bf16_autocast,
)
from tests.test_rules_decoder_modules import batch

pytestmark = pytest.mark.filterwarnings("ignore:noise_multiplier=0", "ignore:.*torch.func fallback")

MICRO = [[0, 1, 2], [3, 4, 5]]
FAMILIES = {  # builder of tests/engine_models.py -> the rules it exercises under autocast
    "lfm2": "short_conv: the convolution replayed",
    "lfm2_moe": "short_conv: the convolution replayed",
    "mamba": "scan_mixers: the selective scan replayed",
    "falcon_mamba": "scan_mixers: the selective scan replayed, with norms",
    "jamba": "scan_mixers: the selective scan replayed, with norms",
    "zamba": "scan_mixers: Zamba's heads replayed",
    "mamba2": "scan_mixers: Mamba-2's graph reads, the convolution found by its autocast copy",
    "nemotron_h": "scan_mixers: Mamba-2's graph reads",
    "falcon_h1": "scan_mixers: Mamba-2's graph reads, the skip's input replayed",
    "qwen3_5": "scan_mixers: the gated delta net's graph reads",
    "qwen3_next": "scan_mixers: the gated delta net's graph reads",
    "olmo_hybrid": "scan_mixers: the gated delta net's graph reads",
    "kimi_linear": "scan_mixers and forget_gate: the delta attention's graph reads, the gate from f",
    "bailing_hybrid": "forget_gate: the gate from the kept f",
    "glm5_next": "forget_gate and hyper_connections",
    "recurrent_gemma": "rg_lru: the gates' products by their autocast copies, -8 r replayed",
    "inkling": "relative_logits: the product by its autocast copy",
}
RECOMPUTED = ["mamba2", "falcon_h1", "qwen3_5", "kimi_linear"]  # the scan mixers' paths without graph reads


def _step(name: str, strategy: str, clipping: str) -> None:
    torch.manual_seed(0)
    model = getattr(engine_models, name)().float().train()
    check_clipped_step(model, lm_loss, batch(), MICRO, strategy, clipping, rel=1e-2, autocast=True)


@pytest.mark.parametrize(("strategy", "clipping"), [("bk", "per_layer"), ("ghost", "flat")])
@pytest.mark.parametrize("name", list(FAMILIES))
def test_rules_match_the_oracle_under_autocast(name, strategy, clipping):
    _step(name, strategy, clipping)


@pytest.mark.parametrize("name", RECOMPUTED)
def test_scan_mixers_recomputed_in_the_calls_autocast_state_match_the_oracle(name, monkeypatch):
    """Where the call's graph gives no reads (hooks on saved tensors, here no nodes found at all), the
    Mamba-2, delta-net and Kimi rules recompute the mixer in the autocast state recorded at the call."""
    from dpexp.privacy.rules import scan_mixers

    monkeypatch.setattr(scan_mixers, "call_nodes", lambda *args, **kwargs: None)
    _step(name, "bk", "per_layer")


SENSITIVITY = ["lfm2", "mamba", "mamba2", "bailing_hybrid", "recurrent_gemma", "inkling"]


@pytest.mark.parametrize("name", SENSITIVITY)
def test_one_example_under_autocast_moves_the_sum_by_at_most_its_bound(name):
    """Each of two examples alone under bf16 autocast, clipped in every group (C_k a tenth of its smallest
    norm under the same autocast): the released sum has norm at most ``sqrt(sum_k C_k^2)`` up to float32
    rounding (as ``test_sensitivity.py``'s autocast test for the layers that need no recomputation)."""
    torch.manual_seed(0)
    model = getattr(engine_models, name)().float().train()
    data, loss = batch(), under_bf16_autocast(lm_loss)
    engine = PrivacyEngine(
        copy.deepcopy(model), batch_size=2, sample_size=10, max_grad_norm=1.0, noise_multiplier=0.0,
        clipping="per_layer",
    )  # fmt: skip
    groups = engine.groups
    pristine = copy.deepcopy(model)  # before any forward: RecurrentGemma keeps tensors of it
    norms = group_norms(per_example_grads(model, loss, data), groups)
    thresholds = (norms.min(0).values / 10).clamp_min(1e-12).tolist()
    bound = sum(c * c for c in thresholds) ** 0.5
    for i in range(2):
        delta, _ = engine_update(
            pristine, loss, {k: v[i : i + 1] for k, v in data.items()}, [[0]], batch_size=1,
            clipping="per_layer", thresholds=thresholds, max_grad_norm=1.0,
        )  # fmt: skip
        released = torch.cat([d.double().flatten() for d in delta.values()]).norm()
        assert released <= bound * (1 + 1e-5), f"example {i}: {released / bound - 1:.2e} over the bound"
