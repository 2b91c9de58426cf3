"""Decoders whose own modules have rules since stop 62, each whole against the brute-force oracle in every
strategy x clipping mode (float64, padded texts, two micro-batches), no module left to the fallback:
DiffLlama's differential attention (``rules/differential.py``), CPM-Ant's norm and segment position bias
(``rules/rms_norm.py``, ``rules/embedding.py``), Doge's dynamic mask and residual scales
(``rules/dynamic_mask.py``, ``rules/residual_scale.py``); since stop 63 Dory's nGPT scales
(``rules/ngpt.py``) and RWKV-4's token shift and WKV recurrence (``rules/rwkv.py``); since stop 64 HY-V4's
hyper-connections (``rules/hyper_connections.py``). Each rule's own cases and refusals are in its test
file."""

from __future__ import annotations

import warnings

import pytest
import torch

from dpexp.privacy.capture import unsupported_modules
from tests.engine_models import _padded_text, cpmant, diffllama, doge, dory, hyper_connected, lm_loss, rwkv
from tests.oracle import check_clipped_step

pytestmark = pytest.mark.filterwarnings("ignore:noise_multiplier=0")

MICRO = [[0, 1, 2], [3, 4, 5]]
MODELS = {  # builder, tolerance
    # DiffLlama forms lambda's dot products in float32, CPM-Ant its norm's variance
    "diffllama": (diffllama, {"rel": 1e-6}),
    "cpmant": (cpmant, {"rel": 1e-6}),
    # Doge's eager attention takes its softmax in float32: A's gradient, a small sum of large terms, is exact
    # to that rounding (the oracle's and the rule's differ by about 1e-5 of it), the rest to 1e-8
    "doge": (doge, {"rel": 1e-6, "floor": 1e-9}),
    # Dory's L2 norms and its LM head's logits in float32
    "dory": (dory, {"rel": 1e-5}),
    # RWKV's recurrence runs in float32
    "rwkv": (rwkv, {"rel": 1e-5}),
    # HY-V4's hyper-connections compute in float32
    "hy_v4": (lambda: hyper_connected("hy_v4"), {"rel": 1e-5}),
}


def batch() -> dict[str, torch.Tensor]:
    return _padded_text(6, 8, 40, torch.Generator().manual_seed(0))


@pytest.mark.parametrize("name", list(MODELS))
def test_needs_no_fallback(name):
    assert unsupported_modules(MODELS[name][0]()) == {}


@pytest.mark.parametrize("clipping", ["flat", "per_layer", "groups"])
@pytest.mark.parametrize("strategy", ["bk", "ghost", "instantiate"])
@pytest.mark.parametrize("name", list(MODELS))
def test_rules_match_oracle_without_the_fallback(name, strategy, clipping):
    torch.manual_seed(0)
    build, tolerance = MODELS[name]
    groups = 2 if clipping == "groups" else None
    with warnings.catch_warnings():
        warnings.filterwarnings("error", ".*torch.func fallback")
        check_clipped_step(build(), lm_loss, batch(), MICRO, strategy, clipping, groups=groups, **tolerance)
