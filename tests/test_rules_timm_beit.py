"""timm's BEiT (``timm.models.beit``, the BEiT-large of Bu et al. 2023, Table 1) against the brute-force
oracle in every strategy x clipping mode (float64, two micro-batches): its attention's query and value
biases, relative position bias table and the ``qkv`` weight it reads itself, its blocks' two layer scales
(one drop-path module each), and its class token without an absolute position embedding; fused and unfused
attention, an absolute position embedding, a relative position bias shared by the blocks; and the refusals
with their fixes."""

from __future__ import annotations

import warnings

import pytest
import torch

from dpexp.privacy import PrivacyEngine
from dpexp.privacy.capture import unsupported_modules
from tests.engine_models import classification_loss
from tests.layer_models import timm_beit
from tests.oracle import SETTINGS, check_clipped_step

pytestmark = pytest.mark.filterwarnings("ignore:noise_multiplier=0")

MICRO = [[0, 1, 2], [3, 4, 5]]


def beit(fused: bool = False, abs_pos: bool = False, shared: bool = False) -> torch.nn.Module:
    return timm_beit(fused, abs_pos, shared).double()


def _batch() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {"x": torch.randn(6, 3, 16, 16, generator=gen, dtype=torch.float64), "y": torch.arange(6) % 3}


def test_beit_needs_no_fallback():
    assert unsupported_modules(beit()) == {}


@pytest.mark.parametrize("strategy,clipping,groups", SETTINGS, ids=[f"{s}-{c}" for s, c, _ in SETTINGS])
def test_beit_matches_oracle(strategy, clipping, groups):
    with warnings.catch_warnings():
        warnings.filterwarnings("error", ".*torch.func fallback")
        check_clipped_step(beit(), classification_loss, _batch(), MICRO, strategy, clipping, groups)


@pytest.mark.parametrize(
    "fused,abs_pos,shared", [(True, False, False), (False, True, False), (True, False, True)]
)
def test_beit_variants_match_oracle(fused, abs_pos, shared):
    """Fused attention (the scores inside one kernel), an absolute position embedding beside the class
    token, and a relative position bias shared by all blocks (its per-example gradient taken where it meets
    the batch, :mod:`dpexp.privacy.shared`)."""
    model = beit(fused, abs_pos, shared)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", ".*torch.func fallback")
        check_clipped_step(model, classification_loss, _batch(), MICRO, "bk", "per_layer")


def test_dropout_in_training_is_refused():
    model = beit()
    model.blocks[0].attn.attn_drop.p = 0.1
    engine = PrivacyEngine(model, batch_size=6, sample_size=60, max_grad_norm=1.0, noise_multiplier=0.0)
    refusal = r"dropout \{'attn_drop': 0.1, 'proj_drop': 0.0\} .* attn_drop_rate=0"
    with pytest.raises(ValueError, match=refusal):
        engine.backward(classification_loss(model, _batch()))


def test_one_drop_path_module_for_both_branches_is_refused():
    """The block rule tells its two scales apart by their drop-path modules."""
    model = beit()
    model.blocks[1].drop_path2 = model.blocks[1].drop_path1
    refusal = r"'blocks.1' \(Block\): its rule taps \['drop_path1', 'drop_path2'\]"
    with pytest.raises(ValueError, match=refusal):
        PrivacyEngine(model, batch_size=6, sample_size=60, max_grad_norm=1.0, noise_multiplier=0.0)
