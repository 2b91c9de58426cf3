"""Shared tensors that meet the batch later (dpexp.privacy.shared): T5's and LongT5's relative attention bias,
the learned positions of BART's decoder and of BioGPT, and DeBERTa-v2's relative embeddings (a shared graph
through LayerNorm and the attention projections) against the brute-force oracle, and the refusals where the
mechanism does not apply."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dpexp.privacy import PrivacyEngine, VerificationError
from dpexp.privacy.shared import register_shared, register_shared_weight
from tests import engine_models
from tests.oracle import check_clipped_step, clipped_mean, engine_update, group_norms, per_example_grads
from tests.sensitivity_models import bart, deberta_v2, longt5, mpnet, seq2seq_loss, t5

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
        elif self.combine == "add_and_einsum":
            h = h + table
            h = h * torch.einsum("btd,td->bt", h, table)[..., None]
        elif self.combine == "expand_and_cat":  # expanded to the batch (split there), then concatenated
            h = torch.cat([h, table.expand(h.shape[0], -1, -1)], 1)
        elif self.combine == "two_sizes":  # also meets a (1, T, d) batch mean: expanded to 1 there
            h = h + table
            h = h + table * h.mean(0, keepdim=True)
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


def biogpt() -> nn.Module:
    """Tiny random BioGPT: learned positions for position ids of batch size 1 passed by keyword (declared
    shared), scaled word embeddings."""
    from transformers import BioGptConfig, BioGptForCausalLM

    config = BioGptConfig(
        vocab_size=40,
        hidden_size=8,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=16,
        max_position_embeddings=16,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        scale_embedding=True,
        pad_token_id=1,
    )
    return BioGptForCausalLM(config).double().eval()


def _classified_text(gen: torch.Generator) -> dict[str, torch.Tensor]:
    batch = engine_models._padded_text(4, 7, 40, gen)
    batch["labels"] = torch.randint(0, 2, (4,), generator=gen)
    return batch


def _seq2seq_batch(gen: torch.Generator, pad: int) -> dict[str, torch.Tensor]:
    source = engine_models._padded_text(4, 6, 32, gen)
    target = torch.randint(3, 32, (4, 5), generator=gen)
    target[:, -1] = -100  # a padded target position
    ids = source["input_ids"].masked_fill(source["attention_mask"] == 0, pad)
    return {"input_ids": ids, "attention_mask": source["attention_mask"], "labels": target}


SHARED_POSITIONS = {  # model, per-example loss, batch
    "longt5_local": lambda gen: (longt5("local"), seq2seq_loss, _seq2seq_batch(gen, 0)),
    "longt5_transient_global": lambda gen: (longt5("transient-global"), seq2seq_loss, _seq2seq_batch(gen, 0)),
    "bart": lambda gen: (bart(), seq2seq_loss, _seq2seq_batch(gen, 1)),
    "blenderbot_small": lambda gen: (bart("blenderbot_small"), seq2seq_loss, _seq2seq_batch(gen, 1)),
    "blenderbot": lambda gen: (bart("blenderbot"), seq2seq_loss, _seq2seq_batch(gen, 1)),
    "bigbird_pegasus": lambda gen: (bart("bigbird_pegasus"), seq2seq_loss, _seq2seq_batch(gen, 1)),
    "biogpt": lambda gen: (biogpt(), engine_models.lm_loss, engine_models._padded_text(4, 7, 40, gen)),
    "mpnet": lambda gen: (mpnet(), engine_models.seq_classification_loss, _classified_text(gen)),
}


@pytest.mark.parametrize("name", list(SHARED_POSITIONS))
@pytest.mark.parametrize("strategy", ["bk", "ghost", "instantiate"])
@pytest.mark.parametrize("clipping,groups", [("flat", None), ("per_layer", None), ("groups", 2)])
def test_shared_positions_of_hugging_face_models_match_oracle(name, strategy, clipping, groups, recwarn):
    """Refused before their owners were declared shared (the positions' output gradient has batch size 1;
    MPNet's bias, expanded to the batch and added in place, never met it in an operation that was split)."""
    torch.manual_seed(0)
    model, loss, batch = SHARED_POSITIONS[name](torch.Generator().manual_seed(0))
    check_clipped_step(
        model, loss, batch, [[0, 1], [2, 3]], strategy, clipping, groups, rel=1e-7, floor=1e-12
    )


@pytest.mark.parametrize("name", ["mpnet", "bart", "blenderbot_small"])
def test_shared_positions_in_micro_batches_of_one_match_oracle(name, recwarn):
    """With one example a micro-batch, MPNet's expansion to the batch is no expansion: its bias meets the
    batch in the in-place addition instead."""
    torch.manual_seed(0)
    model, loss, batch = SHARED_POSITIONS[name](torch.Generator().manual_seed(0))
    check_clipped_step(model, loss, batch, [[0], [1], [2], [3]], "bk", "per_layer", rel=1e-7, floor=1e-12)


def test_declared_shared_table_added_to_the_batch_matches_oracle():
    delta, expected = _bias_step("add", 5)
    for name, want in expected.items():
        torch.testing.assert_close(delta[name], want, rtol=1e-9, atol=1e-12)


def test_shared_tensor_never_meeting_the_batch_in_a_split_operation_is_refused():
    with pytest.raises(VerificationError, match=r"layer 'bias' is shared .* never met the batch.*einsum"):
        _bias_step("einsum", 5)


def test_shared_tensor_with_a_use_that_is_not_split_is_refused():
    """Added (split) and contracted with the batch in an einsum (not split): the parts miss that use."""
    with pytest.raises(VerificationError, match=r"layer 'bias' .* does not split .*einsum"):
        _bias_step("add_and_einsum", 5)


@pytest.mark.parametrize("length", [4, 5])  # 4 = the batch size
def test_shared_tensor_expanded_to_the_batch_matches_oracle(length):
    """``table.expand(B, ...)`` is where it meets the batch: row i of the expansion is example i's, whatever
    uses it afterwards (here a concatenation with the features)."""
    delta, expected = _bias_step("expand_and_cat", length)
    for name, want in expected.items():
        torch.testing.assert_close(delta[name], want, rtol=1e-9, atol=1e-12)


def test_shared_tensor_meeting_the_batch_with_two_sizes_is_refused():
    with pytest.raises(VerificationError, match=r"layer 'bias' .* leading sizes (4 and 1|1 and 4)"):
        _bias_step("two_sizes", 5)


@pytest.mark.parametrize("length", [4, 6])  # 4 = the batch size: only the probe can tell
def test_shared_tensor_meeting_a_time_major_tensor_is_refused(length):
    """Expanded to dim 0 of a (T, B, d) tensor: its rows are time steps, not examples (the size check at
    T != B, the probe at T = B)."""
    with pytest.raises(VerificationError, match="layer 'bias'"):
        _bias_step("time_major", length)


# ------------------------------------------------------------------------------------------ DeBERTa-v2
REL = "deberta.encoder.rel_embeddings.weight"
REL_NORM = "deberta.encoder.LayerNorm.weight"


def _deberta_case(share_att_key: bool, norm: str, length: int, pos_att_type=("p2c", "c2p")):
    """A tiny float64 DeBERTa-v2 classifier and a padded batch of 4."""
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    batch = engine_models._padded_text(4, length, 32, gen)
    batch["labels"] = torch.tensor([0, 1, 1, 0])
    return deberta_v2(share_att_key, norm, pos_att_type), batch


# micro-batches of two and one examples: the projections are repeated twice, then once
DEBERTA_MICRO_BATCHES = [[0, 1], [2], [3]]


@pytest.mark.parametrize(
    "share_att_key,norm,strategy,clipping,groups",
    [
        (True, "layer_norm", "bk", "per_layer", None),
        (True, "none", "ghost", "flat", None),
        (False, "layer_norm", "instantiate", "groups", 2),
        (False, "none", "bk", "flat", None),
    ],
)
def test_deberta_v2_relative_embeddings_match_oracle(share_att_key, norm, strategy, clipping, groups):
    """Every parameter on the shared path (the embeddings read directly, their LayerNorm, the projections'
    shared use) has its per-example gradient, and the step equals the oracle's."""
    model, batch = _deberta_case(share_att_key, norm, length=6)
    grads = per_example_grads(model, engine_models.seq_classification_loss, batch)
    projection = "query_proj" if share_att_key else "pos_query_proj"
    on_path = [REL, f"deberta.encoder.layer.1.attention.self.{projection}.weight"]
    on_path += [REL_NORM] if norm == "layer_norm" else []
    assert all(float(g[name].norm()) > 1e-3 for g in grads for name in on_path)
    check_clipped_step(
        model, engine_models.seq_classification_loss, batch, DEBERTA_MICRO_BATCHES, strategy, clipping, groups
    )


def test_deberta_v2_with_an_unused_shared_projection_matches_oracle():
    """c2p only with share_att_key: every layer still projects the embeddings with query_proj, whose
    result never reaches the loss (that use gets no gradient and its group is finished without it)."""
    model, batch = _deberta_case(True, "layer_norm", length=6, pos_att_type=("c2p",))
    check_clipped_step(
        model, engine_models.seq_classification_loss, batch, DEBERTA_MICRO_BATCHES, "bk", "per_layer"
    )


@pytest.mark.slow
@pytest.mark.parametrize("share_att_key", [True, False])
@pytest.mark.parametrize("norm", ["layer_norm", "none"])
@pytest.mark.parametrize("strategy", ["bk", "ghost", "instantiate"])
@pytest.mark.parametrize("clipping,groups", [("flat", None), ("per_layer", None), ("groups", 2)])
@pytest.mark.parametrize("length", [4, 6])  # 4 = the batch size
def test_deberta_v2_every_strategy_and_clipping_matches_oracle(
    share_att_key, norm, strategy, clipping, groups, length
):
    model, batch = _deberta_case(share_att_key, norm, length)
    check_clipped_step(
        model, engine_models.seq_classification_loss, batch, DEBERTA_MICRO_BATCHES, strategy, clipping, groups
    )


def test_deberta_v2_frozen_relative_embeddings_train_the_rest():
    """rel_embeddings frozen: its LayerNorm and the projections still get their shared uses' gradients."""
    model, batch = _deberta_case(True, "layer_norm", length=5)
    model.deberta.encoder.rel_embeddings.requires_grad_(False)
    check_clipped_step(
        model, engine_models.seq_classification_loss, batch, [[0, 1, 2, 3]], "ghost", "per_layer"
    )


# ------------------------------------------------------------------------ refusals of shared graphs
class _SharedRows(nn.Module):
    """A (T, d) table read directly (``self.table.weight``), passed to ``norm`` and projected by ``proj``,
    repeated along dim 0 and added to the (B, T, d) features: DeBERTa-v2's shared graph in small. ``mode``
    breaks it: ``flipped`` gives example i the block of example B-1-i, ``extra_use`` also uses the weight
    outside the submodules, ``no_rule`` projects it with a layer without a rule."""

    def __init__(self, mode: str) -> None:
        super().__init__()
        self.inp = nn.Linear(3, 4)
        self.table = nn.Embedding(5, 4)
        self.norm = nn.LayerNorm(4)
        self.proj = _NoRule() if mode == "no_rule" else nn.Linear(4, 4)
        self.head = nn.Linear(4, 2)
        self.mode = mode

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        rows = (
            self.proj(self.norm(self.table.weight)).repeat(h.shape[0], 1).view(h.shape)
        )  # a block per example
        h = h + (rows.flip(0) if self.mode == "flipped" else rows)
        if self.mode == "extra_use":
            h = h + self.table.weight.mean()
        return self.head(h).sum(1)


class _NoRule(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale


register_shared_weight(_SharedRows, "table")


def _rows_step(mode: str):
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    model = _SharedRows(mode).double()
    batch = {"x": torch.randn(4, 5, 3, generator=gen, dtype=torch.float64), "y": torch.tensor([0, 1, 1, 0])}

    def loss(m, b):
        return F.cross_entropy(m(b["x"]), b["y"], reduction="none")

    grads = per_example_grads(model, loss, batch)
    expected = clipped_mean(grads, [list(grads[0])], [0.05], batch_size=4)
    delta, _ = engine_update(model, loss, batch, [[0, 1, 2, 3]], batch_size=4, max_grad_norm=0.05)
    return delta, expected


def test_declared_shared_weight_repeated_to_the_batch_matches_oracle():
    delta, expected = _rows_step("plain")
    assert float(expected["table.weight"].norm()) > 0
    for name, want in expected.items():
        torch.testing.assert_close(delta[name], want, rtol=1e-9, atol=1e-12)


def test_shared_repeat_whose_blocks_are_not_the_examples_is_refused():
    """Block i of the repetition goes to example B-1-i: the probe sees row i of the table's per-example
    output gradient scale with another example's weight."""
    with pytest.raises(VerificationError, match=r"row \d+ of its output gradient depends on other examples"):
        _rows_step("flipped")


def test_shared_weight_also_used_outside_the_submodules_is_refused():
    """The weight also enters the features through a plain ``mean()``, a use no hook sees: check 2 (the
    engine's sums against autograd's) names it."""
    with pytest.raises(VerificationError, match=r"parameter 'table.weight'"):
        _rows_step("extra_use")


def test_layer_without_rule_on_a_shared_tensor_is_refused():
    with pytest.raises(ValueError, match=r"layer 'proj' \(_NoRule\) is called on a tensor shared .*'table'"):
        _rows_step("no_rule")


def test_shared_weight_with_padding_idx_is_refused():
    model = _SharedRows("plain")
    model.table.padding_idx = 0
    with pytest.raises(ValueError, match=r"table \(Embedding\) is declared a weight .* without padding_idx"):
        PrivacyEngine(model, batch_size=2, sample_size=10, max_grad_norm=1.0, noise_multiplier=1.0)
