"""timm Swin's ``WindowAttention`` (its ``relative_position_bias_table``, added to the scores of every window
of every example) against the brute-force oracle in every strategy x clipping mode (float64, two
micro-batches): a two-stage Swin whose first stage has 4 windows per example, plain and shifted (with the
shift mask), and whose second stage has one; and the refusal of timm's fused attention path."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from dpexp.privacy import PrivacyEngine
from dpexp.privacy.capture import unsupported_modules
from dpexp.privacy.verification import VerificationError
from tests.engine_models import classification_loss as swin_loss
from tests.layer_models import swin
from tests.oracle import SETTINGS, check_clipped_step

pytestmark = pytest.mark.filterwarnings("ignore:noise_multiplier=0")

MICRO = [[0, 1, 2], [3, 4, 5]]


def _batch() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {"x": torch.randn(6, 3, 8, 8, generator=gen, dtype=torch.float64), "y": torch.arange(6) % 3}


def test_swin_needs_no_fallback():
    model = swin()
    assert unsupported_modules(model) == {}
    assert any(block.shift_size != (0, 0) for block in model.layers[0].blocks)  # a shifted, masked block


@pytest.mark.parametrize("strategy,clipping,groups", SETTINGS, ids=[f"{s}-{c}" for s, c, _ in SETTINGS])
def test_window_attention_matches_oracle(strategy, clipping, groups):
    torch.manual_seed(0)
    model = swin().double()
    with warnings.catch_warnings():
        warnings.filterwarnings("error", ".*torch.func fallback")
        check_clipped_step(model, swin_loss, _batch(), MICRO, strategy, clipping, groups)


def test_fused_attention_is_refused():
    model = swin().double()
    model.layers[0].blocks[1].attn.fused_attn = True
    with pytest.raises(ValueError, match=r"WindowAttention: .*fused_attn=True .*TIMM_FUSED_ATTN=0"):
        PrivacyEngine(model, batch_size=6, sample_size=60, max_grad_norm=1.0, noise_multiplier=1.0)


class _WindowMajor(nn.Module):
    """Windows laid out window-major, (nW*B, N, C): row w*B + i is example i's window w. The rows cannot be
    folded per example as [i*nW, (i+1)*nW); the probe must find that, whatever the sizes (nW = B here)."""

    def __init__(self) -> None:
        super().__init__()
        from timm.models.swin_transformer import WindowAttention

        self.embed = nn.Linear(5, 8)
        self.attn = WindowAttention(dim=8, num_heads=2, window_size=2)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, nW, N, 5)
        h = self.embed(x)
        windows = self.attn(h.transpose(0, 1).reshape(-1, *h.shape[2:]))
        return self.head(windows.view(h.shape[1], h.shape[0], *h.shape[2:]).mean((0, 2)))


def test_window_major_rows_are_refused():
    model = _WindowMajor().double()
    for name, p in model.named_parameters():  # only the table: its rule's rows are the ones checked
        p.requires_grad_(name == "attn.relative_position_bias_table")
    engine = PrivacyEngine(model, batch_size=3, sample_size=30, max_grad_norm=1.0, noise_multiplier=0.0)
    x = torch.randn(3, 3, 4, 5, dtype=torch.float64)
    loss = torch.nn.functional.cross_entropy(model(x), torch.arange(3), reduction="none")
    with pytest.raises(VerificationError, match=r"layer 'attn' \(WindowAttention\): row 0 .* other examples"):
        engine.backward(loss)
