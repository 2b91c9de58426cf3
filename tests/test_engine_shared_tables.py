"""Shared layers called without a tensor input, their table read as a whole (dpexp.privacy.shared): Hugging
Face BEiT's and data2vec-vision's relative position bias, per layer or one for all layers, eager and SDPA
attention, resampled to another patch grid, against the brute-force oracle in every strategy x clipping
mode (float64, two micro-batches); a small declared table of our own; and the refusals: such a layer not
declared shared, a forward that recomputation does not reproduce, dropout inside it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dpexp.privacy import PrivacyEngine, VerificationError
from dpexp.privacy.capture import unsupported_modules
from dpexp.privacy.shared import register_shared
from tests.layer_models import BeitNet, masked_image_batch
from tests.layer_models import beit_embeddings_loss as loss_fn
from tests.oracle import SETTINGS, check_clipped_step, per_example_grads

pytestmark = pytest.mark.filterwarnings("ignore:noise_multiplier=0")

MICRO = [[0, 1, 2], [3, 4, 5]]


def _tables(model: nn.Module) -> list[str]:
    return [n for n, _ in model.named_parameters() if n.endswith("relative_position_bias_table")]


def _check(model: nn.Module, batch: dict[str, torch.Tensor], strategy: str, clipping: str, groups=None):
    grads = per_example_grads(model, loss_fn, batch)
    tables = _tables(model)
    assert tables and all(float(g[t].norm()) > 0 for g in grads for t in tables)
    check_clipped_step(model, loss_fn, batch, MICRO, strategy, clipping, groups)


@pytest.mark.parametrize("kind", ["beit", "data2vec"])
@pytest.mark.parametrize("relative", ["layer", "shared"])
def test_relative_position_bias_needs_no_fallback(kind, relative):
    assert unsupported_modules(BeitNet(kind, relative=relative)) == {}


@pytest.mark.parametrize("relative", ["layer", "shared"])
@pytest.mark.parametrize("strategy,clipping,groups", SETTINGS, ids=[f"{s}-{c}" for s, c, _ in SETTINGS])
def test_beit_relative_position_bias_matches_oracle(relative, strategy, clipping, groups):
    torch.manual_seed(0)
    _check(BeitNet(relative=relative).double(), masked_image_batch(True), strategy, clipping, groups)


@pytest.mark.parametrize("kind", ["beit", "data2vec"])
@pytest.mark.parametrize("relative", ["layer", "shared"])
@pytest.mark.parametrize("strategy", ["bk", "ghost", "instantiate"])
def test_relative_position_bias_under_sdpa_matches_oracle(kind, relative, strategy):
    """The bias reaches ``scaled_dot_product_attention`` as its ``attn_mask``, broadcast over dim 0."""
    torch.manual_seed(0)
    model = BeitNet(kind, relative=relative, attention="sdpa").double()
    _check(model, masked_image_batch(False), strategy, "per_layer")


@pytest.mark.parametrize("relative", ["layer", "shared"])
def test_data2vec_relative_position_bias_matches_oracle(relative):
    """data2vec-vision computes the shared table again in every layer: one use per layer."""
    torch.manual_seed(0)
    _check(BeitNet("data2vec", relative=relative).double(), masked_image_batch(True), "ghost", "groups", 2)


@pytest.mark.parametrize("strategy", ["bk", "ghost", "instantiate"])
def test_resampled_relative_position_bias_matches_oracle(strategy):
    """12x12 images: a 3x3 patch grid, so the module resamples its 2x2-grid table (bilinear) before the
    gather; the per-example gradient goes back through the resampling."""
    torch.manual_seed(0)
    model = BeitNet(absolute=False, relative="layer").double()
    _check(model, masked_image_batch(True, 12, 12), strategy, "per_layer")


def test_frozen_relative_position_bias_trains_the_rest():
    torch.manual_seed(0)
    model = BeitNet(relative="shared").double()
    for name in _tables(model):
        model.get_parameter(name).requires_grad_(False)
    check_clipped_step(model, loss_fn, masked_image_batch(True), MICRO, "bk", "per_layer")


# ------------------------------------------------------------------------------ a table of our own
class _Table(nn.Module):
    """A table of 3 positions x 4 features, resampled to T positions (T, 4) and returned whole, called
    without inputs; ``noisy``
    adds fresh noise on every call (a forward that recomputation does not reproduce); ``dropout`` drops
    entries in training."""

    def __init__(self, noisy: bool = False, dropout: float = 0.0) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.randn(3, 4))
        self.noisy, self.dropout = noisy, nn.Dropout(dropout)

    def forward(self, length: int) -> torch.Tensor:
        out = F.interpolate(self.table.T[None], size=length, mode="linear").squeeze(0).T  # (T, 4)
        if self.noisy:
            out = out + torch.randn_like(out)
        return self.dropout(out)


class _WithTable(nn.Module):
    """``time_major``: the table meets the features as (T, B, 4), dim 0 the positions."""

    def __init__(self, time_major: bool = False, **table) -> None:
        super().__init__()
        self.inp, self.bias, self.head = nn.Linear(3, 4), _Table(**table), nn.Linear(4, 2)
        self.time_major = time_major

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        if self.time_major:
            h = (h.transpose(0, 1) + self.bias(x.shape[1]).sum(0)).transpose(0, 1)
        else:
            h = h + self.bias(x.shape[1])
        return self.head(torch.tanh(h)).sum(1)


register_shared(_WithTable, "bias")


def _table_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return F.cross_entropy(model(batch["x"]), batch["y"], reduction="none")


def _table_step(length: int = 5, setting: tuple = ("bk", "flat", None), **options) -> None:
    """The oracle check of one step of :class:`_WithTable` on four examples in two micro-batches."""
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    batch = {
        "x": torch.randn(4, length, 3, generator=gen, dtype=torch.float64),
        "y": torch.tensor([0, 1, 1, 0]),
    }
    check_clipped_step(_WithTable(**options).double(), _table_loss, batch, [[0, 2], [1, 3]], *setting)


@pytest.mark.parametrize("strategy,clipping,groups", SETTINGS, ids=[f"{s}-{c}" for s, c, _ in SETTINGS])
def test_declared_table_read_as_a_whole_matches_oracle(strategy, clipping, groups):
    _table_step(setting=(strategy, clipping, groups))


@pytest.mark.parametrize(
    "length,match",
    [(5, "met the batch in a tensor of leading size 5"), (2, "row 0 of its output gradient depends")],
    ids=["size", "probe"],  # 2 = the micro-batch size: only the probe can tell
)
def test_table_meeting_a_time_major_tensor_is_refused(length, match):
    """Broadcast over dim 0 of a (T, B, d) tensor: its rows are positions, not examples (the size check at
    T != B, the probe at T = B)."""
    with pytest.raises(VerificationError, match=rf"layer 'bias' \(_Table\).* {match}"):
        _table_step(length=length, time_major=True)


def test_table_whose_forward_is_not_reproduced_is_refused():
    with pytest.raises(RuntimeError, match=r"layer 'bias' \(_Table\) is shared .* did not reproduce"):
        _table_step(noisy=True)


def test_table_with_dropout_is_refused():
    with pytest.raises(ValueError, match=r"module 'bias' \(_Table\) .*'dropout' applies dropout \(p=0.5\)"):
        PrivacyEngine(
            _WithTable(dropout=0.5), batch_size=4, sample_size=40, max_grad_norm=1.0, noise_multiplier=1.0
        )


def test_undeclared_beit_table_is_refused_naming_the_fix(monkeypatch):
    from dpexp.privacy import shared

    monkeypatch.setattr(shared, "_SHARED", {})
    model = BeitNet(relative="layer").double()
    engine = PrivacyEngine(model, batch_size=6, sample_size=60, max_grad_norm=1.0, noise_multiplier=0.0)
    with pytest.raises(VerificationError, match=r"was called without a tensor input.*register_shared"):
        engine.backward(loss_fn(model, masked_image_batch(False)))
