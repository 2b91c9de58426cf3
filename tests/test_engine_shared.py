"""Shared tensors that meet the batch later (dpexp.privacy.shared): T5's relative attention bias against the
brute-force oracle, and the refusals where the mechanism does not apply."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dpexp.privacy import PrivacyEngine, VerificationError
from dpexp.privacy.shared import register_shared
from tests import engine_models
from tests.oracle import clipped_mean, engine_update, group_norms, per_example_grads
from tests.sensitivity_models import seq2seq_loss, t5

pytestmark = pytest.mark.filterwarnings("ignore:noise_multiplier=0")

BIAS = "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"
DECODER_BIAS = "decoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"


def _t5_case(size: int, length: int, attention: str, layers: int = 1):
    """A tiny float64 T5 and a padded seq2seq batch (source padding, targets with -100)."""
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    model = t5(layers)
    model.set_attn_implementation(attention)
    source = engine_models._padded_text(size, length, 32, gen)
    source["input_ids"] = source["input_ids"].masked_fill(source["attention_mask"] == 0, 0)
    target = torch.randint(2, 32, (size, length + 1), generator=gen)
    target[:, -2:] = -100  # padded target positions
    batch = {"input_ids": source["input_ids"], "attention_mask": source["attention_mask"], "labels": target}
    return model, batch


def _groups(model, clipping, groups):
    engine = PrivacyEngine(
        model,
        batch_size=2,
        sample_size=10,
        max_grad_norm=1.0,
        noise_multiplier=0.0,
        clipping=clipping,
        groups=groups,
    )
    partition = engine.groups
    engine.detach()
    return partition


def _check_t5(attention: str, strategy: str, clipping: str, groups, length: int, layers: int = 1) -> None:
    size = 4
    model, batch = _t5_case(size, length, attention, layers)
    grads = per_example_grads(model, seq2seq_loss, batch)
    assert all(float(g[BIAS].norm()) > 0 and float(g[DECODER_BIAS].norm()) > 0 for g in grads)
    partition = _groups(model, clipping, groups)
    norms = group_norms(grads, partition)
    thresholds = norms.median(0).values.tolist()  # about half of the examples clipped in every group
    clipped = norms > torch.tensor(thresholds)
    assert clipped.any() and (~clipped).any()
    expected = clipped_mean(grads, partition, thresholds, batch_size=size)
    delta, _ = engine_update(
        model,
        seq2seq_loss,
        batch,
        [[0, 1], [2], [3]],  # a micro-batch of one example: the bias never broadcasts there
        batch_size=size,
        strategy=strategy,
        clipping=clipping,
        groups=groups,
        thresholds=thresholds,
        max_grad_norm=1.0,
    )
    for name, want in expected.items():
        err = (delta[name] - want).norm() / want.norm().clamp_min(1e-12)
        assert err < 1e-9, f"{attention}/{strategy}/{clipping}: {name} relative error {err:.2e}"


def test_t5_relative_attention_bias_matches_oracle():
    """Encoder and decoder bias, SDPA (the bias meets the batch in torch.where with the padding mask and in
    scaled_dot_product_attention), two layers sharing each bias, source length 4 = the batch size."""
    _check_t5("sdpa", "bk", "per_layer", None, length=4, layers=2)


@pytest.mark.slow
@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("strategy", ["bk", "ghost", "instantiate"])
@pytest.mark.parametrize("clipping,groups", [("flat", None), ("per_layer", None), ("groups", 2)])
@pytest.mark.parametrize("length", [4, 6])  # 4 = the batch size
def test_t5_every_strategy_and_clipping_matches_oracle(attention, strategy, clipping, groups, length):
    _check_t5(attention, strategy, clipping, groups, length)


# ------------------------------------------------------------------------------------------------ refusals
class _SharedBias(nn.Module):
    """A per-position bias table looked up on a (T,) tensor of positions, shared by all examples, combined
    with the (B, T, d) features by ``combine``."""

    def __init__(self, combine: str) -> None:
        super().__init__()
        self.inp = nn.Linear(3, 4)
        self.bias = nn.Embedding(8, 4)
        self.head = nn.Linear(4, 2)
        self.combine = combine

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        table = self.bias(torch.arange(x.shape[1]))  # (T, d), no example dimension
        if self.combine == "add":
            h = h + table
        elif self.combine == "einsum":
            h = h * torch.einsum("btd,td->bt", h, table)[..., None]
        elif self.combine == "add_and_cat":
            h = h + table
            h = torch.cat([h, table.expand(h.shape[0], -1, -1)], 1)
        elif self.combine == "time_major":
            h = (h.transpose(0, 1) + table.sum(0)).transpose(0, 1)  # broadcast over (T, B, d): dim 0 is time
        return self.head(h).sum(1)


register_shared(_SharedBias, "bias")


def _bias_step(combine: str, length: int):
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    model = _SharedBias(combine).double()
    batch = {
        "x": torch.randn(4, length, 3, generator=gen, dtype=torch.float64),
        "y": torch.tensor([0, 1, 1, 0]),
    }

    def loss(m, b):
        return F.cross_entropy(m(b["x"]), b["y"], reduction="none")

    grads = per_example_grads(model, loss, batch)
    expected = clipped_mean(grads, [list(grads[0])], [0.05], batch_size=4)
    delta, _ = engine_update(model, loss, batch, [[0, 1, 2, 3]], batch_size=4, max_grad_norm=0.05)
    return delta, expected


def test_declared_shared_table_added_to_the_batch_matches_oracle():
    delta, expected = _bias_step("add", 5)
    for name, want in expected.items():
        torch.testing.assert_close(delta[name], want, rtol=1e-9, atol=1e-12)


def test_shared_tensor_never_meeting_the_batch_in_a_split_operation_is_refused():
    with pytest.raises(VerificationError, match=r"layer 'bias' is shared .* never met the batch.*einsum"):
        _bias_step("einsum", 5)


def test_shared_tensor_with_a_use_that_is_not_split_is_refused():
    """Added (split) and concatenated with the batch (not split): the parts miss the concatenated use."""
    with pytest.raises(VerificationError, match=r"layer 'bias' .* does not split .*cat"):
        _bias_step("add_and_cat", 5)


@pytest.mark.parametrize("length", [4, 6])  # 4 = the batch size: only the probe can tell
def test_shared_tensor_meeting_a_time_major_tensor_is_refused(length):
    """Expanded to dim 0 of a (T, B, d) tensor: its rows are time steps, not examples (the size check at
    T != B, the probe at T = B)."""
    with pytest.raises(VerificationError, match="layer 'bias'"):
        _bias_step("time_major", length)


def test_deberta_v2_relative_embeddings_are_refused_with_their_cause():
    from transformers import DebertaV2Config, DebertaV2ForSequenceClassification

    config = DebertaV2Config(
        vocab_size=32,
        hidden_size=8,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=12,
        max_position_embeddings=16,
        relative_attention=True,
        position_buckets=4,
        pos_att_type=["p2c", "c2p"],
    )
    model = DebertaV2ForSequenceClassification(config)
    with pytest.raises(ValueError, match=r"'deberta.encoder' \(DebertaV2Encoder, relative_attention=True\)"):
        PrivacyEngine(model, batch_size=2, sample_size=10, max_grad_norm=1.0, noise_multiplier=1.0)
    model.deberta.requires_grad_(False)  # only the classifier trains: nothing shared reaches it
    PrivacyEngine(model, batch_size=2, sample_size=10, max_grad_norm=1.0, noise_multiplier=1.0)
